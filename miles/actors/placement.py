"""Placement by node: which Ray node the trainer and each rollout worker run on.

``--actor-num-nodes`` and ``--rollout-num-nodes`` have slime's meaning: the trainer takes
``actor_num_nodes`` nodes (``actor_num_nodes × actor_num_gpus_per_node`` GPUs), the rollout
engines ``rollout_num_nodes`` nodes (``rollout_num_gpus`` GPUs spread evenly over them).
``rollout_num_nodes = 0`` (the default) leaves the workers wherever Ray puts them, as a
one-node run does. ``ray_actors.launch`` calls ``plan_nodes`` once with the cluster's live
nodes and pins each actor to its node (node affinity on the CPU; on GPUs, placement-group
bundles carrying the node's label).

Which node takes which role: a node started with the custom resource ``miles_trainer`` or
``miles_rollout`` (``ray start --resources '{"miles_rollout": 1}'``) is taken for that role
first; the rest follow in a stable order — the driver's node first for the trainer, then by
address and node id. Rollout nodes are taken from nodes the trainer does not use, and only
when those run out from the trainer's own (a trainer node with room left). Worker ``i`` runs
on rollout node ``i mod rollout_num_nodes``; its replacement returns there, or, if that node
is gone, goes to the live rollout node with the fewest workers (``replacement_node``).

The weight transport follows per pair (``pair_transport``): a group transport (NCCL, gloo,
CUDA IPC) to the workers on the trainer's node, the object store to the others.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import msgspec

TRAINER_TAG = "miles_trainer"
ROLLOUT_TAG = "miles_rollout"


class PlacementError(ValueError):
    """The cluster cannot hold the run as placed; the message names the flags and the nodes."""


class Node(msgspec.Struct, frozen=True, kw_only=True):
    node_id: str
    address: str
    resources: dict[str, float] = {}

    def has(self, key: str, amount: float = 1e-9) -> bool:
        return self.resources.get(key, 0.0) >= amount


class NodePlan(msgspec.Struct, kw_only=True):
    """The run's nodes by role (node ids), decided once at launch."""

    driver_node: str
    trainer_nodes: list[str]
    rollout_nodes: list[str]
    gpus_per_rollout_node: int = 0

    def worker_node(self, ordinal: int) -> str:
        return self.rollout_nodes[ordinal % len(self.rollout_nodes)]


def by_node(cfg: Any) -> bool:
    """Whether the run places its actors by node (otherwise Ray places them, one-node style)."""
    return cfg.run.rollout_num_nodes > 0 or cfg.run.actor_num_nodes > 1


def live_nodes() -> list[Node]:
    """The Ray cluster's live nodes (a call to the GCS)."""
    import ray

    return [Node(node_id=n["NodeID"], address=n.get("NodeManagerAddress", ""), resources=dict(n.get("Resources", {})))
            for n in ray.nodes() if n.get("Alive")]


def _order(nodes: Iterable[Node], tag: str, first: str = "") -> list[Node]:
    return sorted(nodes, key=lambda n: (not n.has(tag), n.node_id != first, n.address, n.node_id))


def plan_nodes(nodes: Sequence[Node], *, actor_num_nodes: int, rollout_num_nodes: int, colocate: bool,
               driver_node: str, actor_gpus_per_node: int = 0, rollout_num_gpus: int = 0,
               worker_cpus: float = 0.5) -> NodePlan:
    """Trainer and rollout nodes for a run (see the module docstring for the rules)."""
    if actor_num_nodes < 1:
        raise PlacementError("--actor-num-nodes must be >= 1")
    per_rollout = rollout_num_gpus // rollout_num_nodes if rollout_num_nodes and rollout_num_gpus else 0

    def fits_trainer(n: Node) -> bool:
        return n.has("GPU", actor_gpus_per_node) if actor_gpus_per_node else n.has("CPU", worker_cpus)

    trainer = [n for n in _order(nodes, TRAINER_TAG, driver_node) if fits_trainer(n)][:actor_num_nodes]
    if len(trainer) < actor_num_nodes:
        need = f"{actor_gpus_per_node} GPU(s)" if actor_gpus_per_node else f"{worker_cpus:g} CPU"
        raise PlacementError(f"--actor-num-nodes {actor_num_nodes}: the cluster has {len(trainer)} live node(s) "
                             f"with {need} free for the trainer ({len(nodes)} live in all)")
    trainer_ids = [n.node_id for n in trainer]
    if colocate or rollout_num_nodes == 0:
        return NodePlan(driver_node=driver_node, trainer_nodes=trainer_ids,
                        rollout_nodes=trainer_ids if colocate else [], gpus_per_rollout_node=per_rollout)

    def fits_rollout(n: Node, shared: bool) -> bool:
        if per_rollout:
            spare = n.resources.get("GPU", 0.0) - (actor_gpus_per_node if shared else 0)
            return spare >= per_rollout
        return n.has("CPU", worker_cpus)

    others = [n for n in _order(nodes, ROLLOUT_TAG) if n.node_id not in trainer_ids and fits_rollout(n, False)]
    shared = [n for n in _order(trainer, ROLLOUT_TAG) if fits_rollout(n, True)]
    rollout = [*others, *shared][:rollout_num_nodes]
    if len(rollout) < rollout_num_nodes:
        need = f"{per_rollout} GPU(s)" if per_rollout else f"{worker_cpus:g} CPU"
        raise PlacementError(f"--rollout-num-nodes {rollout_num_nodes}: the cluster has {len(rollout)} live node(s) "
                             f"with {need} for rollout workers beside the trainer's {actor_num_nodes} "
                             f"({len(nodes)} live in all)")
    return NodePlan(driver_node=driver_node, trainer_nodes=trainer_ids, rollout_nodes=[n.node_id for n in rollout],
                    gpus_per_rollout_node=per_rollout)


def replacement_node(plan: NodePlan, ordinal: int, alive: set[str], workers_on: dict[str, int]) -> str | None:
    """Where worker ``ordinal``'s replacement runs: its own rollout node while that is alive,
    else the live rollout node with the fewest workers; None when no rollout node is left."""
    home = plan.worker_node(ordinal)
    if home in alive:
        return home
    live = [n for n in plan.rollout_nodes if n in alive]
    if not live:
        return None
    return min(live, key=lambda n: (workers_on.get(n, 0), plan.rollout_nodes.index(n)))


def pair_transport(kind: str, trainer_node: str, worker_node: str) -> str:
    """The transport between the trainer and one worker: the run's (``resolve_transport``)
    when both are on one node or a node is unknown, the object store across nodes (it needs
    no fabric between them; NCCL between nodes needs one the run cannot assume)."""
    if kind == "object_store" or not trainer_node or not worker_node or trainer_node == worker_node:
        return kind
    return "object_store"
