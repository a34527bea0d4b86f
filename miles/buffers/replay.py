"""The versioned replay buffer: where rollout workers and the trainer meet.

Life of a sample (docs/design.md): the driver admits prompts (``add_prompts``: one group of
``n`` PENDING trajectories each); workers ``lease`` work — PARTIAL trajectories first, the
oldest first, then PENDING ones — and ``put`` it back, finished or PARTIAL (recycled to the
unfinished queue); when a group's members have all finished, the group filters run and the
group becomes ready; ``get_batch`` hands whole ready groups to the trainer, never a
loss token older than ``max_staleness`` (η). Every trajectory is counted in exactly one
ledger state until it is trained or dropped with a reason.

Staleness (bound logic in ``miles.scheduler.staleness``): a token is too old for good once
``current_version - token_version > η``, because the trainer's version never goes below
the newest published one. ``stale_policy`` says what then happens:

* ``drop``: the whole group is dropped, reason ``stale`` (groups are never split);
* ``recompute``: the stale trajectory is reset to a fresh PENDING sample of its prompt and
  re-queued at the front (counted in ``recomputed``); its siblings wait for it;
* ``mask``: the trajectory is kept; ``get_batch`` zeroes ``loss_mask`` on the stale tokens
  (counted in ``masked_tokens``), as slime's --mask-offpolicy-in-partial-rollout.

Under drop/recompute the check runs eagerly — at ``put``, at ``lease`` of a partial, on a
returned lease, and over everything held at ``set_version`` — and again at ``get_batch``.

Failures: a group with any FAILED member is dropped whole with reason ``failed`` (GRPO
baselines need all ``n`` samples of a prompt, and a failure is usually the engine's, not
the sample's). Group filters (dynamic sampling) then run in order; the first that rejects
names the drop reason.

Leases: a worker's leases share one deadline, ``lease_timeout_s`` after its last ``lease``,
``renew`` or successful ``put``; ``expire_leases`` and ``release_worker`` return a lapsed
worker's trajectories to the queues exactly once, cut back to what was leased. A put for a
lease that is gone is refused with an error, so nothing is counted twice.

Capacity counts every live trajectory (queued, in flight, partial, waiting, ready):
``add_prompts`` beyond it raises :class:`BufferFull` (or evicts ready groups, counted, if
an ``eviction_policy`` is given); ``add_prompts_async`` waits for room. Puts never need
room: they return work the buffer already counts.

All methods are synchronous and never await in the middle of a change, so a Ray async
actor may call them from its event loop; ``*_async`` variants wait, they do not lock.
Checkpointing lives in ``miles.buffers.checkpoint``.
"""

from __future__ import annotations

import asyncio
import heapq
from collections.abc import Callable, Sequence
from typing import Any

from miles.buffers import batching, checkpoint
from miles.buffers.core import STALE_POLICIES, BufferConfig, BufferCore, BufferFull, PutItem, _Worker
from miles.buffers.records import IN_FLIGHT, PARTIAL, QUEUED, STATE_NAMES, Group, Record
from miles.scheduler.staleness import is_doomed
from miles.types import PromptSample, Status, Trajectory, TrajectoryError, loss_version_stats

__all__ = ["STALE_POLICIES", "BufferConfig", "BufferFull", "ReplayBuffer"]

_RETURNABLE = frozenset(
    {Status.PARTIAL, Status.COMPLETED, Status.TRUNCATED, Status.ABORTED, Status.FAILED}
)


class ReplayBuffer(BufferCore):
    """Versioned replay buffer; see the module docstring for the life cycle."""

    # ---- introspection -------------------------------------------------------------
    @property
    def version(self) -> int:
        return self._version

    @property
    def live(self) -> int:
        return len(self._recs)

    def prompt_room(self, n_samples_per_prompt: int | None = None) -> int:
        """How many more prompts ``add_prompts`` accepts now (without evicting)."""
        n = n_samples_per_prompt or self.config.n_samples_per_prompt
        return max(0, self.config.capacity - len(self._recs)) // n

    def failures(self) -> tuple[int, str]:
        """(groups dropped as failed since a group last became ready, the last reason)."""
        return self.failed_streak, self.last_failure

    def leased(self, worker_id: str) -> list[str]:
        """Ids of the trajectories leased to ``worker_id``."""
        w = self._workers.get(worker_id)
        return list(w.recs) if w else []

    def stats(self) -> dict[str, float]:
        """Path-named metrics: sizes, last batch's staleness, recycle counts, drops."""
        c, ev = self._count, self._ev
        out: dict[str, float] = {f"buffer/{name}": float(c[i]) for i, name in enumerate(STATE_NAMES)}
        out.update({
            "buffer/version": float(self._version),
            "buffer/admitted": float(ev["admitted"]),
            "buffer/trained": float(ev["trained"]),
            "buffer/live": float(len(self._recs)),
            "buffer/fill": len(self._recs) / self.config.capacity,
            "buffer/ready_groups": float(len(self._ready)),
            "buffer/open_groups": float(ev["groups_open"]),
            "buffer/recycled_partials": float(ev["recycled"]),
            "buffer/recomputed": float(ev["recomputed"]),
            "buffer/masked_tokens": float(ev["masked_tokens"]),
            "buffer/expired_leases": float(ev["expired"]),
            "buffer/released_leases": float(ev["released"]),
            "buffer/leased_workers": float(len(self._workers)),
            "buffer/failed_group_streak": float(self.failed_streak),
        })
        out.update({f"buffer/dropped/{k}": float(v) for k, v in self._dropped.items()})
        out.update({f"buffer/dropped_groups/{k}": float(v) for k, v in self._gdropped.items()})
        out.update(self._last_batch)
        return out

    # ---- admission -------------------------------------------------------------------
    def add_prompts(
        self, prompts: Sequence[PromptSample], n_samples_per_prompt: int | None = None
    ) -> list[str]:
        """Admit each prompt as a group of ``n`` PENDING trajectories; return the group ids.

        Raises BufferFull (nothing added) when the trajectories do not fit, unless an
        eviction policy can free room by dropping ready groups (counted as ``evicted``).
        """
        n = self.config.n_samples_per_prompt if n_samples_per_prompt is None else n_samples_per_prompt
        if n < 1:
            raise ValueError(f"n_samples_per_prompt must be >= 1, got {n}")
        for p in prompts:
            if not isinstance(p, PromptSample):
                raise TypeError(f"prompts: expected PromptSample, got {type(p).__name__}")
        self._make_room(len(prompts) * n)
        gids = []
        for p in prompts:
            gid = f"{p.prompt_id}#{self._gseq}"
            while gid in self._groups:  # only if a caller's own group id looks like ours
                self._gseq += 1
                gid = f"{p.prompt_id}#{self._gseq}"
            group = Group(gid, p.prompt_id, n, self._gseq)
            self._gseq += 1
            for i in range(n):
                traj = Trajectory(
                    id=f"{gid}/{i}", prompt_id=p.prompt_id, group_id=gid, index_in_group=i,
                    prompt_tokens=p.prompt_tokens, prompt=p.prompt, label=p.label,
                    metadata=dict(p.metadata),
                )
                self._admit_record(group, traj, QUEUED)
            gids.append(gid)
        self._notify()  # waiting leases
        return gids

    def add_groups(self, groups: Sequence[Sequence[Trajectory]]) -> list[str]:
        """Admit pre-built groups (a driver that builds its own samples, or unfinished
        samples carried over from elsewhere): members PENDING or PARTIAL, ids unique and
        not held already, one group id per group, indices ``0..n-1``. Bad input raises
        TrajectoryError naming the field, and nothing is added."""
        checkpoint.check_new_groups(self, groups)
        self._make_room(sum(len(g) for g in groups))
        gids = []
        for members in groups:
            first = members[0]
            group = Group(first.group_id, first.prompt_id, len(members), self._gseq)
            self._gseq += 1
            for traj in sorted(members, key=lambda t: t.index_in_group):
                rec = self._admit_record(group, traj, QUEUED)
                if traj.status is Status.PARTIAL:
                    del self._pending[traj.id]
                    rec.oldest, rec.n_loss, rec.vsum = loss_version_stats(traj.versions, traj.loss_mask)
                    self._place_partial(rec)
            gids.append(group.group_id)
        self._notify()
        return gids

    # ---- workers ---------------------------------------------------------------------
    def lease(self, worker_id: str, max_items: int) -> list[Trajectory]:
        """Up to ``max_items`` trajectories to generate: PARTIAL ones first (oldest loss
        tokens first), then PENDING in admission order. They become RUNNING and leased to
        ``worker_id`` until ``lease_timeout_s`` after the worker's last sign of life."""
        out: list[Trajectory] = []
        w = self._workers.get(worker_id)
        if max_items <= 0 or not (self._partial or self._pending):
            if w is not None:  # asking for work is a sign of life
                w.deadline = self._clock() + self.config.lease_timeout_s
            return out
        if w is None:
            w = self._workers[worker_id] = _Worker(0.0)
        w.deadline = self._clock() + self.config.lease_timeout_s
        heap, recs = self._partial, self._recs
        while heap and len(out) < max_items:
            _, key, tid = heapq.heappop(heap)
            rec = recs.get(tid)
            if rec is None or rec.state != PARTIAL or rec.key != key:
                continue  # a lazily deleted entry
            if self.config.stale_policy != "mask" and is_doomed(
                rec.oldest, self._version, self.config.max_staleness
            ):
                if self.config.stale_policy == "drop":
                    self._drop_group(rec.group, "stale")
                    continue
                self._recompute(rec)
                del self._pending[tid]  # leased right away, below
            self._lease_one(rec, worker_id, w)
            out.append(rec.traj)
        pending = self._pending
        while pending and len(out) < max_items:
            rec = pending.popitem(last=False)[1]
            self._lease_one(rec, worker_id, w)
            out.append(rec.traj)
        if not w.recs:
            del self._workers[worker_id]
        return out

    def put_and_lease(self, trajs: Sequence[Trajectory], worker_id: str, max_items: int) -> list[Trajectory]:
        """``put_many(trajs, worker_id)`` then ``lease(worker_id, max_items)``: a rollout
        worker returns what it finished and takes new work in one round trip (each call into
        the buffer actor costs it more than the few trajectories a call carries). The put is
        all-or-nothing as ``put_many``'s; when it raises, nothing is leased."""
        if trajs:
            self.put_many(trajs, worker_id)
        return self.lease(worker_id, max_items)

    def lease_or_wait(self, worker_id: str, max_items: int, wake: Callable[[], None]) -> list[Trajectory]:
        """``lease``; when it finds nothing, register a waiting lease that calls ``wake``
        (once, from inside whichever buffer call makes work leasable) so the worker leases
        again then instead of polling (``miles.buffers.waiting``). Ends the worker's
        previous waiting lease either way, handing on what it was woken for."""
        out = self.lease(worker_id, max_items)
        self.cancel_wait(worker_id)
        if not out and max_items > 0:
            self._lease_waiters.add(worker_id, max_items, wake)
        return out

    def cancel_wait(self, worker_id: str) -> bool:
        """End the worker's waiting lease, if it has one: a waiting ``lease_async`` returns
        nothing (the worker stops, drains or holds, or is gone). Work it was woken for goes
        to the next waiters. Returns whether there was one."""
        waiter = self._lease_waiters.remove(worker_id)
        if waiter is None:
            return False
        if waiter.woken:
            self._lease_waiters.wake(self._count[QUEUED] + self._count[PARTIAL])
        else:
            waiter.wake()  # a waiting coroutine sees its lease gone and returns
        return True

    def unlease(self, worker_id: str, ids: Sequence[str]) -> int:
        """Give back leased trajectories the worker has not started (a waiting lease that
        answered after the worker stopped taking work): they go back to the queues' fronts
        as they were leased, counted as neither released nor expired. Returns how many."""
        w = self._workers.get(worker_id)
        if w is None:
            return 0
        recs = [w.recs.pop(tid) for tid in ids if tid in w.recs]
        if not w.recs:
            del self._workers[worker_id]
        return self._requeue(recs)

    def renew(self, worker_id: str) -> list[str]:
        """Heartbeat: extend all of the worker's leases. Returns the ids it holds whose
        group was dropped meanwhile (their results will be discarded: abort them)."""
        w = self._workers.get(worker_id)
        if w is None:
            return []
        w.deadline = self._clock() + self.config.lease_timeout_s
        return [tid for tid, rec in w.recs.items() if rec.group.dropped]

    def put(self, traj: Trajectory, worker_id: str | None = None) -> None:
        """Return one leased trajectory, finished or PARTIAL (see ``put_many``)."""
        self.put_many((traj,), worker_id)

    def put_many(self, trajs: Sequence[Trajectory], worker_id: str | None = None) -> None:
        """Return leased trajectories, each finished (COMPLETED/TRUNCATED/ABORTED/FAILED) or
        PARTIAL. All are validated first; on any error (naming the field) nothing changes.
        ``worker_id``, when given, must hold the lease; a lease that expired or was
        released is gone, and its late put is refused."""
        check = self._check_put
        batch = [check(t, worker_id) for t in trajs]
        if len(batch) > 1 and len({t.id for t in trajs}) != len(batch):
            ids = [t.id for t in trajs]
            dup = next(i for i in ids if ids.count(i) > 1)
            raise TrajectoryError("id", f"trajectory {dup!r} appears twice in one put_many")
        if worker_id is not None:
            w = self._workers.get(worker_id)
            if w is not None:
                w.deadline = self._clock() + self.config.lease_timeout_s
        if batch:
            self._return_batch(batch)
        self._notify()

    def _check_put(self, traj: Trajectory, worker_id: str | None) -> PutItem:
        rec = self._recs.get(traj.id)
        if rec is None:
            if traj.group_id not in self._groups:
                raise TrajectoryError(
                    "group_id", f"unknown group {traj.group_id!r} (trajectory {traj.id!r})")
            raise TrajectoryError(
                "id", f"unknown trajectory {traj.id!r}: never admitted, or already trained or dropped")
        if rec.state != IN_FLIGHT:
            raise TrajectoryError(
                "id", f"trajectory {traj.id!r} is not leased (it is {STATE_NAMES[rec.state]}): "
                "its lease expired or was released, or it was never leased")
        if worker_id is not None and rec.worker != worker_id:
            raise TrajectoryError(
                "id", f"trajectory {traj.id!r} is leased to {rec.worker!r}, not {worker_id!r}")
        old = rec.traj
        if traj is not old and (
            traj.group_id != old.group_id or traj.prompt_id != old.prompt_id
            or traj.index_in_group != old.index_in_group
        ):
            for name in ("group_id", "prompt_id", "index_in_group"):
                if getattr(traj, name) != getattr(old, name):
                    raise TrajectoryError(
                        name, f"{getattr(traj, name)!r} differs from the leased trajectory's "
                        f"{getattr(old, name)!r} ({traj.id!r})")
        if traj.status not in _RETURNABLE:
            raise TrajectoryError(
                "status", f"a returned trajectory must be PARTIAL or finished, got {traj.status}")
        return (rec, traj, *traj.validate_runs(current_version=self._version))

    def release_worker(self, worker_id: str) -> int:
        """The worker is gone: its leased trajectories go back to the queues (PARTIAL if
        they had tokens when leased, else PENDING), exactly once. Returns how many."""
        self.cancel_wait(worker_id)  # a gone worker's waiting lease must not lease for it
        n = self._return_leases(worker_id)
        self._ev["released"] += n
        return n

    def release_all_workers(self) -> int:
        """Every lease goes back (a resumed run: the workers that held them are gone)."""
        return sum(self.release_worker(wid) for wid in list(self._workers))

    def expire_leases(self) -> int:
        """Return the trajectories of every worker past its deadline; returns how many."""
        now = self._clock()
        n = 0
        for wid in [wid for wid, w in self._workers.items() if w.deadline <= now]:
            n += self._return_leases(wid)
        self._ev["expired"] += n
        return n

    # ---- trainer ---------------------------------------------------------------------
    def set_version(self, version: int) -> None:
        """The newest published policy version. Puts carrying newer tokens are refused;
        under drop/recompute everything held that can no longer be trained is handled now."""
        if not isinstance(version, int) or version < self._version:
            raise ValueError(f"version: must be an int >= {self._version}, got {version!r}")
        if version == self._version:
            return
        self._version = version
        self._sweep()
        self._notify()

    def get_batch(self, num_groups: int, trainer_version: int) -> list[list[Trajectory]]:
        """Exactly ``num_groups`` whole ready groups whose loss tokens all satisfy
        ``trainer_version - version <= max_staleness`` (after masking, under "mask"), in
        sampling-policy order, each sorted by index; or ``[]`` if there are not enough.
        Handed-out trajectories count as trained. Stale groups met on the way are handled
        by the stale policy whether or not a batch is returned."""
        if num_groups < 1:
            raise ValueError(f"num_groups must be >= 1, got {num_groups}")
        if not isinstance(trainer_version, int) or trainer_version < 0:
            raise ValueError(f"trainer_version must be an int >= 0, got {trainer_version!r}")
        if len(self._ready) < num_groups:
            return []
        return batching.take_batch(self, num_groups, trainer_version)

    # ---- async variants (one event loop; they wait, never lock) -----------------------
    async def get_batch_async(
        self, num_groups: int, trainer_version: int, timeout: float | None = None
    ) -> list[list[Trajectory]]:
        """``get_batch``, waiting until enough groups are ready (``[]`` after ``timeout``)."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            batch = self.get_batch(num_groups, trainer_version)
            if batch:
                return batch
            if not await _wait(self._ready_waiters, num_groups, loop, deadline):
                return self.get_batch(num_groups, trainer_version)

    async def lease_async(self, worker_id: str, max_items: int, wait_s: float = 0.0) -> list[Trajectory]:
        """``lease``, waiting up to ``wait_s`` seconds for work when there is none: the
        worker is woken when work arrives (``lease_or_wait``) and returns at once with it,
        or with nothing at the deadline or when ``cancel_wait`` ends the wait."""
        if wait_s <= 0 or max_items <= 0:
            return self.lease(worker_id, max_items)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        waiter = None
        try:
            while True:
                woken: asyncio.Future[None] = loop.create_future()
                out = self.lease_or_wait(worker_id, max_items, lambda f=woken: f.done() or f.set_result(None))
                waiter = self._lease_waiters.get(worker_id)
                if out:
                    return out
                try:
                    await asyncio.wait_for(woken, max(0.0, deadline - loop.time()))
                except TimeoutError:
                    return []
                if self._lease_waiters.get(worker_id) is not waiter:  # cancelled
                    waiter = None
                    return []
        finally:
            if waiter is not None and self._lease_waiters.get(worker_id) is waiter:
                self.cancel_wait(worker_id)

    async def put_and_lease_async(
        self, trajs: Sequence[Trajectory], worker_id: str, max_items: int, wait_s: float = 0.0
    ) -> list[Trajectory]:
        """``put_and_lease`` whose lease waits up to ``wait_s`` seconds for work
        (``lease_async``); the put happens at once."""
        if trajs:
            self.put_many(trajs, worker_id)
        return await self.lease_async(worker_id, max_items, wait_s)

    async def add_prompts_async(
        self, prompts: Sequence[PromptSample], n_samples_per_prompt: int | None = None,
        timeout: float | None = None,
    ) -> list[str]:
        """``add_prompts``, waiting for room instead of raising (BufferFull after
        ``timeout``, or at once if the prompts could never fit)."""
        n = n_samples_per_prompt or self.config.n_samples_per_prompt
        need = len(prompts) * n
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            try:
                return self.add_prompts(prompts, n_samples_per_prompt)
            except BufferFull:
                if need > self.config.capacity or (deadline is not None and loop.time() >= deadline):
                    raise
            await _wait(self._room_waiters, need, loop, deadline)  # then one more try

    async def put_async(self, traj: Trajectory, worker_id: str | None = None) -> None:
        """``put``; never waits (a put returns work the buffer already counts)."""
        self.put_many((traj,), worker_id)

    async def put_many_async(self, trajs: Sequence[Trajectory], worker_id: str | None = None) -> None:
        self.put_many(trajs, worker_id)

    # ---- checkpoint ------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything (held trajectories, queues, leases, counters) as msgpack-able data."""
        return checkpoint.dump(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace this buffer's contents with ``state`` (config and policies stay)."""
        checkpoint.load(self, state)
        self._sweep()  # this run's bound may be tighter than the saved run's
        self._notify()


async def _wait(
    waiters: list[tuple[int, asyncio.Future[None]]], need: int,
    loop: asyncio.AbstractEventLoop, deadline: float | None,
) -> bool:
    """Wait until ``_notify`` says ``need`` may be met; False once ``deadline`` passed."""
    entry = (need, loop.create_future())
    waiters.append(entry)
    try:
        left = None if deadline is None else max(0.0, deadline - loop.time())
        await asyncio.wait_for(entry[1], left)
        return True
    except TimeoutError:
        return False
    finally:
        waiters.remove(entry)
