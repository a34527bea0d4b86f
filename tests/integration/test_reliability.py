"""Fault injection on whole runs: exact resume, a worker killed mid-run, the trainer dying,
a reward function that hangs, the driver killed with SIGKILL and resumed."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
from safetensors.torch import load_file

from miles.config import resolve
from miles.driver import Driver, RunFailed, train
from tests.integration.conftest import read_jsonl, run_flags

def _stable(row: dict) -> dict:
    """Metrics that must not depend on timing (the training numbers)."""
    return {k: v for k, v in row.items() if k.startswith("train/") and "time" not in k
            and "tokens_per_s" not in k}


def _weights(step_dir: Path) -> dict:
    return load_file(str(step_dir / "trainer.safetensors"))


def test_exact_resume_is_bitwise(ray_cluster, tiny_ckpt, task, tmp_path) -> None:
    common = dict(mode="sync", deterministic=True, num_rollout=4, save_interval=1,
                  rollout_max_response_len=12, keep_checkpoints=10)
    full = tmp_path / "full"
    asyncio.run(train(resolve(run_flags(tiny_ckpt, task, full / "out", save=str(full / "ck"), **common))))
    part = tmp_path / "part"
    first = dict(common, num_rollout=2, save_interval=0)  # the checkpoint a run writes at its end
    asyncio.run(train(resolve(run_flags(tiny_ckpt, task, part / "out", save=str(part / "ck"), **first))))
    assert [p.name for p in sorted((part / "ck").glob("step_*"))] == ["step_000002"]
    summary = asyncio.run(train(resolve(run_flags(
        tiny_ckpt, task, part / "out", save=str(part / "ck"), load=str(part / "ck"), **common))))
    assert summary["status"] == "completed" and summary["steps"] == 4 and summary["ledger_ok"]
    a = {r["step"]: _stable(r) for r in read_jsonl(full / "out" / "metrics.jsonl")}
    b = {r["step"]: _stable(r) for r in read_jsonl(part / "out" / "metrics.jsonl")}
    assert a == b
    wa, wb = _weights(full / "ck" / "step_000004"), _weights(part / "ck" / "step_000004")
    assert wa.keys() == wb.keys()
    for key in wa:
        assert wa[key].equal(wb[key]), key


def _driver(tiny_ckpt, task, out, **extra) -> Driver:
    from miles.actors.factory import load_datasets

    cfg = resolve(run_flags(tiny_ckpt, task, out, **extra))
    return Driver(cfg, *load_datasets(cfg))


async def _when_step(driver: Driver, step: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while driver.step < step:
        assert time.monotonic() < deadline, "run did not reach the step"
        await asyncio.sleep(0.05)


def test_worker_killed_mid_generation_is_replaced(ray_cluster, tiny_ckpt, task, tmp_path) -> None:
    driver = _driver(tiny_ckpt, task, tmp_path / "out", num_rollout=8, rollout_max_response_len=64,
                     num_rollout_workers=2, health_check_interval_s=0.2)

    async def scenario() -> dict:
        run = asyncio.create_task(driver.run())
        await _when_step(driver, 1)
        victim_id, victim = next(iter(driver.actors.workers.items()))
        stats = await victim.ping.remote()
        os.kill(int(stats["rollout/pid"]), signal.SIGKILL)  # kill -9 in mid-generation
        noticed = time.monotonic()
        while victim_id in driver.actors.workers:
            await asyncio.sleep(0.05)
        assert time.monotonic() - noticed < 5.0, "the driver took too long to notice"
        return await run

    summary = asyncio.run(scenario())
    assert summary["status"] == "completed" and summary["ledger_ok"]
    assert sum(summary["worker_restarts"].values()) == 1
    ledger = summary["ledger"]
    assert ledger["trained"] == 8 * 4 * 4
    rows = read_jsonl(tmp_path / "out" / "trajectories.jsonl")
    assert len({r["id"] for r in rows}) == len(rows)  # nothing trained twice


def test_trainer_death_stops_run_with_checkpoint(ray_cluster, tiny_ckpt, task, tmp_path) -> None:
    driver = _driver(tiny_ckpt, task, tmp_path / "out", num_rollout=50, save=str(tmp_path / "ck"),
                     save_interval=1, health_check_interval_s=0.2)

    async def scenario() -> None:
        run = asyncio.create_task(driver.run())
        await _when_step(driver, 2)
        ray.kill(driver.actors.trainer, no_restart=True)
        await run

    with pytest.raises(RunFailed, match="PolicyTrainer"):
        asyncio.run(scenario())
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["status"] == "failed" and "last checkpoint" in summary["failure"]
    assert (tmp_path / "ck" / "latest").is_file()


def test_hanging_and_raising_rewards_fail_samples_not_the_run(ray_cluster, tiny_ckpt, task, tmp_path) -> None:
    rm = tmp_path / "rm.py"
    rm.write_text(
        "import time\n"
        "def reward(sample):\n"
        "    if sample.label == '3':\n        time.sleep(30)\n"
        "    if sample.label == '4':\n        raise RuntimeError('boom')\n"
        "    if sample.label == '5':\n        return float('nan')\n"
        "    return 1.0\n"
    )
    cfg = resolve(run_flags(tiny_ckpt, task, tmp_path / "out", custom_rm_path=f"{rm}:reward",
                            reward_timeout_s=0.5, num_rollout=3))
    summary = asyncio.run(train(cfg))
    assert summary["status"] == "completed" and summary["ledger_ok"]
    assert summary["ledger"]["dropped"].get("failed", 0) > 0
    rows = read_jsonl(tmp_path / "out" / "trajectories.jsonl")
    assert all(r["label"] not in ("3", "4", "5") for r in rows)


def test_driver_killed_and_resumed(ray_cluster, tiny_ckpt, task, tmp_path) -> None:
    """SIGKILL the whole driver process group mid-run; --load continues to the end with
    every prompt trained exactly once."""
    ck, out = tmp_path / "ck", tmp_path / "out"
    argv = [sys.executable, "-m", "miles", "train", "--hf-checkpoint", str(tiny_ckpt),
            "--prompt-data", task["data"], "--custom-rm-path", task["rm"], "--output-dir", str(out),
            "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--num-rollout", "6",
            "--rollout-max-response-len", "24", "--save", str(ck), "--save-interval", "1",
            "--dump-trajectories", "--no-progress", "--dev", "ray_num_cpus=2"]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.Popen(argv, env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 180
        while not (ck / "latest").is_file() or (ck / "latest").read_text().strip() < "step_000002":
            assert proc.poll() is None, "the run ended before it could be killed"
            assert time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the driver and the Ray cluster it started
        proc.wait()
    assert not (out / "summary.json").exists()
    resumed = subprocess.run(argv + ["--load", str(ck)], env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 6 and summary["ledger_ok"]
    assert summary["ledger"]["trained"] == 6 * 16
    steps = [r["step"] for r in read_jsonl(out / "trajectories.jsonl")]
    assert max(steps) == 6  # the resumed run trained the last steps


def test_a_reward_that_always_fails_stops_the_run_with_its_reason(ray_cluster, tiny_ckpt, task, tmp_path) -> None:
    """No group can ever be trained: the run stops with the reward's own problem instead of
    waiting for data forever, and its summary says why."""
    rm = tmp_path / "none_rm.py"
    rm.write_text("def reward(sample):\n    return None\n")
    cfg = resolve(run_flags(tiny_ckpt, task, tmp_path / "out", custom_rm_path=f"{rm}:reward",
                            max_failed_groups_in_a_row=6, health_check_interval_s=0.2))
    with pytest.raises(RunFailed, match=r"last \d+ groups .*reward_invalid"):
        asyncio.run(train(cfg))
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["status"] == "failed" and "--custom-rm-path" in summary["failure"]
