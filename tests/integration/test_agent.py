"""Agent runs end to end on the session's local Ray cluster (conftest.py), tiny model, CPU.

- the example (examples/agent/) trains in its smoke mode and reports the worker's busy time
  and episodes in flight (the benchmark's busy / slot columns);
- a run of agents that work and agents that go wrong: the bad ones are FAILED with their
  reason and counted, refused requests get 4xx, the run completes, the ledger sums; the
  trained trajectories hold exactly the ids the agents were sent, with model tokens
  carrying loss and every other token masked.
"""

from __future__ import annotations

import json
from pathlib import Path

from miles.cli import main
from miles.models import CausalLM, build_tiny_tokenizer, save_pretrained, tiny_config

ROOT = Path(__file__).resolve().parents[2]
AGENTS = Path(__file__).with_name("agentic_agents.py")


def test_example_smoke(ray_cluster, tmp_path) -> None:
    from miles.utils.loading import load_function

    load_function(f"{ROOT}/examples/agent/agent.py:prepare")(str(tmp_path), 32)
    out = tmp_path / "out"
    argv = ["train", "--config", str(ROOT / "examples/agent/config.yaml"), "--hf-checkpoint", str(tmp_path / "ckpt"),
            "--prompt-data", str(tmp_path / "train.jsonl"), "--output-dir", str(out), "--no-progress",
            "--custom-agent-function-path", f"{ROOT}/examples/agent/agent.py:agent",
            "--num-rollout", "2", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
            # Synchronous and without partial rollouts no call is ever aborted, so every episode
            # must finish: in the example's async mode an episode whose call the buffer recalls
            # fails by design (agent episodes are not parked), at a rate that depends on timing.
            "--mode", "sync", "--no-partial-rollout"]
    assert main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["ledger_ok"]
    assert summary["workers"][0]["rollout/failed"] == 0
    rows = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    assert rows and all(r["loss_mask"][0] == 1 and r["segments"][0][2] == "model" for r in rows)
    # the agent path records the occupancy integrals the benchmark's busy / slot columns read
    from benchmarks.agentic import summarize

    worker = summary["workers"][0]
    assert 0 < worker["agent/busy_s"] <= worker["agent/window_s"] and worker["agent/episode_s"] >= worker["agent/busy_s"]
    figures = summarize(out, inflight=1)
    assert 0 < figures["busy"] <= 1 and figures["slots"] > 0


def test_good_and_bad_agents(ray_cluster, tmp_path) -> None:
    labels = ["ok", "raise", "ok", "hang", "late", "refused", "ok", "none"]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"input": f"task {i}", "label": lab}) + "\n" for i, lab in enumerate(labels)))
    ckpt = tmp_path / "ckpt"
    save_pretrained(CausalLM(tiny_config()), ckpt, tokenizer=build_tiny_tokenizer())
    out = tmp_path / "out"
    argv = ["train", "--hf-checkpoint", str(ckpt), "--prompt-data", str(data), "--output-dir", str(out),
            "--no-progress", "--custom-agent-function-path", f"{AGENTS}:scripted", "--agent-timeout-s", "2",
            "--custom-rm-path", f"{AGENTS}:zero_reward",
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--num-rollout", "3",
            "--rollout-max-response-len", "400", "--lr", "1e-4", "--mode", "async", "--max-staleness", "2",
            "--partial-rollout", "--stale-policy", "mask", "--dump-trajectories"]
    assert main(argv) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["ledger_ok"]
    worker = summary["workers"][0]
    assert worker.get("agent/failed/agent_error", 0) >= 2 and worker.get("agent/failed/agent_timeout", 0) >= 2
    assert summary["ledger"]["dropped"].get("failed", 0) >= 4
    rows = [json.loads(line) for line in (out / "trajectories.jsonl").read_text().splitlines()]
    assert rows
    for row in rows:
        assert row["label"] in ("ok", "late", "refused", "none")
        kinds = [k for s, e, k in row["segments"] for _ in range(e - s)]
        model = [row["response_tokens"][s:e] for s, e, k in row["segments"] if k == "model"]
        assert model == row["metadata"]["received"]  # exactly the ids the agent was sent
        cutoff = row["trainer_version"] - 2
        for v, m, k, lp in zip(row["versions"], row["loss_mask"], kinds, row["logprobs"]):
            if k == "env":
                assert m == 0 and lp == 0.0
            else:
                assert m == int(v >= cutoff)
        assert row["versions"] == sorted(row["versions"])
        if row["label"] == "late" and "late_status" in row["metadata"]:
            assert row["metadata"]["late_status"] == 410
        if row["label"] == "refused":
            assert row["metadata"]["refused"] == [400, 400]
        if row["label"] == "none":
            assert row["reward"] == 0.0  # left to --custom-rm-path
