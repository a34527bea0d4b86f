"""Memory on whole runs: an engine that runs out of memory mid-run slows down instead of
failing (same trained tokens, exact ledger); one that cannot fit a single row stops the run
naming the knobs; --offload-rollout releases and refills the engine between steps."""

from __future__ import annotations

import asyncio

import pytest

from miles.config import resolve
from miles.driver import RunFailed, train
from tests.integration.conftest import read_jsonl, run_flags

SYNC = dict(mode="sync", deterministic=True, num_rollout=3, rollout_max_response_len=12, max_batch_size=16)


def _trained(out) -> dict[int, list[tuple[str, list[int]]]]:
    by_step: dict[int, list[tuple[str, list[int]]]] = {}
    for row in read_jsonl(out / "trajectories.jsonl"):
        by_step.setdefault(row["step"], []).append((row["prompt_id"], row["index_in_group"], row["response_tokens"]))
    return {k: sorted(v) for k, v in by_step.items()}


def test_engine_oom_mid_run_is_a_slowdown(ray_cluster, tiny_ckpt, task, tmp_path) -> None:
    clean = asyncio.run(train(resolve(run_flags(tiny_ckpt, task, tmp_path / "clean", **SYNC))))
    # an OOM in the first prefill, and in a decode step of the second step's rollout
    hit = asyncio.run(train(resolve(run_flags(tiny_ckpt, task, tmp_path / "hit", inject_oom_steps=[1, 20],
                                              **SYNC))))
    assert clean["status"] == hit["status"] == "completed" and hit["ledger_ok"] and clean["ledger_ok"]
    rows = read_jsonl(tmp_path / "hit" / "metrics.jsonl")
    assert rows[-1]["mem/engine_oom_recovered"] == 2 and rows[-1]["mem/oom_recovered"] == 2
    assert rows[-1]["engine/batch_limit"] < 16
    assert read_jsonl(tmp_path / "clean" / "metrics.jsonl")[-1]["mem/oom_recovered"] == 0
    assert _trained(tmp_path / "hit") == _trained(tmp_path / "clean")  # the same tokens trained


def test_engine_oom_on_one_row_stops_the_run_naming_the_knobs(ray_cluster, tiny_ckpt, task, tmp_path) -> None:
    # one row at a time: the injected OOM has nothing to park
    cfg = resolve(run_flags(tiny_ckpt, task, tmp_path / "out", max_batch_size=1, inject_oom_steps=[3],
                            health_check_interval_s=0.2, **{k: v for k, v in SYNC.items() if k != "max_batch_size"}))
    with pytest.raises(RunFailed, match="--engine-mem-fraction.*--max-batch-size"):
        asyncio.run(train(cfg))
