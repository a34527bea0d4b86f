"""benchmarks/memory.py on the CPU with the tiny shape: the same phases the H200 run goes
through (rollout, engine offload, train step, weight update that refills the engine), for a
full-parameter and a LoRA run, and the summary table and log section."""

from __future__ import annotations

import argparse
import asyncio
import json

from benchmarks import memory


def _args(mode: str, **kw) -> argparse.Namespace:
    base = dict(shape="tiny", mode=mode, device="cpu", steps=2, prompts=2, samples=2, response_len=8,
                micro_batch=2, lora_rank=4, bucket_bytes=1 << 16, offload=True, engine_weights="auto", engine_base="auto")
    return argparse.Namespace(**{**base, **kw})


def test_tiny_cpu_runs_both_modes_and_summarizes(tmp_path) -> None:
    full = asyncio.run(memory.run(_args("full")))
    lora = asyncio.run(memory.run(_args("lora")))
    assert [len(r["steps"]) for r in (full, lora)] == [2, 2]
    assert full["engine_weights"] == "discard" and lora["engine_weights"] == "host"
    for r in (full, lora):
        for s in r["steps"]:
            assert s["offload_bytes"] > 0 and s["train_tokens"] == 2 * 2 * 8 and s["update_bytes"] > 0
    assert full["steps"][0]["update_bytes"] == full["full_update_bytes"]  # every weight, in the engine dtype
    assert lora["steps"][0]["update_bytes"] < 0.5 * lora["full_update_bytes"]  # adapters only
    assert full["offload_rollout_s"] > 0 and full["oom_recovered"] == 0
    # LoRA: the engine serves the trainer's base (one copy); full training keeps the engine's own
    assert (lora["lora_path"], lora["lora_shared_base"], full["lora_shared_base"]) == ("shared", 1.0, 0.0)
    assert lora["engine_shared_bytes"] > 0 and full["engine_shared_bytes"] == 0
    assert all(s["offload_bytes"] < full["steps"][0]["offload_bytes"] for s in lora["steps"])  # KV cache only
    own = asyncio.run(memory.run(_args("lora", steps=1, engine_base="own")))
    assert (own["lora_path"], own["why_not_shared"]) == ("merged", "--engine-base own")
    paths = []
    for name, r in (("full", full), ("lora", lora)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(r))
    log = tmp_path / "memory.md"
    memory.summarize([str(p) for p in paths] + [str(tmp_path / "missing.json")], str(log))
    text = log.read_text()
    assert "| tiny | full | discard | 2 |" in text and "| tiny | lora r=4 shared | host | 2 |" in text
    assert "LoRA update" in text and "(no result:" in text
