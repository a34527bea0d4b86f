"""Several nodes on one machine (``ray.cluster_utils.Cluster``): placement by node, the weight
transport chosen per pair, and a rollout node lost mid-run.

The cluster: a head with no CPU (the driver's node: buffer and broadcaster), a trainer node
(``miles_trainer``) and two rollout nodes (``miles_rollout``), one CPU each. Waits are on
events (a step done, a lease taken), never on wall-clock bounds.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import ray

from miles.actors.placement import ROLLOUT_TAG, TRAINER_TAG
from miles.config import resolve
from miles.driver import Driver
from tests.integration.conftest import read_jsonl, run_flags


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    restore = ray.is_initialized()  # the session's one-node cluster: put it back afterwards
    if restore:
        ray.shutdown()
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    trainer = c.add_node(num_cpus=1, resources={TRAINER_TAG: 1})
    rollout = [c.add_node(num_cpus=1, resources={ROLLOUT_TAG: 1}) for _ in range(2)]
    c.wait_for_nodes()
    ray.init(address=c.address, include_dashboard=False, log_to_driver=False)
    yield c, {"head": c.head_node.node_id, "trainer": trainer.node_id, "rollout": [n.node_id for n in rollout]}, rollout
    ray.shutdown()
    c.shutdown()
    if restore:
        ray.init(include_dashboard=False, num_cpus=4, log_to_driver=False, _node_ip_address="127.0.0.1")


def _driver(tiny_ckpt, task, out, **extra) -> Driver:
    from miles.actors.factory import load_datasets

    cfg = resolve(run_flags(tiny_ckpt, task, out, **extra))
    return Driver(cfg, *load_datasets(cfg))


async def _until(cond, run: asyncio.Task, what: str, timeout: float = 300.0) -> None:
    """Wait for ``cond()`` (a generous deadline only against a hang; no timing is asserted)."""
    deadline = time.monotonic() + timeout
    while not await cond():
        assert not run.done(), f"the run ended before {what}: {run.result()}"
        assert time.monotonic() < deadline, f"no {what}"
        await asyncio.sleep(0.05)


def test_actors_land_on_their_nodes_and_the_transport_follows_each_pair(cluster, tiny_ckpt, task, tmp_path) -> None:
    """Three rollout nodes asked for, two tagged ones beside the trainer: the third is the
    trainer's own. Weights go by gloo to the worker on the trainer's node, by the object
    store to the others."""
    _, ids, _ = cluster
    driver = _driver(tiny_ckpt, task, tmp_path / "out", num_rollout=3, num_rollout_workers=3, rollout_num_nodes=3,
                     weight_transport="gloo", weight_transport_timeout_s=60, health_check_interval_s=0.5)
    a = driver.actors
    assert a.nodes.trainer_nodes == [ids["trainer"]] and a.nodes.driver_node == ids["head"]
    plan = a.nodes.rollout_nodes  # the tagged ones (in node-id order: one address), then the trainer's
    assert sorted(plan[:2]) == sorted(ids["rollout"]) and plan[2:] == [ids["trainer"]]

    async def scenario() -> dict:
        placed = {
            "trainer": await a.trainer.node_id.remote(),
            "buffer": await a.buffer.node_id.remote(),
            "workers": {w: await h.node_id.remote() for w, h in a.workers.items()},
        }
        summary = await driver.run()
        return placed, summary

    placed, summary = asyncio.run(scenario())
    assert summary["status"] == "completed" and summary["ledger_ok"]
    assert placed["trainer"] == ids["trainer"] and placed["buffer"] == ids["head"]
    assert placed["workers"] == a.worker_nodes  # each where the plan put it
    assert sorted(placed["workers"].values()) == sorted([*ids["rollout"], ids["trainer"]])
    by_node = {placed["workers"][w]: s for w, s in zip(a.workers, summary["workers"])}
    local = by_node[ids["trainer"]]
    assert local["rollout/weight_updates_distributed"] >= 1
    for node in ids["rollout"]:
        assert by_node[node].get("rollout/weight_updates_distributed", 0) == 0
        assert by_node[node]["rollout/weight_updates_object_store"] >= 1
    assert read_jsonl(tmp_path / "out" / "metrics.jsonl")[-1]["weights/fallbacks"] == 0


# Steps of the node-removal run: the frozen worker is found dead by its health ping's timeout and
# replaced while the rest of the run, on the other worker, is still going.
STEPS = 16


def test_a_rollout_node_removed_mid_run(cluster, tiny_ckpt, task, tmp_path) -> None:
    """Once the worker on the second rollout node holds a lease, the node goes: its leases
    return to the queue exactly once, its replacement starts on the remaining rollout node,
    and the run completes with the ledger exact."""
    c, ids, rollout_nodes = cluster
    driver = _driver(tiny_ckpt, task, tmp_path / "out", num_rollout=STEPS, num_rollout_workers=2, rollout_num_nodes=2,
                     rollout_max_response_len=48, health_check_interval_s=0.2)
    a = driver.actors
    victim_id = next(w for w, n in a.worker_nodes.items() if n == ids["rollout"][1])
    doomed = next(n for n in rollout_nodes if n.node_id == ids["rollout"][1])

    async def scenario() -> tuple[dict, list[str]]:
        pid = await a.workers[victim_id].__ray_call__.remote(lambda self: os.getpid())
        run = asyncio.create_task(driver.run())
        held: list[str] = []

        async def leased() -> bool:
            held[:] = await a.buffer.leased.remote(victim_id) if driver.step >= 1 else []
            return bool(held)

        while True:  # freeze the worker holding leases: what it holds is then what the node takes down
            await _until(leased, run, "lease taken by the worker on the second rollout node")
            os.kill(pid, signal.SIGSTOP)
            # the frozen worker's waiting lease would still be granted work when the next prompts
            # arrive, and a put-and-lease call it sent just before the stop can still reach the
            # buffer: end its wait until none is left and two reads 0.2 s apart agree
            before = None
            while True:
                waiting = await a.buffer.cancel_wait.remote(victim_id)
                if not await leased() or (held == before and not waiting):
                    break
                before = list(held)
                await asyncio.sleep(0.2)
            if held:
                break
            os.kill(pid, signal.SIGCONT)  # it had just returned them all: again
        await asyncio.to_thread(c.remove_node, doomed)
        return await run, held

    summary, held = asyncio.run(scenario())
    assert summary["status"] == "completed" and summary["ledger_ok"] and summary["steps"] == STEPS
    assert summary["worker_slow_starts"] == {}
    assert summary["worker_restarts"].get(victim_id.rsplit("-", 1)[0], 0) >= 1
    assert victim_id not in a.workers and set(a.worker_nodes.values()) == {ids["rollout"][0]}
    ledger = summary["ledger"]
    assert ledger["released"] == len(held) and ledger["expired"] == 0  # each of its leases came back once
    rows = read_jsonl(tmp_path / "out" / "trajectories.jsonl")
    trained = [r["id"] for r in rows]
    assert len(trained) == len(set(trained)) == ledger["trained"] == STEPS * 4 * 4  # nothing trained twice
