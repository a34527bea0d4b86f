"""The one module that wraps miles' classes as Ray actors, and places them.

Everything else is plain Python: ``ReplayBuffer``, ``RolloutWorker``, ``PolicyTrainer``,
``WeightBroadcaster`` and ``RewardRunner`` can be built and tested in-process. Here each
gets a thin actor class that builds its parts from the run's config inside its own process
(models are loaded where they run, never shipped), and ``launch`` starts them all.

Placement: on the CPU every actor takes a fraction of a core and torch gets a fair share of
threads. With GPUs a placement group reserves ``actor_num_gpus_per_node`` GPUs for the
trainer and ``rollout_num_gpus`` for the engines (disaggregated: worker i on rollout GPU
i mod ``rollout_num_gpus``), or one set of GPUs both share (``--colocate``: the trainer and
the workers split the first GPU; several Megatron ranks take one GPU each, rank 0 sharing the
first with the workers). The weight transport follows (``--weight-transport auto``):
CUDA IPC when colocated, NCCL when disaggregated, the object store on the CPU; the
broadcaster knows the trainer so that a worker that joins late is sent the newest weights.

By node (``--rollout-num-nodes``, ``--actor-num-nodes``; ``miles.actors.placement``): the
trainer and each worker are pinned to the nodes the plan gives them (node affinity on the
CPU, bundles labelled with their node on GPUs), the buffer and the broadcaster to the
driver's node, reward workers spread over the rollout nodes (softly: Ray restarts one
elsewhere when its node goes). A replacement worker goes back to its node, or to the live
rollout node with the fewest workers when its node is gone.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field
from typing import Any

import ray

from miles.actors import placement as nodes
from miles.actors.draft_trainer import DraftTrainer
from miles.actors.factory import (
    buffer_args,
    build_draft_trainer,
    build_policy_trainer,
    build_reward_runner,
    build_rollout_worker,
    build_weight_sender,
    configure_process,
    wants_shared_base,
)
from miles.actors.policy_trainer import PolicyTrainer
from miles.actors.rollout_worker import RolloutWorker
from miles.actors.weight_broadcaster import WeightBroadcaster
from miles.buffers import ReplayBuffer
from miles.config import MilesConfig, resolve
from miles.rewards import RewardRunner
from miles.utils import gcpolicy
from miles.utils.proc import rss_mb


ADMISSION_COALESCE_S = 0.025  # the least time between two admission_state answers


class _BufferActor(ReplayBuffer):
    """The buffer as an actor, timing its own work (the runtime's overhead budget is < 1%)."""

    def __init__(self, flat: dict[str, Any]) -> None:
        super().__init__(**buffer_args(resolve(flat)))
        # full GC passes over the held token lists on a clock, not mid-call, and no young
        # passes re-visiting each call's freshly received lists (the buffer builds no cycles)
        gcpolicy.install(young=False)
        # per method: (seconds in all, the longest call), so a burst in busy_s names its call
        self.busy_by: dict[str, list[float]] = {}
        # the same calls' CPU time on this thread: wall time minus the time the process was
        # descheduled or waited for the GIL (Ray's threads, a loaded host); the two apart say
        # whether the buffer's work or its process's share of the machine is the cost
        self.cpu_s = 0.0
        self.changes = 0  # bumped by every state-changing call; admission long-polls on it
        self._changed: asyncio.Event | None = None
        self._answered = float("-inf")  # the loop time of the last admission_state answer

    def _bump(self) -> None:
        self.changes += 1
        if self._changed is not None:
            self._changed.set()

    async def admission_state(self, seen: int, timeout: float) -> tuple[int, Any, int]:
        """(change count, ledger, prompt room) once the state changed since ``seen`` (or
        after ``timeout``): the driver's admission loop waits here instead of polling.

        Answers are at least ``ADMISSION_COALESCE_S`` apart (``seen = -1``, a new policy
        version, is answered at once): every put and lease is a change, and answering each
        one would build a ledger per call, as many answers as puts and leases together and a
        large share of the buffer's time. A burst of puts now costs one answer."""
        loop = asyncio.get_running_loop()
        if self.changes == seen:
            self._changed = self._changed or asyncio.Event()
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), timeout)
            except asyncio.TimeoutError:
                pass
        if seen != -1:
            await asyncio.sleep(max(0.0, self._answered + ADMISSION_COALESCE_S - loop.time()))
        self._answered = loop.time()
        return self.changes, self.ledger(), self.prompt_room()

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def busy_parts(self) -> dict[str, tuple[float, float]]:
        """(seconds in all, the longest) of each timed method, and of the full GC passes
        (``gc``: the buffer serves nothing while one runs)."""
        gc_stats = gcpolicy.stats()
        parts = {name: (total, longest) for name, (total, longest) in self.busy_by.items()}
        if gc_stats["count"]:
            parts["gc"] = (gc_stats["seconds"], gc_stats["longest"])
        return parts

    def stats(self) -> dict[str, float]:
        out = super().stats()
        out["mem/buffer_rss_mb"] = rss_mb()
        parts = self.busy_parts()
        out["perf/buffer_busy_s"] = sum(total for total, _ in parts.values())
        out["perf/buffer_cpu_s"] = self.cpu_s
        for name, (total, longest) in parts.items():
            out[f"perf/buffer_busy_s/{name}"] = total
            out[f"perf/buffer_call_max_s/{name}"] = longest
        return out


def _timed(name: str, changes: bool) -> Any:
    inner = getattr(ReplayBuffer, name)

    def method(self: _BufferActor, *args: Any, **kwargs: Any) -> Any:
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            return inner(self, *args, **kwargs)
        finally:
            took = time.perf_counter() - start
            self.cpu_s += time.thread_time() - cpu
            rec = self.busy_by.setdefault(name, [0.0, 0.0])
            rec[0] += took
            rec[1] = max(rec[1], took)
            if changes:
                self._bump()

    method.__name__ = name
    method.__doc__ = inner.__doc__
    return method


# get_batch_async waits for data; its work happens inside get_batch, which is timed. So does
# put_and_lease's (and the waiting put_and_lease_async's), inside put_many and lease (timed
# there, once a lease however often a waiting one leases again).
for _name in ("add_prompts", "lease", "put", "put_many", "release_worker", "release_all_workers",
              "expire_leases", "set_version", "get_batch", "load_state_dict", "unlease"):
    setattr(_BufferActor, _name, _timed(_name, changes=True))
for _name in ("renew", "ledger", "prompt_room", "failures", "cancel_wait"):
    setattr(_BufferActor, _name, _timed(_name, changes=False))


class _RolloutWorkerActor(RolloutWorker):
    def __init__(self, worker_id: str, flat: dict[str, Any], threads: int, buffer: Any, rewards: list[Any],
                 start_delay_s: float = 0.0, trainer: Any = None) -> None:
        start = time.monotonic()
        time.sleep(start_delay_s)  # TEST_START_DELAY_S: a slow start, in tests only
        cfg = resolve(flat)
        configure_process(cfg, threads)
        # colocated LoRA: the trainer's frozen base, as CUDA IPC handles (miles.engines.shared)
        offer = ray.get(trainer.base_offer.remote()) if trainer is not None and wants_shared_base(cfg) else None
        super().__init__(worker_id, **build_rollout_worker(cfg, worker_id, buffer=buffer, rewards=rewards,
                                                           base_offer=offer))
        self.init_s = time.monotonic() - start  # engine build, weights load, graph capture

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()


class _PolicyTrainerActor(PolicyTrainer):
    def __init__(self, flat: dict[str, Any], threads: int) -> None:
        start = time.monotonic()
        cfg = resolve(flat)
        configure_process(cfg, threads)
        backend = build_policy_trainer(cfg)
        sender, wire_dtype = build_weight_sender(cfg)
        super().__init__(backend, bucket_bytes=cfg.run.update_weight_buffer_size, use_object_store=True,
                         deterministic=cfg.run.deterministic, sender=sender, wire_dtype=wire_dtype,
                         changed_only=cfg.weights.weight_update_changed_only)
        self.init_s = time.monotonic() - start  # model load, and on CUDA the compile warm-up

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()


class _DraftTrainerActor(DraftTrainer):
    def __init__(self, flat: dict[str, Any], threads: int, draft_broadcaster: Any, policy_broadcaster: Any) -> None:
        cfg = resolve(flat)
        configure_process(cfg, threads)
        sc = cfg.speculative
        super().__init__(build_draft_trainer(cfg), draft_broadcaster=draft_broadcaster,
                         policy_broadcaster=policy_broadcaster, train_interval=sc.draft_train_interval,
                         max_queue=sc.draft_max_queue, bucket_bytes=cfg.run.update_weight_buffer_size,
                         use_object_store=True)


class _RewardActor(RewardRunner):
    def __init__(self, flat: dict[str, Any]) -> None:
        cfg = resolve(flat)
        fn, kwargs = build_reward_runner(cfg)
        super().__init__(fn, **kwargs)

    def ping(self) -> bool:
        return True


@dataclass
class Actors:
    """Handles to everything the driver talks to."""

    buffer: Any
    trainer: Any
    broadcaster: Any
    workers: dict[str, Any] = field(default_factory=dict)
    rewards: list[Any] = field(default_factory=list)
    placement: Any = None
    worker_options: list[dict[str, Any]] = field(default_factory=list)  # by worker ordinal, cyclic
    threads: int = 1
    draft_trainer: Any = None  # --enable-draft-training: the DraftTrainer and its draft channel
    draft_broadcaster: Any = None
    nodes: nodes.NodePlan | None = None  # placement by node (None: Ray places, one-node style)
    worker_nodes: dict[str, str] = field(default_factory=dict)  # worker id → node id, when placed by node


def init_ray(cfg: MilesConfig) -> None:
    """Start (or join) Ray: dashboard off, no usage stats, loopback only."""
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True}
    address = cfg.run.ray_address or os.environ.get("RAY_ADDRESS")
    if address:
        kwargs["address"] = address
    else:  # a cluster of its own: never one that another process on this machine started
        kwargs["address"] = "local"
        kwargs["num_cpus"] = cfg.run.ray_num_cpus or max(os.cpu_count() or 1, 2)
        kwargs["_node_ip_address"] = "127.0.0.1"
    ray.init(**kwargs)


def _gpu_options(cfg: MilesConfig) -> tuple[dict[str, Any], list[dict[str, Any]], Any]:
    """Ray options for the trainer and for the rollout workers (worker i takes entry i mod
    len), and the placement group."""
    trainer_gpus = cfg.run.actor_num_gpus_per_node * cfg.run.actor_num_nodes
    if trainer_gpus == 0 and cfg.run.rollout_num_gpus == 0:
        return {"num_cpus": 0.5}, [{"num_cpus": 0.5}], None
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    total = trainer_gpus if cfg.run.colocate else trainer_gpus + cfg.run.rollout_num_gpus
    have = ray.cluster_resources().get("GPU", 0)
    if have < total:  # the placement group would wait for GPUs that are not there
        from miles.config import ConfigError

        raise ConfigError(f"this run needs {total} GPUs (trainer {trainer_gpus}"
                          f"{'' if cfg.run.colocate else f', rollout {cfg.run.rollout_num_gpus}'}); "
                          f"the Ray cluster has {have:g}")
    pg = placement_group([{"GPU": 1, "CPU": 1}] * total, strategy="PACK")
    ray.get(pg.ready(), timeout=120)

    def at(bundle: int, gpus: float) -> dict[str, Any]:
        strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=bundle)
        return {"num_gpus": gpus, "num_cpus": 0.1, "scheduling_strategy": strategy}

    ranks = cfg.run.train_backend == "megatron" and trainer_gpus > 1
    if ranks:
        # The PolicyTrainer actor drives a RayRankGroup (rank r on bundle r) and sends the
        # weights from a share of the first GPU, next to rank 0 (and the colocated workers).
        from miles.trainers.megatron.launch import first_gpu_share

        share = first_gpu_share(cfg.run.colocate, cfg.run.num_rollout_workers)
    else:
        share = 1.0 / (1 + cfg.run.num_rollout_workers)
    if cfg.run.colocate:  # the trainer and every worker on the first GPU (CUDA IPC's case)
        return at(0, share if trainer_gpus == 1 or ranks else 1.0), [at(0, share)], pg
    rollout = [at(trainer_gpus + i, 1.0) for i in range(max(cfg.run.rollout_num_gpus, 1))]
    return at(0, share if ranks else 1.0), rollout, pg


def _pin(node_id: str, soft: bool = False) -> dict[str, Any]:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node_id=node_id, soft=soft)}


def plan_nodes(cfg: MilesConfig) -> nodes.NodePlan:
    """The run's node plan from the cluster's live nodes (``miles.actors.placement``)."""
    from miles.config import ConfigError

    r = cfg.run
    try:
        return nodes.plan_nodes(nodes.live_nodes(), actor_num_nodes=r.actor_num_nodes,
                                rollout_num_nodes=r.rollout_num_nodes, colocate=r.colocate,
                                driver_node=ray.get_runtime_context().get_node_id(),
                                actor_gpus_per_node=r.actor_num_gpus_per_node,
                                rollout_num_gpus=0 if r.colocate else r.rollout_num_gpus)
    except nodes.PlacementError as exc:
        raise ConfigError(str(exc)) from None


def _node_options(cfg: MilesConfig, plan: nodes.NodePlan) -> tuple[dict[str, Any], list[dict[str, Any]], Any]:
    """``_gpu_options`` by node: on the CPU each actor pinned to its node; on GPUs a placement
    group whose bundles carry their node's label — the trainer's GPUs node by node (Megatron
    rank r on bundle r), then each rollout node's."""
    r = cfg.run
    if not r.actor_num_gpus_per_node:
        trainer = {"num_cpus": 0.5, **_pin(plan.trainer_nodes[0])}
        workers = [{"num_cpus": 0.5, **_pin(n)} for n in (plan.rollout_nodes or plan.trainer_nodes)]
        return trainer, workers, None
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    owners = [n for n in plan.trainer_nodes for _ in range(r.actor_num_gpus_per_node)]
    if not r.colocate:
        owners += [n for n in plan.rollout_nodes for _ in range(plan.gpus_per_rollout_node)]
    pg = placement_group([{"GPU": 1, "CPU": 1}] * len(owners), strategy="PACK",
                         bundle_label_selector=[{"ray.io/node-id": n} for n in owners])
    ray.get(pg.ready(), timeout=120)

    def at(bundle: int, gpus: float) -> dict[str, Any]:
        strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=bundle)
        return {"num_gpus": gpus, "num_cpus": 0.1, "scheduling_strategy": strategy}

    trainer_gpus = len(plan.trainer_nodes) * r.actor_num_gpus_per_node
    ranks = r.train_backend == "megatron" and trainer_gpus > 1
    if ranks:
        from miles.trainers.megatron.launch import first_gpu_share

        share = first_gpu_share(r.colocate, r.num_rollout_workers)
    else:
        share = 1.0 / (1 + r.num_rollout_workers)
    if r.colocate:
        return at(0, share if trainer_gpus == 1 or ranks else 1.0), [at(0, share)], pg
    return at(0, share if ranks else 1.0), [at(i, 1.0) for i in range(trainer_gpus, len(owners))], pg


def launch(cfg: MilesConfig) -> Actors:
    """Create the buffer, trainer, broadcaster, reward workers and rollout workers."""
    init_ray(cfg)
    flat = cfg.to_flat()
    plan = plan_nodes(cfg) if nodes.by_node(cfg) else None
    trainer_opts, worker_opts, pg = _node_options(cfg, plan) if plan else _gpu_options(cfg)
    home = _pin(plan.driver_node) if plan else {}  # the buffer and broadcaster live with the driver
    draft_training = cfg.speculative.enabled and cfg.speculative.enable_draft_training
    procs = 1 + cfg.run.num_rollout_workers + cfg.run.num_reward_workers + int(draft_training)
    threads = max(1, (os.cpu_count() or 1) // max(procs, 1))
    # every worker may hold a waiting lease in the buffer while it puts and renews: room for
    # those calls beyond the driver's and the trainer's
    concurrency = 1000 + 2 * cfg.run.num_rollout_workers
    buffer = ray.remote(_BufferActor).options(num_cpus=0, max_concurrency=concurrency, **home).remote(flat)
    broadcaster = ray.remote(WeightBroadcaster).options(num_cpus=0, max_concurrency=1000, **home).remote()
    trainer = ray.remote(_PolicyTrainerActor).options(max_concurrency=16, **trainer_opts).remote(flat, threads)
    broadcaster.attach_source.remote(trainer, plan.trainer_nodes[0] if plan else "")
    spread = (plan.rollout_nodes or plan.trainer_nodes) if plan else []
    rewards = [
        ray.remote(_RewardActor).options(num_cpus=0, max_concurrency=256, max_restarts=-1, max_task_retries=2,
                                         **(_pin(spread[i % len(spread)], soft=True) if spread else {})).remote(flat)
        for i in range(cfg.run.num_reward_workers)
    ]
    actors = Actors(buffer=buffer, trainer=trainer, broadcaster=broadcaster, rewards=rewards,
                    placement=pg, worker_options=worker_opts, threads=threads, nodes=plan)
    if draft_training:
        # The draft channel: a second broadcaster whose deliveries call receive_draft_weights.
        # The DraftTrainer runs on the CPU unless its process sees a GPU (placement on GPU
        # machines is left to the GPU runtime: it takes no GPU here).
        actors.draft_broadcaster = (ray.remote(WeightBroadcaster).options(num_cpus=0, max_concurrency=1000)
                                    .remote("receive_draft_weights"))
        actors.draft_trainer = (ray.remote(_DraftTrainerActor).options(num_cpus=0.5, max_concurrency=16)
                                .remote(flat, threads, actors.draft_broadcaster, broadcaster))
    for i in range(cfg.run.num_rollout_workers):
        start_worker(cfg, actors, f"worker{i}")
    return actors


# Test-only hook: seconds each rollout worker's constructor waits first, to stand in for a
# slow start on a loaded node (tests set it; no flag reaches it).
TEST_START_DELAY_S = 0.0


class NoNodeLeft(RuntimeError):
    """Every rollout node of the run is gone: a worker has nowhere to start."""


def start_worker(cfg: MilesConfig, actors: Actors, name: str, *, join: bool = True) -> tuple[str, Any]:
    """Start one rollout worker under a fresh id (a restarted worker never reuses leases);
    ``join=False`` leaves it out of ``actors.workers`` until the caller admits it."""
    worker_id = f"{name}-{os.urandom(3).hex()}"
    ordinal = int(name.removeprefix("worker") or 0) if name.removeprefix("worker").isdigit() else 0
    options = actors.worker_options[ordinal % len(actors.worker_options)] if actors.worker_options else {}
    plan = actors.nodes
    if plan is not None:
        node = plan.worker_node(ordinal) if plan.rollout_nodes else plan.trainer_nodes[0]
        if "num_gpus" not in options and plan.rollout_nodes:  # CPU: pinned by node; its node may be gone
            busy: dict[str, int] = {}
            for n in actors.worker_nodes.values():
                busy[n] = busy.get(n, 0) + 1
            node = nodes.replacement_node(plan, ordinal, {n.node_id for n in nodes.live_nodes()}, busy)
            if node is None:
                raise NoNodeLeft(f"no rollout node of the run is alive (they were {plan.rollout_nodes})")
            options = {**options, **_pin(node)}
        elif "num_gpus" in options and not cfg.run.colocate:  # GPUs: the bundle's node
            node = plan.rollout_nodes[(ordinal % len(actors.worker_options)) // max(plan.gpus_per_rollout_node, 1)]
        actors.worker_nodes[worker_id] = node
    handle = (
        ray.remote(_RolloutWorkerActor)
        .options(max_concurrency=1000, **options)
        .remote(worker_id, cfg.to_flat(), actors.threads, actors.buffer, actors.rewards, TEST_START_DELAY_S,
                actors.trainer)
    )
    if join:
        actors.workers[worker_id] = handle
    return worker_id, handle


def release_placement(actors: Actors) -> None:
    """Remove the run's placement group: killed actors do not give its GPUs back, so a second
    run on the same cluster would wait for them forever."""
    if actors.placement is not None:
        try:
            ray.util.remove_placement_group(actors.placement)
        except Exception:  # already removed (or the cluster is gone)
            pass
        actors.placement = None


def kill(handle: Any) -> None:
    try:
        ray.kill(handle, no_restart=True)
    except Exception:  # already dead
        pass
