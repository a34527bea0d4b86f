"""Memory on whole runs: an engine that runs out of memory mid-run slows down instead of
failing (same trained tokens, exact ledger); one that cannot fit a single row stops the run
naming the knobs; --offload-rollout releases and refills the engine between steps."""

from __future__ import annotations

import asyncio

import pytest

from miles.config import resolve
from miles.driver import RunFailed, train
from tests.integration.conftest import read_jsonl, run_flags

SYNC = dict(mode="sync", deterministic=True, num_rollout=2, rollout_max_response_len=12, max_batch_size=16,
            max_seq_len=48)


def _trained(out) -> dict[int, list[tuple[str, list[int]]]]:
    by_step: dict[int, list[tuple[str, list[int]]]] = {}
    for row in read_jsonl(out / "trajectories.jsonl"):
        by_step.setdefault(row["step"], []).append((row["prompt_id"], row["index_in_group"], row["response_tokens"]))
    return {k: sorted(v) for k, v in by_step.items()}


@pytest.fixture(scope="module")
def clean(ray_cluster, tiny_ckpt, task, tmp_path_factory):
    out = tmp_path_factory.mktemp("clean")
    summary = asyncio.run(train(resolve(run_flags(tiny_ckpt, task, out, **SYNC))))
    assert summary["status"] == "completed" and summary["ledger_ok"]
    return out


def test_engine_oom_mid_run_is_a_slowdown(ray_cluster, tiny_ckpt, task, tmp_path, clean) -> None:
    # an OOM in the first prefill, and in a decode step of the second step's rollout
    hit = asyncio.run(train(resolve(run_flags(tiny_ckpt, task, tmp_path / "hit", inject_oom_steps=[1, 20],
                                              **SYNC))))
    assert hit["status"] == "completed" and hit["ledger_ok"]
    worker = hit["workers"][0]  # the worker's counters at the end of the run
    assert worker["mem/engine_oom_recovered"] == 2 and worker["engine/batch_limit"] < 16
    for row in read_jsonl(tmp_path / "hit" / "metrics.jsonl"):  # the engines' count as last pinged, plus the trainer's
        assert row["mem/oom_recovered"] == row["mem/train_oom_recovered"] + row.get("mem/engine_oom_recovered", 0)
    assert all(r["mem/oom_recovered"] == 0 for r in read_jsonl(clean / "metrics.jsonl"))
    assert _trained(tmp_path / "hit") == _trained(clean)  # the same tokens trained


def test_engine_oom_on_one_row_stops_the_run_naming_the_knobs(ray_cluster, tiny_ckpt, task, tmp_path) -> None:
    # one row at a time: the injected OOM has nothing to park
    cfg = resolve(run_flags(tiny_ckpt, task, tmp_path / "out", max_batch_size=1, inject_oom_steps=[3],
                            health_check_interval_s=0.2, **{k: v for k, v in SYNC.items() if k != "max_batch_size"}))
    with pytest.raises(RunFailed, match="--engine-mem-fraction.*--max-batch-size"):
        asyncio.run(train(cfg))


def test_offload_rollout_releases_between_steps_and_trains_the_same(ray_cluster, tiny_ckpt, task, tmp_path,
                                                                   clean) -> None:
    summary = asyncio.run(train(resolve(run_flags(tiny_ckpt, task, tmp_path / "off", colocate=True,
                                                  offload_rollout=True, **SYNC))))
    assert summary["status"] == "completed" and summary["ledger_ok"]
    worker = summary["workers"][0]
    assert worker["mem/offload_rollout_s"] > 0 and worker["mem/offload_rollout_bytes"] > 0
    assert worker["engine/weight_updates"] >= 2  # each step's weights re-filled what was released
    assert _trained(tmp_path / "off") == _trained(clean)  # released, refilled, the same run


def test_colocated_lora_run_on_the_cpu_keeps_the_merged_path_and_says_so(ray_cluster, tiny_ckpt, task,
                                                                         tmp_path) -> None:
    """The worker asks the trainer for its base (``base_offer``); a CPU trainer cannot share its
    memory with another process, so the engine loads its own copy and merges the adapters."""
    summary = asyncio.run(train(resolve(run_flags(tiny_ckpt, task, tmp_path / "lora", colocate=True,
                                                  offload_rollout=True, lora_rank=4, **SYNC))))
    assert summary["status"] == "completed" and summary["ledger_ok"]
    worker = summary["workers"][0]
    assert worker["engine/lora_shared_base"] == 0.0 and worker["engine/weight_updates"] >= 2


@pytest.mark.parametrize("extra, match", [
    (dict(mode="async", offload_rollout=True), "--offload-rollout .* needs --colocate"),
    (dict(mode="sync", offload_rollout=True, colocate=True, rollout_backend="sglang"), "--rollout-backend embedded"),
    (dict(lora_rank=8, lora_target_modules=["qkv"]), "matches no linear layer"),
    (dict(lora_rank=4096), "larger than"),
    (dict(offload_train=True), "--offload-train .* needs --colocate"),
])
def test_bad_memory_settings_fail_before_anything_starts(tiny_ckpt, task, tmp_path, extra, match) -> None:
    from miles.config import ConfigError

    with pytest.raises(ConfigError, match=match):
        resolve(run_flags(tiny_ckpt, task, tmp_path / "out", **extra))
    assert not (tmp_path / "out").exists()
