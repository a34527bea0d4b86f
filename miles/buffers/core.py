"""The replay buffer's state and transitions (``BufferCore``), its config and its errors.

``ReplayBuffer`` (``replay.py``) is the public API on top; ``batching.py`` and
``checkpoint.py`` also work on these internals. Everything that moves a trajectory between
ledger states goes through the few methods here (``_move``, ``_recompute``,
``_make_ready``, ``_drop_rec``, ``_drop_group``, ``_place_partial``), which keep the
counters, the queues and the group records in step.

Returned trajectories (``put``) are handled in two phases: ``_plan_group`` decides each
one's fate — including running the user's group filters — without changing anything, then
``_commit_group`` applies it; a filter that raises therefore leaves the buffer unchanged.
"""

from __future__ import annotations

import asyncio
import heapq
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

import msgspec

from miles.buffers.batching import batch_stats
from miles.buffers.ledger import GroupLedger, Ledger
from miles.buffers.policies import EvictionPolicy, GroupFilter, SamplingPolicy, fifo, filter_name
from miles.buffers.records import (
    IN_FLIGHT, PARTIAL, QUEUED, READY, STATE_NAMES, WAITING, Group, Record, reset, restore,
)
from miles.buffers.waiting import LeaseWaiters
from miles.scheduler.staleness import check_staleness, is_doomed, staleness_keys
from miles.types import LossStats, Status, Trajectory, VersionRuns

STALE_POLICIES = ("drop", "recompute", "mask")
# Plan actions for a returned trajectory (decided before anything changes).
_FINISH, _PARTIAL, _RESET, _DOOM, _DROP = range(5)
# Status members as module constants: an enum member looked up on its class costs about
# ten times a global's lookup, and these are read per trajectory on the put and lease paths.
_PARTIAL_STATUS, _RUNNING, _FAILED = Status.PARTIAL, Status.RUNNING, Status.FAILED
# A returned trajectory as ``put_many`` checked it: its record, the trajectory, its loss
# tokens' stats and its version runs (``Trajectory.validate_runs``).
PutItem = tuple[Record, Trajectory, LossStats, VersionRuns | None]


class BufferFull(RuntimeError):
    """``add_prompts`` would exceed the buffer's capacity; nothing was added."""


class BufferConfig(msgspec.Struct, kw_only=True):
    """Buffer knobs; field names are the CLI flags (``--max-staleness`` …)."""

    max_staleness: int | float = 1  # η; inf (``UNBOUNDED``): no token is ever too old
    # "drop" | "recompute" | "mask", or "auto": the runtime picks mask with partial rollouts
    # (long trajectories span versions; dropping them would discard the long tail) and drop
    # otherwise. A buffer built directly treats "auto" as "drop".
    stale_policy: str = "auto"
    capacity: int = 4096  # live trajectories (queued+in flight+partial+waiting+ready)
    lease_timeout_s: float = 60.0  # a leased trajectory not renewed this long goes back to the queue
    n_samples_per_prompt: int = 1

    def __post_init__(self) -> None:
        self.max_staleness = check_staleness(self.max_staleness)
        if self.stale_policy not in (*STALE_POLICIES, "auto"):
            raise ValueError(f"stale_policy must be one of {(*STALE_POLICIES, 'auto')}, got {self.stale_policy!r}")
        if self.capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {self.capacity}")
        if not self.lease_timeout_s > 0:
            raise ValueError(f"lease_timeout_s must be > 0, got {self.lease_timeout_s}")
        if self.n_samples_per_prompt < 1:
            raise ValueError(f"n_samples_per_prompt must be >= 1, got {self.n_samples_per_prompt}")


class _Worker:
    __slots__ = ("deadline", "recs")

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.recs: dict[str, Record] = {}


class BufferCore:
    """The buffer's state and its transitions; ``ReplayBuffer`` adds the public API.

    ``sampling_policy`` orders ready groups for ``get_batch``; ``eviction_policy`` (None:
    refuse instead) orders ready groups to evict when admission needs room;
    ``group_filters`` decide which complete groups to keep; ``clock`` times leases.
    """

    def __init__(
        self,
        config: BufferConfig | None = None,
        *,
        sampling_policy: SamplingPolicy = fifo,
        eviction_policy: EvictionPolicy | None = None,
        group_filters: Sequence[GroupFilter] = (),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        config = config or BufferConfig()
        if config.stale_policy == "auto":
            config = msgspec.structs.replace(config, stale_policy="drop")
        self.config = config
        self.sampling_policy = sampling_policy
        self.eviction_policy = eviction_policy
        self.group_filters = [(filter_name(f), f) for f in group_filters]
        self._clock = clock
        self._clear()
        # (need, future) of coroutines waiting for ready groups / free room
        self._ready_waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._room_waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._lease_waiters = LeaseWaiters()  # starved workers' waiting leases (``waiting.py``)

    def _clear(self) -> None:
        self._version = 0
        self._recs: dict[str, Record] = {}
        self._groups: dict[str, Group] = {}
        self._pending: OrderedDict[str, Record] = OrderedDict()
        self._partial: list[tuple[int, int, str]] = []  # heap of (oldest, seq, id), lazy
        self._ready: OrderedDict[str, Group] = OrderedDict()
        self._workers: dict[str, _Worker] = {}
        self._count = [0] * len(STATE_NAMES)
        self._seq = 0  # partial-heap and ready order
        self._gseq = 0  # group admission order (also makes group ids unique)
        self._ev = dict.fromkeys(
            ("admitted", "trained", "recomputed", "recycled", "masked_tokens", "expired",
             "released", "groups_admitted", "groups_open", "groups_trained"), 0)
        self._dropped: dict[str, int] = {}
        self._gdropped: dict[str, int] = {}
        # Groups dropped as ``failed`` since the last group became ready, and the last
        # failure's reason: a reward function or environment that always fails shows here.
        self.failed_streak = 0
        self.last_failure = ""
        self._last_batch = batch_stats(dict.fromkeys(staleness_keys(self.config.max_staleness), 0), 0, 0, 0, 0)

    def ledger(self) -> Ledger:
        c, ev = self._count, self._ev
        return Ledger(
            admitted=ev["admitted"], queued=c[QUEUED], in_flight=c[IN_FLIGHT],
            partial=c[PARTIAL], waiting=c[WAITING], ready=c[READY], trained=ev["trained"],
            dropped=dict(self._dropped), recomputed=ev["recomputed"], recycled=ev["recycled"],
            masked_tokens=ev["masked_tokens"], expired=ev["expired"], released=ev["released"],
            capacity=self.config.capacity,
            groups=GroupLedger(
                admitted=ev["groups_admitted"], open=ev["groups_open"], ready=len(self._ready),
                trained=ev["groups_trained"], dropped=dict(self._gdropped),
            ),
        )

    # ---- admission internals ---------------------------------------------------------
    def _admit_record(self, group: Group, traj: Trajectory, state: int) -> Record:
        rec = Record(traj, group, state)
        group.members.append(rec)
        group.n_live += 1
        if len(group.members) == 1:
            self._groups[group.group_id] = group
            self._ev["groups_admitted"] += 1
            self._ev["groups_open"] += 1
        self._recs[traj.id] = rec
        self._pending[traj.id] = rec
        self._count[state] += 1
        self._ev["admitted"] += 1
        return rec

    def _make_room(self, need: int) -> None:
        cap = self.config.capacity
        free = cap - len(self._recs)
        if need <= free:
            return
        c = self._count
        where = ", ".join(f"{name}={c[i]}" for i, name in enumerate(STATE_NAMES))
        if need > cap or self.eviction_policy is None:
            raise BufferFull(f"{need} trajectories do not fit: {free} of {cap} free ({where})")
        victims, freed = [], 0
        for group in self.eviction_policy(list(self._ready.values())):
            victims.append(group)
            freed += group.n_live
            if free + freed >= need:
                break
        if free + freed < need:
            raise BufferFull(
                f"{need} trajectories do not fit even after evicting every ready group: "
                f"{free} of {cap} free ({where})"
            )
        for group in victims:
            self._drop_group(group, "evicted")

    # ---- lease internals -------------------------------------------------------------
    def _lease_one(self, rec: Record, worker_id: str, w: _Worker) -> None:
        c = self._count
        c[rec.state] -= 1
        c[IN_FLIGHT] += 1
        rec.state = IN_FLIGHT
        rec.worker = worker_id
        traj = rec.traj
        rec.snap = (len(traj.response_tokens), traj.num_segments)
        traj.status = _RUNNING
        w.recs[traj.id] = rec

    def _return_leases(self, worker_id: str) -> int:
        w = self._workers.pop(worker_id, None)
        if w is None:
            return 0
        return self._requeue(list(w.recs.values()))

    def _requeue(self, recs: list[Record]) -> int:
        """Leased records back to the queues' fronts, cut back to what was leased."""
        for rec in reversed(recs):  # reversed: each goes to the queue's front
            rec.worker = None
            rec.traj = restore(rec.traj, rec.snap)
            if rec.group.dropped:
                self._drop_rec(rec, rec.group.dropped)
            elif rec.traj.response_tokens:
                self._place_partial(rec)
            else:
                self._move(rec, QUEUED)
                self._pending[rec.traj.id] = rec
                self._pending.move_to_end(rec.traj.id, last=False)
        self._notify()
        return len(recs)

    # ---- returning trajectories: plan, then commit -------------------------------------
    def _return_batch(self, batch: list[PutItem]) -> None:
        """Plan every returned trajectory's fate (running user filters) before changing
        anything, then commit; so a filter that raises leaves the buffer unchanged. Each
        item carries its loss-token stats and version runs (``Trajectory.validate_runs``
        returns them)."""
        if len(batch) == 1:  # most puts: one trajectory, one group
            self._commit_group(batch, *self._plan_group(batch))
            return
        by_group: dict[str, list[PutItem]] = {}
        for item in batch:
            by_group.setdefault(item[0].group.group_id, []).append(item)
        plans = [(items, *self._plan_group(items)) for items in by_group.values()]
        for items, actions, verdict in plans:
            self._commit_group(items, actions, verdict)

    def _plan_group(self, items: list[PutItem]) -> tuple[list[int], str | None]:
        group: Group = items[0][0].group
        if group.dropped:
            return [_DROP] * len(items), group.dropped
        policy = self.config.stale_policy
        if policy == "mask":  # nothing is doomed: stale tokens are masked at get_batch
            actions = [_PARTIAL if item[1].status is _PARTIAL_STATUS else _FINISH for item in items]
        else:
            eta, version = self.config.max_staleness, self._version
            doomed = [is_doomed(item[2][0], version, eta) for item in items]
            if policy == "drop" and any(doomed):
                return [_DOOM] * len(items), "stale"
            actions = [
                _RESET if d else (_PARTIAL if item[1].status is _PARTIAL_STATUS else _FINISH)
                for d, item in zip(doomed, items)
            ]
        if group.n_finished + actions.count(_FINISH) < group.size:
            return actions, None
        new = {id(item[0]): item[1] for item in items}
        members = [new.get(id(r), r.traj) for r in group.members]
        return actions, self._verdict(members)

    def _verdict(self, members: list[Trajectory]) -> str | None:
        """Why a complete group is dropped, or None to make it ready."""
        for t in members:
            if t.status is _FAILED:
                return "failed"
        for name, keep in self.group_filters:
            if not keep(members):
                return name
        return None

    def _commit_group(self, items: list[PutItem], actions: list[int], verdict: str | None) -> None:
        group: Group = items[0][0].group
        workers, count = self._workers, self._count
        for (rec, traj, stats, runs), action in zip(items, actions):
            w = workers.get(rec.worker)  # type: ignore[arg-type]
            if w is not None:
                del w.recs[traj.id]
                if not w.recs:
                    del workers[rec.worker]  # type: ignore[arg-type]
            rec.worker = None
            rec.traj = traj
            rec.oldest, rec.n_loss, rec.vsum = stats
            rec.runs = runs
            if action == _FINISH or action == _DOOM:
                count[rec.state] -= 1  # type: ignore[index]
                count[WAITING] += 1
                rec.state = WAITING
                group.n_finished += action == _FINISH
            elif action == _DROP:
                self._drop_rec(rec, group.dropped)  # type: ignore[arg-type]
            elif action == _PARTIAL:
                self._ev["recycled"] += 1
                self._place_partial(rec)
            else:
                self._move(rec, QUEUED)
                self._recompute(rec)
        if actions[0] == _DOOM:
            self._drop_group(group, "stale")
        elif group.n_finished == group.size and not group.dropped:
            if verdict is None:
                self._make_ready(group)
                self.failed_streak = 0
            else:
                self._drop_group(group, verdict)
                if verdict == "failed":
                    self.failed_streak += 1
                    failed = next(r.traj for r in group.members if r.traj.status is _FAILED)
                    self.last_failure = failed.finish_reason or "FAILED (no reason given)"

    def _place_partial(self, rec: Record) -> None:
        """Into the unfinished queue, unless under drop/recompute it can never be trained."""
        cfg = self.config
        if cfg.stale_policy != "mask" and is_doomed(rec.oldest, self._version, cfg.max_staleness):
            if cfg.stale_policy == "drop":
                self._move(rec, PARTIAL)
                self._drop_group(rec.group, "stale")
            else:
                self._move(rec, QUEUED)
                self._recompute(rec)
            return
        self._move(rec, PARTIAL)
        self._seq += 1
        rec.key = self._seq
        oldest = self._version if rec.oldest is None else rec.oldest
        heapq.heappush(self._partial, (oldest, self._seq, rec.traj.id))

    # ---- state transitions -----------------------------------------------------------
    def _move(self, rec: Record, state: int) -> None:
        c = self._count
        c[rec.state] -= 1  # type: ignore[index]
        c[state] += 1
        rec.state = state

    def _recompute(self, rec: Record) -> None:
        """Reset a held trajectory to a fresh PENDING sample at the queue's front."""
        group = rec.group
        if rec.state in (WAITING, READY):
            group.n_finished -= 1
        if group.group_id in self._ready:  # the group is complete no more
            del self._ready[group.group_id]
            for r in group.members:
                if r.state == READY:
                    self._move(r, WAITING)
            self._ev["groups_open"] += 1
        if rec.state != QUEUED:
            self._move(rec, QUEUED)
        tid = rec.traj.id
        self._pending[tid] = rec
        self._pending.move_to_end(tid, last=False)
        reset(rec.traj)
        rec.oldest, rec.n_loss, rec.vsum, rec.runs = None, 0, 0, None
        self._ev["recomputed"] += 1

    def _sweep(self) -> None:
        """Under drop/recompute, handle every held trajectory that can no longer be
        trained at the current version (O(held); runs once per version)."""
        cfg = self.config
        if cfg.stale_policy == "mask":
            return
        doomed = [
            rec for rec in self._recs.values()
            if rec.state in (PARTIAL, WAITING, READY)
            and is_doomed(rec.oldest, self._version, cfg.max_staleness)
        ]
        for rec in doomed:
            if rec.state is None or rec.group.dropped:
                continue  # went with its group already
            if cfg.stale_policy == "drop":
                self._drop_group(rec.group, "stale")
            else:
                self._recompute(rec)

    def _make_ready(self, group: Group) -> None:
        c = self._count
        for rec in group.members:
            c[rec.state] -= 1  # type: ignore[index]
            rec.state = READY
        c[READY] += len(group.members)
        self._seq += 1
        group.ready_seq = self._seq
        self._ready[group.group_id] = group
        self._ev["groups_open"] -= 1

    def _drop_rec(self, rec: Record, reason: str) -> None:
        self._count[rec.state] -= 1  # type: ignore[index]
        rec.state = None
        self._dropped[reason] = self._dropped.get(reason, 0) + 1
        del self._recs[rec.traj.id]
        group = rec.group
        group.n_live -= 1
        if group.n_live == 0:
            del self._groups[group.group_id]

    def _drop_group(self, group: Group, reason: str) -> None:
        """Drop the whole group now; members in flight are dropped when they return."""
        if group.dropped:
            return
        if self._ready.pop(group.group_id, None) is None:
            self._ev["groups_open"] -= 1
        group.dropped = reason
        self._gdropped[reason] = self._gdropped.get(reason, 0) + 1
        for rec in list(group.members):
            if rec.state is None or rec.state == IN_FLIGHT:
                continue
            if rec.state == QUEUED:
                del self._pending[rec.traj.id]
            self._drop_rec(rec, reason)

    def _notify(self) -> None:
        """Wake the async waiters whose condition may hold now (they re-check)."""
        if self._ready_waiters:
            _wake(self._ready_waiters, len(self._ready))
        if self._room_waiters:
            _wake(self._room_waiters, self.config.capacity - len(self._recs))
        if self._lease_waiters:
            self._lease_waiters.wake(self._count[QUEUED] + self._count[PARTIAL])


def _wake(waiters: list[tuple[int, asyncio.Future[None]]], have: int) -> None:
    for need, fut in waiters:
        if need <= have and not fut.done():
            fut.set_result(None)
