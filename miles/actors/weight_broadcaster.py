"""WeightBroadcaster: keeps the newest versioned weights and delivers them to every worker.

The trainer publishes a version as a ``WeightUpdate`` (``miles.transports``): object-store
bucket references, or the layout of NCCL/gloo broadcasts, or CUDA IPC handles — the bytes
never pass through here. The broadcaster pushes the update to every registered worker
without waiting for them to apply it (the trainer never blocks on rollouts), records which
version each worker has applied and how long delivery took, and hands the newest version
to a worker that (re)registers. A worker stages all buckets, then flips its version: never
half an update. Workers on a node other than the trainer's (``register``'s ``node``) are
``remote``: a group transport (NCCL, gloo, CUDA IPC) addresses only the trainer's node, and the
trainer sends the same version to the remote ones through the object store
(``miles.actors.placement.pair_transport``). Deliveries to one worker are sequential, in version order (addressed
updates are sent at once, in order: see ``_push``).

Membership is the broadcaster's: ``plan_update`` tells the trainer, before each publish, who
the workers are (the ranks of a distributed group, the addressees of IPC handles), whether
the group must be rebuilt (a worker came or went: ``form_group`` then tells every member its
rank) and whether some worker needs a full update. A worker needs one when it is new, or a
delivery to it failed, or it could not build on a changed-only update. Such a worker gets
the newest version as soon as possible: replayed from the object store when the newest
update is a full object-store one, else by asking the trainer (``attach_source``) to
``republish`` it that way — so a restarted worker never waits for the next training step,
and the synchronous mode's ``wait_applied`` never hangs on it.

Updates addressed to members (distributed, cuda_ipc) go to every member even when it has
nothing to apply (a broadcast waits for all ranks; an IPC handle holds a count).

Channels: the policy channel calls each worker's ``receive_weights``; a second broadcaster
built with ``method="receive_draft_weights"`` is the DraftTrainer's draft channel (draft
versions, applied without touching policy versions; payloads are bucket lists). ``latest()``
serves pull-style consumers (the DraftTrainer's policy copy) that must not count as workers
to wait for; a pull of an update they cannot read (GPU transports, changed-only) asks
for a full object-store republish.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from miles.actors.handles import Peer
from miles.transports.base import GroupSpec, UpdatePlan, WeightUpdate, as_update


class WeightBroadcaster:
    def __init__(self, method: str = "receive_weights") -> None:
        self.method = method  # the worker endpoint deliveries call
        self.workers: dict[str, Peer] = {}
        self.applied: dict[str, int] = {}
        self.done: dict[str, int] = {}  # newest version whose delivery finished, applied or not
        self.needs_full: set[str] = set()
        self.latest_version = -1
        self.latest_payload: Any = []
        self.latest_update: WeightUpdate | None = None
        self.source: Peer | None = None
        self.source_node = ""  # the trainer's node ("" unknown: every worker is local)
        self.nodes: dict[str, str] = {}  # worker id → node id
        self.group_members: list[str] = []
        self._group_valid = False
        self._resynced = -1  # the newest version a resync was started for
        self._pushes: dict[str, asyncio.Task[None]] = {}
        self._tasks: set[asyncio.Future[Any]] = set()
        self.delivery_s: list[float] = []
        self.failures = 0
        self.resyncs = 0

    def attach_source(self, trainer: Any, node: str = "") -> None:
        """The PolicyTrainer to ask for a full object-store republish (new workers), and its node."""
        self.source = Peer(trainer)
        self.source_node = node

    def _local(self, worker_id: str) -> bool:
        from miles.actors.placement import pair_transport

        return pair_transport("group", self.source_node, self.nodes.get(worker_id, "")) == "group"

    # ---- membership -------------------------------------------------------------------
    def register(self, worker_id: str, worker: Any, node: str = "") -> int:
        self.workers[worker_id] = Peer(worker)
        self.nodes[worker_id] = node
        self.applied.setdefault(worker_id, -1)
        self.done.setdefault(worker_id, -1)
        self.needs_full.add(worker_id)
        if worker_id not in self.group_members:
            self._group_valid = False
        if self.latest_version >= 0:
            self._resync()
        return self.latest_version

    def unregister(self, worker_id: str) -> None:
        self.workers.pop(worker_id, None)
        self.nodes.pop(worker_id, None)
        self.applied.pop(worker_id, None)
        self.done.pop(worker_id, None)
        self.needs_full.discard(worker_id)
        if worker_id in self.group_members:
            self._group_valid = False
        task = self._pushes.pop(worker_id, None)
        if task is not None:
            task.cancel()

    def plan_update(self, version: int) -> UpdatePlan:
        """Called by the trainer before it publishes ``version``."""
        members = [w for w in self.workers if self._local(w)]
        remote = [w for w in self.workers if not self._local(w)]
        return UpdatePlan(members=members, full=bool(self.needs_full), remote=remote,
                          regroup=not self._group_valid or members != self.group_members)

    def form_group(self, spec: GroupSpec, members: list[str]) -> None:
        """Tell every member its rank in ``spec`` (the trainer, rank 0, joins meanwhile)."""
        self.group_members, self._group_valid = list(members), True
        for rank, worker_id in enumerate(members, start=1):
            peer = self.workers.get(worker_id)
            if peer is not None:
                self._spawn(self._join(peer, spec, rank))

    async def _join(self, peer: Peer, spec: GroupSpec, rank: int) -> None:
        try:
            await peer.call("join_weight_group", spec, rank)
        except Exception:  # the trainer's rendezvous times out and it falls back
            self.failures += 1
            self._group_valid = False

    def group_failed(self) -> None:
        """The trainer's distributed transfer failed: rebuild the group next time."""
        self._group_valid = False

    # ---- publishing ---------------------------------------------------------------------
    async def publish(self, version: int, payload: Any, replace: bool = False) -> None:
        """Make ``version`` the newest and start delivering it; returns without waiting.
        ``replace`` swaps the payload of the newest version (a republish)."""
        if version < self.latest_version or (version == self.latest_version and not replace):
            raise ValueError(f"version {version} is not newer than {self.latest_version}")
        update = as_update(version, payload)
        self.latest_version, self.latest_payload, self.latest_update = version, payload, update
        outsiders = False
        for worker_id in list(self.workers):
            if update.addressed and worker_id not in update.members:
                if not self._local(worker_id):
                    continue  # the trainer sends it this version through the object store
                self.needs_full.add(worker_id)  # joined after the trainer planned this update
                outsiders = True
            else:
                self._push(worker_id)
        if outsiders:
            self._resync()

    def _push(self, worker_id: str) -> None:
        # Deliveries to one worker are sequential — except updates addressed to members
        # (a broadcast, IPC handles): those go out at once, in publish order, because the
        # trainer's transfer waits for every rank; the worker stages them in arrival order
        # and may stage the next while the previous waits for its drain.
        previous = None if self.latest_update.addressed else self._pushes.get(worker_id)
        self._pushes[worker_id] = asyncio.ensure_future(
            self._deliver(worker_id, self.latest_version, self.latest_payload, self.latest_update, previous))

    async def _deliver(self, worker_id: str, version: int, payload: Any, update: WeightUpdate,
                       previous: Any) -> None:
        if previous is not None and not previous.done():
            await asyncio.gather(previous, return_exceptions=True)
        peer = self.workers.get(worker_id)
        if peer is None:
            return
        try:
            if self.applied.get(worker_id, -1) >= version and not update.addressed:
                return
            start = time.monotonic()
            try:
                applied = int(await peer.call(self.method, version, payload))
            except Exception:
                self.failures += 1  # the driver's health check restarts dead workers
                applied = -1
            if worker_id not in self.workers:
                return
            self.applied[worker_id] = max(self.applied.get(worker_id, -1), applied)
            if applied >= version:
                self.delivery_s.append(time.monotonic() - start)
                if update.full:
                    self.needs_full.discard(worker_id)
            elif self.applied[worker_id] < version:
                self.needs_full.add(worker_id)  # failed, or could not build on a changed-only update
                self._resync()
        finally:
            if worker_id in self.done:
                self.done[worker_id] = max(self.done[worker_id], version)

    def _resync(self) -> None:
        """Get the newest version to the workers that need a full update: replay it if it is
        a full object-store update (to workers no delivery is under way for: a worker that
        keeps failing does not loop), else ask the trainer, once per version, to republish
        it that way (``publish(..., replace=True)`` then reaches everyone behind)."""
        update = self.latest_update
        if update is None:
            return
        if update.replayable:
            busy = self._busy()
            for worker_id in self.needs_full & set(self.workers):
                if self.applied.get(worker_id, -1) < self.latest_version and worker_id not in busy:
                    self.resyncs += 1
                    self._push(worker_id)
        elif self.source is not None and self._resynced < self.latest_version:
            self._resynced = self.latest_version
            self.resyncs += 1
            self._spawn(self._ask_republish(self.latest_version))

    def _busy(self) -> set[str]:
        return {w for w, task in self._pushes.items() if not task.done()}

    async def _ask_republish(self, version: int) -> None:
        try:
            await self.source.call("republish", version)
        except Exception:
            self.failures += 1

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- queries ------------------------------------------------------------------------
    def latest(self) -> tuple[int, list[Any]]:
        """The newest version and its bucket references, when it is a full object-store
        update ((-1, []) before the first publish). For other updates it returns
        (version, []) and asks the trainer, once per version, to republish it through the
        object store, so the next pull gets it."""
        update = self.latest_update
        if update is None:
            return self.latest_version, []
        if not update.replayable:
            self._resync()
            return self.latest_version, []
        if isinstance(self.latest_payload, WeightUpdate):
            return self.latest_version, [b.ref for b in update.buckets]
        return self.latest_version, list(self.latest_payload)

    async def wait_applied(self, version: int, timeout: float | None = None) -> bool:
        """Wait until every registered worker runs ``version`` or newer (sync mode)."""
        return await self._wait(lambda: all(v >= version for v in self.applied.values()), timeout)

    async def wait_delivered(self, version: int, members: list[str], timeout: float | None = None) -> bool:
        """Wait until each of ``members`` is gone or finished its delivery of ``version``
        (the trainer then frees that version's IPC buffers)."""
        return await self._wait(lambda: all(self.done.get(w, version) >= version for w in members), timeout)

    async def _wait(self, ready: Any, timeout: float | None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not ready():
            if deadline is not None and time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.005)
        return True

    def stats(self) -> dict[str, float]:
        recent = self.delivery_s[-50:]
        update = self.latest_update
        return {
            "weights/version": float(self.latest_version),
            "weights/min_applied": float(min(self.applied.values(), default=-1)),
            "weights/delivery_s_mean": sum(recent) / len(recent) if recent else 0.0,
            "weights/delivery_s_max": max(recent, default=0.0),
            "weights/failures": float(self.failures),
            "weights/resyncs": float(self.resyncs),
            "weights/update_bytes": float(update.nbytes if update is not None else 0),
            "weights/update_tensors": float(update.num_tensors if update is not None else 0),
        }
