"""Placement by node (``miles.actors.placement``) and the weight transport chosen per pair."""

from __future__ import annotations

import asyncio

import pytest

from miles.actors.placement import (
    ROLLOUT_TAG,
    TRAINER_TAG,
    Node,
    PlacementError,
    pair_transport,
    plan_nodes,
    replacement_node,
)
from miles.actors.weight_broadcaster import WeightBroadcaster


def _node(i: int, cpus: float = 1, gpus: float = 0, **tags: float) -> Node:
    resources = {"CPU": cpus, **({"GPU": gpus} if gpus else {}), **tags}
    return Node(node_id=f"n{i}", address=f"10.0.0.{i}", resources=resources)


def test_the_trainer_takes_the_driver_node_and_rollout_the_others_in_order() -> None:
    nodes = [_node(3), _node(1), _node(2), _node(0)]
    plan = plan_nodes(nodes, actor_num_nodes=1, rollout_num_nodes=2, colocate=False, driver_node="n2")
    assert plan.trainer_nodes == ["n2"] and plan.rollout_nodes == ["n0", "n1"]
    assert [plan.worker_node(i) for i in range(4)] == ["n0", "n1", "n0", "n1"]


def test_tagged_nodes_come_first_for_their_role() -> None:
    nodes = [_node(0), _node(1, **{ROLLOUT_TAG: 1}), _node(2, **{TRAINER_TAG: 1}), _node(3)]
    plan = plan_nodes(nodes, actor_num_nodes=1, rollout_num_nodes=2, colocate=False, driver_node="n0")
    assert plan.trainer_nodes == ["n2"] and plan.rollout_nodes == ["n1", "n0"]


def test_rollout_shares_a_trainer_node_only_when_the_others_run_out() -> None:
    nodes = [_node(0, cpus=0), _node(1, **{TRAINER_TAG: 1}), _node(2)]
    plan = plan_nodes(nodes, actor_num_nodes=1, rollout_num_nodes=2, colocate=False, driver_node="n0")
    assert plan.trainer_nodes == ["n1"] and plan.rollout_nodes == ["n2", "n1"]  # n0 has no CPU for a worker
    with pytest.raises(PlacementError, match="--rollout-num-nodes 3"):
        plan_nodes(nodes, actor_num_nodes=1, rollout_num_nodes=3, colocate=False, driver_node="n0")


def test_gpu_nodes_by_slimes_meaning() -> None:
    """actor_num_nodes x actor_num_gpus_per_node trainer GPUs; rollout_num_gpus over the rollout nodes."""
    nodes = [_node(0, gpus=8), _node(1, gpus=8), _node(2, gpus=8), _node(3, gpus=4)]
    plan = plan_nodes(nodes, actor_num_nodes=2, rollout_num_nodes=1, colocate=False, driver_node="n0",
                      actor_gpus_per_node=8, rollout_num_gpus=8)
    assert plan.trainer_nodes == ["n0", "n1"] and plan.rollout_nodes == ["n2"] and plan.gpus_per_rollout_node == 8
    # n3 has 4 GPUs, fewer than the 8 a rollout node needs: two rollout nodes do not fit
    with pytest.raises(PlacementError, match="--rollout-num-nodes 2"):
        plan_nodes(nodes, actor_num_nodes=2, rollout_num_nodes=2, colocate=False, driver_node="n0",
                   actor_gpus_per_node=8, rollout_num_gpus=16)
    plan = plan_nodes(nodes, actor_num_nodes=1, rollout_num_nodes=2, colocate=False, driver_node="n0",
                      actor_gpus_per_node=4, rollout_num_gpus=8)
    assert plan.trainer_nodes == ["n0"] and plan.rollout_nodes == ["n1", "n2"] and plan.gpus_per_rollout_node == 4
    with pytest.raises(PlacementError, match="--actor-num-nodes 5"):
        plan_nodes(nodes, actor_num_nodes=5, rollout_num_nodes=0, colocate=False, driver_node="n0",
                   actor_gpus_per_node=4)
    colocated = plan_nodes(nodes, actor_num_nodes=2, rollout_num_nodes=0, colocate=True, driver_node="n0",
                           actor_gpus_per_node=8)
    assert colocated.rollout_nodes == colocated.trainer_nodes == ["n0", "n1"]


def test_a_replacement_returns_home_or_goes_to_the_least_loaded_live_rollout_node() -> None:
    plan = plan_nodes([_node(0), _node(1), _node(2), _node(3)], actor_num_nodes=1, rollout_num_nodes=3,
                      colocate=False, driver_node="n0")
    assert plan.rollout_nodes == ["n1", "n2", "n3"]
    alive = {"n0", "n1", "n2", "n3"}
    assert replacement_node(plan, 1, alive, {"n1": 1, "n3": 1}) == "n2"
    assert replacement_node(plan, 1, alive - {"n2"}, {"n1": 2, "n3": 1}) == "n3"
    assert replacement_node(plan, 1, alive - {"n2"}, {"n1": 1, "n3": 1}) == "n1"  # a tie: plan order
    assert replacement_node(plan, 0, {"n0"}, {}) is None


def test_the_transport_is_chosen_per_pair() -> None:
    for kind in ("nccl", "gloo", "cuda_ipc"):
        assert pair_transport(kind, "a", "a") == kind
        assert pair_transport(kind, "a", "b") == "object_store"
        assert pair_transport(kind, "", "b") == kind  # unknown nodes: one-node behaviour
    assert pair_transport("object_store", "a", "b") == "object_store"


def test_the_broadcaster_addresses_a_group_update_to_the_trainers_node_only() -> None:
    """Workers on other nodes are ``remote`` in the plan and are not marked as needing a resync
    by a group update: the trainer sends them the same version through the object store."""

    class _Worker:
        def __init__(self) -> None:
            self.got: list[tuple[int, str]] = []

        async def receive_weights(self, version: int, update) -> int:
            self.got.append((version, update.transport))
            return version

    async def scenario() -> None:
        from miles.transports.base import BucketRef, WeightUpdate, WireBucket

        b = WeightBroadcaster()
        b.attach_source(object(), "A")
        here, there = _Worker(), _Worker()
        b.register("w-here", here, "A")
        b.register("w-there", there, "B")
        plan = b.plan_update(1)
        assert plan.members == ["w-here"] and plan.remote == ["w-there"] and plan.regroup
        group = WeightUpdate(version=1, transport="distributed", buckets=[WireBucket(metas=[], nbytes=0)],
                             members=["w-here"])
        await b.publish(1, group)
        await asyncio.sleep(0.01)
        assert "w-there" in b.needs_full and b._resynced == -1  # new, but no republish asked of the trainer
        store = WeightUpdate(version=1, transport="object_store", buckets=[BucketRef(metas=[], nbytes=0, ref=None)])
        await b.publish(1, store, replace=True)
        assert await b.wait_applied(1, timeout=5)
        assert here.got == [(1, "distributed")] and there.got == [(1, "object_store")]

    asyncio.run(scenario())


def test_node_flags_are_checked_before_start() -> None:
    from miles.config import default_config
    from miles.validation import _node_problems

    def problems(**flags) -> list[str]:
        return list(_node_problems(default_config(**flags).run))

    assert problems(rollout_num_nodes=2) == []
    assert "embedded trainer is one process" in problems(actor_num_nodes=2)[0]
    assert "--colocate" in problems(colocate=True, rollout_num_nodes=2)[0]
    assert "does not split evenly" in problems(rollout_num_nodes=2, rollout_num_gpus=3)[0]
    assert problems(rollout_num_nodes=-1)
