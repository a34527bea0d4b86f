"""Whole runs on a local Ray cluster: every mode, the staleness bound checked from the
trajectory dumps, the ledger, partial rollouts spanning policy versions."""

from __future__ import annotations

import asyncio
import json
import sys
import time

import pytest
import torch

from miles.config import resolve
from miles.driver import train
from tests.integration.conftest import read_jsonl, run_flags


def _run(tiny_ckpt, task, out, **extra):
    cfg = resolve(run_flags(tiny_ckpt, task, out, **extra))
    summary = asyncio.run(train(cfg))
    return cfg, summary


def _kernel_builds() -> bool:
    from miles.kernels import cpu_decode

    try:
        cpu_decode.library()
        cpu_decode.torch_sgemm()
    except cpu_decode.KernelUnavailable:
        return False
    return True


def _check_staleness(out, eta: int) -> list[dict]:
    rows = read_jsonl(out / "trajectories.jsonl")
    assert rows, "no trajectories dumped"
    for row in rows:
        loss_versions = [v for v, m in zip(row["token_versions"], row["loss_mask"]) if m]
        if loss_versions:
            assert row["trainer_version"] - min(loss_versions) <= eta, row["id"]
        assert len(row["token_versions"]) == len(row["loss_mask"]) == len(row["rollout_logprobs"])
    return rows


@pytest.mark.parametrize(
    ("mode", "eta", "extra"),
    [
        ("sync", 0, {}),
        ("one-step-off", 1, {}),
        ("async", 2, {"max_staleness": 2}),
    ],
)
def test_modes_respect_bound_and_ledger(ray_cluster, tiny_ckpt, task, tmp_path, mode, eta, extra) -> None:
    out = tmp_path / mode
    cfg, summary = _run(tiny_ckpt, task, out, mode=mode, **extra)
    assert summary["status"] == "completed" and summary["steps"] == cfg.run.num_rollout
    assert summary["ledger_ok"]
    # the CPU default, wherever the kernel builds (a machine with no C compiler: torch ops)
    assert all(w["engine/cpu_decode_kernel"] == float(_kernel_builds()) for w in summary["workers"])
    ledger = summary["ledger"]
    assert ledger["trained"] == cfg.run.num_rollout * 4 * 4
    rows = _check_staleness(out, eta)
    assert len(rows) == ledger["trained"]
    assert len({r["id"] for r in rows}) == len(rows), "a trajectory was trained twice"
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, cfg.run.num_rollout + 1))
    for key in ("perf/trained_samples_per_s", "rollout/reward_mean", "buffer/staleness_max",
                "train/tis_ratio_mean", "train/mismatch_kl_k1", "perf/wait_for_data_s"):
        assert key in metrics[-1], key
    assert max(m["buffer/staleness_max"] for m in metrics) <= eta
    # the buffer's own work, by method: the parts add up to the whole, and the longest call
    # of each is within its total (a burst in busy_s names its call)
    last = metrics[-1]
    parts = {k.rsplit("/", 1)[1]: v for k, v in last.items() if k.startswith("perf/buffer_busy_s/")}
    assert {"add_prompts", "lease", "get_batch"} <= parts.keys()
    assert sum(parts.values()) == pytest.approx(last["perf/buffer_busy_s"], rel=1e-6)
    assert all(0.0 < last[f"perf/buffer_call_max_s/{name}"] <= total for name, total in parts.items())
    saved = json.loads((out / "summary.json").read_text())
    assert saved["status"] == "completed"
    # where the time before step 1 went: the actors' construction lies within the start-up
    up = saved["startup"]
    assert 0.0 < up["trainer_init_s"] < up["startup_s"] and 0.0 < up["worker_init_s_max"] < up["startup_s"]
    # the slowest worker's engine construction, by part, within its init
    parts = {k: v for k, v in up.items() if k.startswith("worker_init_") and k != "worker_init_s_max"}
    assert {"worker_init_load_checkpoint_s", "worker_init_runner_s", "worker_init_to_device_s"} <= parts.keys()
    assert 0.0 < sum(parts.values()) < up["worker_init_s_max"]
    # and the first step's parts: launch to its batch, its train call, launch to its end
    assert up["startup_s"] < up["first_batch_s"] < up["first_step_s"]
    assert 0.0 < up["first_train_s"] < up["first_step_s"] - up["first_batch_s"]
    assert (out / "config.yaml").is_file()


def test_partial_rollout_spans_versions(ray_cluster, tiny_ckpt, task, tmp_path) -> None:
    """Long generations and in-place weight updates: trajectories carry ≥ 2 versions."""
    out = tmp_path / "partial"
    cfg, summary = _run(
        tiny_ckpt, task, out, mode="async", max_staleness=4, partial_rollout=True,
        rollout_max_response_len=160, num_rollout=6, rollout_batch_size=2,
        stale_policy="mask",
        # A trajectory spans versions only if it is still generating when an update lands:
        # decode must be slower than a train step. The CPU kernel decodes these 160 tokens
        # in ~50 ms, under one step; the torch ops take ~5x longer.
        cpu_decode_kernel=False,
    )
    assert summary["status"] == "completed" and summary["ledger_ok"]
    rows = _check_staleness(out, 4)
    spans = [len({v for v, m in zip(r["token_versions"], r["loss_mask"]) if m}) for r in rows]
    assert max(spans) >= 2, "no trajectory spanned two policy versions"
    for r in rows:  # versions never decrease along a trajectory
        assert r["token_versions"] == sorted(r["token_versions"])
        kv = r["kv_versions"]  # the oldest version in the row's cache: never above the token's
        assert len(kv) == len(r["token_versions"]) and kv == sorted(kv)
        assert all(k <= v for k, v in zip(kv, r["token_versions"]))
    # rows continued across an in-place update on their kept cache (--keep-kv-cache-on-update)
    mixed = [sum(k < v for k, v, m in zip(r["kv_versions"], r["token_versions"], r["loss_mask"]) if m)
             for r in rows]
    assert sum(mixed) > 0, "no loss token was sampled on a cache holding an older version"
    metrics = read_jsonl(out / "metrics.jsonl")
    n_loss = [sum(r["loss_mask"]) for r in rows]
    by_step: dict[int, list[int]] = {}
    for r, m_, n in zip(rows, mixed, n_loss):
        by_step.setdefault(r["step"], [0, 0])
        by_step[r["step"]][0] += m_
        by_step[r["step"]][1] += n
    for m in metrics:  # the logged share is exactly the dumped rows' share
        got, total = by_step[m["step"]]
        assert m["train/mixed_version_kv_frac"] == pytest.approx(got / total if total else 0.0)
    assert summary["ledger"]["trained"] == len(rows) == len({r["id"] for r in rows})


def test_sglang_backend_end_to_end(ray_cluster, tiny_ckpt, task, tmp_path) -> None:
    """The whole loop with rollouts served over SGLang's HTTP protocol: the worker launches
    `miles serve`, generates through the adapter, and pushes weights over a gloo group."""
    out = tmp_path / "sglang"
    cfg, summary = _run(
        tiny_ckpt, task, out, rollout_backend="sglang", sglang_launch=True,
        sglang_launch_command=[sys.executable, "-m", "miles", "serve"], sglang_port=0, num_rollout=3,
    )
    assert summary["status"] == "completed" and summary["ledger_ok"]
    rows = _check_staleness(out, 1)
    # weights really moved: some tokens come from a later policy than the first (which one
    # depends on when the pushes land; a batch may skip version 1 and go straight to 2)
    assert max(v for r in rows for v in r["token_versions"]) >= 1


def test_eval_and_hf_export(ray_cluster, tiny_ckpt, task, tmp_path) -> None:
    from safetensors.torch import load_file

    from miles.models import load_pretrained

    out = tmp_path / "eval"
    cfg, summary = _run(tiny_ckpt, task, out, eval_prompt_data=task["data"], eval_interval=2,
                        eval_max_prompts=5, n_samples_per_eval_prompt=2, save_hf=str(tmp_path / "hf"))
    assert summary["status"] == "completed"
    evals = read_jsonl(out / "eval.jsonl")
    assert [e["step"] for e in evals] == [0, 2, 4]
    assert all(e["eval/prompts"] == 5 and "eval/pass@2" in e for e in evals)
    model = load_pretrained(tmp_path / "hf")  # a plain HF checkpoint miles (or transformers) loads
    before = load_file(str(tiny_ckpt / "model.safetensors"))
    after = {k: v for k, v in model.state_dict().items() if k in before}
    assert any(not after[k].equal(before[k]) for k in before), "exported weights never moved"


def test_moe_run_with_rollout_routing_replay(ray_cluster, task, tmp_path) -> None:
    """--use-rollout-routing-replay on an MoE checkpoint: rollouts record each token's
    experts (through partial rollouts across updates) and the trainer replays them; the
    trainer refuses trajectories without routing, so a completed run proves the recording."""
    import torch

    from miles.models import CausalLM, build_tiny_tokenizer, save_pretrained, tiny_config

    torch.manual_seed(0)
    ckpt = tmp_path / "moe"
    model = CausalLM(tiny_config(moe=True))
    model.reset_parameters()
    save_pretrained(model, ckpt, tokenizer=build_tiny_tokenizer())
    cfg, summary = _run(ckpt, task, tmp_path / "out", mode="async", max_staleness=1, partial_rollout=True,
                        use_rollout_routing_replay=True, num_rollout=3)
    assert summary["status"] == "completed" and summary["ledger_ok"]


def test_more_gpus_than_the_cluster_has_is_a_clear_error(ray_cluster, tiny_ckpt, task, tmp_path) -> None:
    """Asking for GPUs the Ray cluster does not have fails at once, naming both counts,
    instead of a placement group waiting for them."""
    from miles.config import ConfigError

    cfg = resolve(run_flags(tiny_ckpt, task, tmp_path / "gpus", actor_num_gpus_per_node=1, colocate=True))
    start = time.monotonic()
    with pytest.raises(ConfigError, match=r"needs 1 GPUs \(trainer 1\); the Ray cluster has 0"):
        asyncio.run(train(cfg))
    assert time.monotonic() - start < 60
    assert not (tmp_path / "gpus" / "summary.json").exists()


@pytest.mark.parametrize("flags", [  # FP8's engine/trainer agreement: tests/unit/trainers/test_quant_consistency.py
    dict(quantization="int4-qat", int4_group_size=32, int4_targets="all-linear"),
])
def test_quantized_run_ships_quantized_weights_and_exports_beside_bf16(ray_cluster, tiny_ckpt, task, tmp_path,
                                                                       flags) -> None:
    """A whole run under --quantization: weights reach the engines in their quantized form,
    and --save-hf writes the bf16 export with the quantized one beside it (loadable back)."""
    from miles.models import load_pretrained
    from miles.models.quant import QuantSpec, qdq_weight

    out = tmp_path / "q"
    # Synchronous, so step 2 trains on tokens sampled after the first quantized update whatever
    # the timing (an async run may train both steps on version 0).
    cfg, summary = _run(tiny_ckpt, task, out, save_hf=str(tmp_path / "hf"), num_rollout=2, mode="sync", **flags)
    assert summary["status"] == "completed" and summary["ledger_ok"]
    kind = "fp8" if flags["quantization"] == "fp8" else "int4"
    bf16 = load_pretrained(tmp_path / "hf")
    quantized = load_pretrained(tmp_path / f"hf-{kind}")
    spec = QuantSpec(kind, cfg.quant.int4_group_size, cfg.quant.int4_targets)
    name = "model.layers.1.mlp.down_proj.weight"
    assert torch.equal(quantized.state_dict()[name], qdq_weight(bf16.state_dict()[name], spec))
    rows = read_jsonl(out / "trajectories.jsonl")
    assert max(v for r in rows for v in r["token_versions"]) >= 1  # quantized updates were applied
