"""Weight transports across processes on the CPU: the distributed path over gloo (the code
NCCL runs on GPUs), in a raw three-rank group and in whole Ray runs with two rollout
workers — every version reaches every worker, tokens' versions advance, the ledger holds —
including a worker killed mid-run (the group is rebuilt, the new worker resynced), and
changed-only updates through the object store."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal

import pytest
import torch

from miles.config import resolve
from miles.driver import Driver, train
from miles.transports.distributed import DistributedReceiver, DistributedSender
from miles.transports.weights import plan_buckets
from tests.integration.conftest import read_jsonl, run_flags


def _named(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(f"w{i}", torch.randn(50 + i, 7, generator=g)) for i in range(12)]


def _receiver(spec, rank: int, inbox, outbox) -> None:
    receiver = DistributedReceiver("cpu")
    receiver.join(spec, rank)
    for seed in (0, 1):
        update = inbox.get()
        got: dict[str, torch.Tensor] = {}

        def stage(named):
            got.update((n, t.clone()) for n, t in named)
            return len(named)

        def drop(named):
            return 0

        n = asyncio.run(receiver.receive(update, stage if rank == 1 or seed == 0 else drop))
        ok = all(torch.equal(got[k], t.to(torch.bfloat16)) for k, t in _named(seed)) if got else None
        outbox.put((rank, seed, n, ok))
    receiver.close()


def test_gloo_broadcast_reaches_every_rank_bitwise() -> None:
    sender = DistributedSender(backend="gloo", device="cpu", dtype=torch.bfloat16, timeout_s=60,
                               address="127.0.0.1")
    spec = sender.new_spec(3)
    ctx = mp.get_context("spawn")
    boxes = [(ctx.Queue(), ctx.Queue()) for _ in range(2)]
    procs = [ctx.Process(target=_receiver, args=(spec, i + 1, *boxes[i]), daemon=True) for i in range(2)]
    for p in procs:
        p.start()
    try:
        sender.join(spec)
        results = []
        for seed in (0, 1):
            plans = list(plan_buckets(_named(seed), 1500))
            update = sender.prepare(seed + 1, plans, members=["a", "b"])
            assert len(update.buckets) > 3
            for inbox, _ in boxes:
                inbox.put(update)
            sender.transfer(update)
            results += [outbox.get(timeout=60) for _, outbox in boxes]
    finally:
        sender.close()
        for p in procs:
            p.join(timeout=30)
    assert sorted(results) == [(1, 0, 12, True), (1, 1, 12, True), (2, 0, 12, True), (2, 1, 0, None)]


def _run(tiny_ckpt, task, out, **extra):
    cfg = resolve(run_flags(tiny_ckpt, task, out, **extra))
    return cfg, asyncio.run(train(cfg))


def _token_versions(out) -> set[int]:
    return {v for row in read_jsonl(out / "trajectories.jsonl") for v in row["token_versions"]}


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_gloo_transport_with_two_workers(ray_cluster, tiny_ckpt, task, tmp_path, mode) -> None:
    out = tmp_path / mode
    cfg, summary = _run(tiny_ckpt, task, out, mode=mode, weight_transport="gloo", num_rollout_workers=2,
                        max_staleness=1, weight_transport_timeout_s=60)
    assert summary["status"] == "completed" and summary["ledger_ok"]
    assert summary["ledger"]["trained"] == cfg.run.num_rollout * 4 * 4
    eta = 0 if mode == "sync" else 1  # the last step trains at version num_rollout - 1
    assert max(_token_versions(out)) >= cfg.run.num_rollout - 1 - eta  # tokens from fresh weights
    workers = summary["workers"]
    assert len(workers) == 2
    for stats in workers:  # every version went over the group to every worker, none fell back
        assert stats["rollout/weight_updates_distributed"] == cfg.run.num_rollout
        assert stats.get("rollout/weight_updates_object_store", 0) == 0


@pytest.mark.parametrize("start_delay_s", [0.0, 8.0], ids=["fast-start", "slow-start"])
def test_gloo_group_is_rebuilt_after_a_worker_dies(ray_cluster, tiny_ckpt, task, tmp_path, monkeypatch,
                                                   start_delay_s) -> None:
    """``slow-start``: the replacement's constructor takes longer than the health-ping timeout
    (a loaded machine): its start-up deadline waits for it, and no slow start counts as a crash."""
    from miles.actors import ray_actors
    from miles.actors.factory import load_datasets

    cfg = resolve(run_flags(tiny_ckpt, task, tmp_path / "out", num_rollout=6, rollout_max_response_len=48,
                            num_rollout_workers=2, health_check_interval_s=0.2, weight_transport="gloo",
                            weight_transport_timeout_s=30))
    driver = Driver(cfg, *load_datasets(cfg))

    async def scenario() -> dict:
        run = asyncio.create_task(driver.run())
        while driver.step < 1 and not run.done():  # event-based: no wall-clock bound on a loaded machine
            await asyncio.sleep(0.05)
        assert not run.done(), f"the run ended before step 1: {run.result()}"
        victim_id, victim = next(iter(driver.actors.workers.items()))
        name = victim_id.rsplit("-", 1)[0]
        train_step = driver._train_step

        async def after_the_replacement_joined() -> None:  # the replacement joins asynchronously
            while not driver.stop.is_set() and not any(
                    w != victim_id and w.startswith(name + "-") for w in driver.workers.runs):
                await asyncio.sleep(0.05)
            await train_step()

        driver._train_step = after_the_replacement_joined
        monkeypatch.setattr(ray_actors, "TEST_START_DELAY_S", start_delay_s)  # the replacement only
        os.kill(int((await victim.ping.remote())["rollout/pid"]), signal.SIGKILL)
        return await run

    summary = asyncio.run(scenario())
    assert summary["status"] == "completed" and summary["ledger_ok"]
    assert sum(summary["worker_restarts"].values()) == 1 and summary["worker_slow_starts"] == {}
    final = read_jsonl(tmp_path / "out" / "metrics.jsonl")[-1]
    assert final["train/version"] == 6
    # the replacement ran weights newer than the checkpoint: resynced, then in the new group
    replacement = [s for s in summary["workers"] if s["rollout/uptime_s"] < max(
        w["rollout/uptime_s"] for w in summary["workers"])]
    assert replacement and replacement[0]["rollout/weight_updates"] >= 1


def test_changed_only_through_the_object_store(ray_cluster, tiny_ckpt, task, tmp_path) -> None:
    out = tmp_path / "changed"
    cfg, summary = _run(tiny_ckpt, task, out, mode="one-step-off", weight_update_changed_only=True,
                        num_rollout_workers=2)
    assert summary["status"] == "completed" and summary["ledger_ok"]
    assert max(_token_versions(out)) >= cfg.run.num_rollout - 2  # one-step-off: η = 1
    for stats in summary["workers"]:
        assert stats["rollout/weight_updates"] >= 1 and stats["rollout/weight_resyncs"] == 0
