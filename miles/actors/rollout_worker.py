"""RolloutWorker: owns an engine, pulls work from the buffer, streams trajectories back.

The worker's ``run`` coroutine leases trajectories (the buffer hands out PARTIAL ones first,
then new prompts), rolls each out with the generate function in its own task, scores it,
and puts it back — many in flight at once, so the engine's continuous batch stays full and
reward or environment calls overlap with decoding. The loop calls the buffer at most once
every ``BUFFER_CALL_INTERVAL_S``, returning what finished and leasing new work in that one
call (``put_and_lease_async``): the buffer actor's time follows its calls more than the
trajectories they carry. A lease that finds nothing (admission, the staleness bound, no
prompts) waits in the buffer up to ``LEASE_WAIT_S`` and answers as soon as work arrives
(``miles.buffers.waiting``), so a starved worker makes one call where it would poll many
times; meanwhile the worker returns what finishes in put-only calls. At most one lease is in
flight; work a waiting lease brings after the worker stopped taking it (a drain, a hold, a
stop) goes back unstarted (``unlease``).

Weights arrive through ``receive_weights`` while ``run`` goes on: the worker's
``WeightInbox`` (``miles.transports``) stages every bucket into the engine while it keeps
decoding, then the version is committed — the only pause. With ``--partial-rollout`` the
engine swaps between two decode steps and in-flight generations continue under the new
version (each token records its version). Without it the worker drains before the commit:
it stops starting generations, lets the in-flight ones finish on the old weights, swaps, and
resumes — every trajectory then comes from one version, at the cost of idling on the long
tail (staging already happened meanwhile). ``join_weight_group`` puts the worker in the
trainer's broadcast group (NCCL / gloo transports).

Draft weights (speculative decoding, the DraftTrainer's channel) arrive through
``receive_draft_weights``: applied between two decode steps, never drained for, never
touching the policy version.

``abort_inflight`` (end of a synchronous round, shutdown) aborts the engine's requests; their
trajectories go back to the buffer as PARTIAL with their prefix, nothing lost.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Sequence
from typing import Any

from miles.actors.handles import Peer
from miles.rewards import RewardRunner
from miles.rollout import GenerateContext, GenerateFn, call_generate
from miles.transports.base import GroupSpec, WeightUpdate, as_update
from miles.transports.inbox import WeightInbox
from miles.types import PromptSample, Status, Trajectory, TrajectoryError, missing_reward_key
from miles.utils.proc import rss_mb

log = logging.getLogger(__name__)

LAG_PROBE_S = 0.05  # the event-loop lag probe's sleep (20 wake-ups a second)
# The least time between two of the run loop's calls into the buffer. Each call into the
# buffer actor has a fixed cost however little it carries (put_many's time grows with the
# number of calls, not of trajectories), and a busy worker finishing hundreds of trajectories
# a second would make a call for each few, plus a lease every poll while starved: the calls,
# not the trajectories, would keep the buffer over 1% of the run. At most one
# call per interval, returning what finished and leasing in the same call.
BUFFER_CALL_INTERVAL_S = 0.02
# How long a lease that finds nothing waits in the buffer for work. Work, a drain, a hold or a
# stop (cancel_wait) end a wait at once, so the deadline only bounds one that nothing ends (a
# lost wake-up): well inside the lease timeout, and long enough that an idle worker's deadline
# calls (two a wait: the cancel and the next lease) stay few beside a busy worker's puts.
LEASE_WAIT_S = 10.0


class RolloutWorker:
    def __init__(
        self,
        worker_id: str,
        *,
        engine: Any,
        context: GenerateContext,
        generate_fn: GenerateFn,
        buffer: Any,
        rewards: Sequence[Any] = (),
        local_reward: RewardRunner | None = None,
        max_inflight: int = 64,
        partial_rollout: bool = False,
        keep_kv_cache: bool = True,
        lease_timeout_s: float = 60.0,
        poll_interval_s: float = 0.01,
        reward_key: str | None = None,
        buffer_call_interval_s: float = BUFFER_CALL_INTERVAL_S,
        lease_wait_s: float = LEASE_WAIT_S,
        offload_weights: str = "discard",
    ) -> None:
        self.worker_id = worker_id
        self.init_s = 0.0  # construction seconds (set by the Ray actor that builds the engine)
        self.engine = engine
        self.ctx = context
        self.generate_fn = generate_fn
        self.buffer = Peer(buffer)
        self.rewards = [Peer(r) for r in rewards]
        self.local_reward = local_reward
        self.max_inflight = max_inflight
        self.partial_rollout = partial_rollout
        self.keep_kv_cache = keep_kv_cache
        self.renew_every_s = max(lease_timeout_s / 3, 0.05)
        self.poll_interval_s = poll_interval_s
        self.buffer_call_interval_s = buffer_call_interval_s
        self.lease_wait_s = lease_wait_s
        self.reward_key = reward_key
        self.offload_weights = offload_weights  # --offload-rollout: how the engine lets go of its weights
        self._warned_sum = False
        self._inflight: dict[str, asyncio.Task[None]] = {}
        self._outbox: list[Trajectory] = []
        self._lease: asyncio.Task[list[Trajectory]] | None = None  # the one lease call in flight
        self._stopping = False
        self._draining = False
        self._hold_until_version = 0
        self._reward_rr = 0
        self._idle = asyncio.Event()
        self.counters: dict[str, float] = {
            "finished": 0, "partial": 0, "failed": 0, "tokens": 0, "weight_updates": 0,
            "drain_s": 0.0, "swap_s": 0.0, "stage_s": 0.0, "busy_s": 0.0, "refused_puts": 0,
            # calls into the buffer: put-only ones, and ones that lease (returning work too)
            "weight_resyncs": 0, "put_calls": 0, "lease_calls": 0,
            # With room for more work, the time the buffer had none to lease (admission, the
            # staleness bound, no prompts): with the engine's idle time it tells a worker the
            # buffer starves from one whose own loop is too slow to feed its engine.
            "starved_s": 0.0,
            # How late the worker's event loop ran a timer (summed over LAG_PROBE_S probes): a
            # loop slowed by the engine thread's share of the GIL serves leases late.
            "loop_lag_s": 0.0, "loop_lag_max_s": 0.0,
        }
        self.inbox = WeightInbox(worker_id, engine, counters=self.counters, keep_kv_cache=keep_kv_cache,
                                 drain=self._drain)
        self.last_refusal = ""
        self._started = time.monotonic()

    # ---- the loop ---------------------------------------------------------------------
    async def run(self, hold_until_version: int = 0) -> dict[str, float]:
        """Lease, generate, return; until ``stop``. Returns the worker's counters.

        ``hold_until_version``: lease nothing before the engine runs that version. A worker
        started on a resumed run (or replacing a dead one) holds the base checkpoint until the
        broadcaster's resync lands; generating before it would spend tokens of version 0 that
        the staleness bound throws away (and make a resumed run depend on that timing)."""
        self._hold_until_version = max(self._hold_until_version, hold_until_version)
        last_renew = time.monotonic()
        last_call = float("-inf")
        starved_since: float | None = None  # with room for work, since when the buffer had none
        lag = asyncio.create_task(self._probe_loop_lag())
        try:
            while not self._stopping:
                lease = self._lease
                if lease is not None and lease.done():
                    self._lease = None
                    leased, started = lease.result()
                    now = time.monotonic()
                    if not leased:
                        starved_since = started if starved_since is None else starved_since
                    elif starved_since is not None or now - started > self.buffer_call_interval_s:
                        # it found nothing before, or waited in the buffer for this work
                        self.counters["starved_s"] += now - (started if starved_since is None else starved_since)
                        starved_since = None
                    await self._start(leased)
                free = self.max_inflight - len(self._inflight)
                wait = last_call + self.buffer_call_interval_s - time.monotonic()
                if wait <= 0 and self._lease is None and free > 0 and self._takes_work():
                    last_call = time.monotonic()
                    self._lease = asyncio.create_task(self._lease_call(free))
                elif wait <= 0 and self._outbox:
                    last_call = time.monotonic()
                    await self._flush()
                if (free <= 0 or self._draining) and starved_since is not None:
                    self.counters["starved_s"] += time.monotonic() - starved_since
                    starved_since = None
                if time.monotonic() - last_renew > self.renew_every_s and self._inflight:
                    await self.buffer.call("renew", self.worker_id)
                    last_renew = time.monotonic()
                await self._wait_for_change(max(wait, 0.0))
        finally:
            lag.cancel()
            if starved_since is not None:
                self.counters["starved_s"] += time.monotonic() - starved_since
            lease, self._lease = self._lease, None
            if lease is not None:  # stop() ended its wait; what it brought goes back unstarted
                (answer,) = await asyncio.gather(lease, return_exceptions=True)
                if isinstance(answer, tuple) and answer[0]:
                    await self.buffer.call("unlease", self.worker_id, [t.id for t in answer[0]])
        return self.stats()

    def _takes_work(self) -> bool:
        return not (self._draining or self._stopping) and self.engine.version >= self._hold_until_version

    async def _lease_call(self, free: int) -> tuple[list[Trajectory], float]:
        """The lease call (with the outbox), and when it started."""
        started = time.monotonic()
        return await self._exchange(free), started

    async def _start(self, leased: list[Trajectory]) -> None:
        """Start a generation for each leased trajectory; or, when the worker no longer takes
        work (a waiting lease answered after a drain, a hold or a stop began), give them back
        unstarted."""
        if not leased:
            return
        if not self._takes_work():
            await self.buffer.call("unlease", self.worker_id, [t.id for t in leased])
            return
        for traj in leased:
            self._inflight[traj.id] = asyncio.create_task(self._process(traj))

    async def _end_waiting_lease(self) -> None:
        """The worker stops taking work: end its lease's wait in the buffer (an answer that
        raced this is given back by ``_start``)."""
        if self._lease is not None and not self._lease.done():
            await self.buffer.call("cancel_wait", self.worker_id)

    async def _probe_loop_lag(self) -> None:
        """Sleep ``LAG_PROBE_S`` at a time and add up how late each wake-up came."""
        while True:
            start = time.monotonic()
            await asyncio.sleep(LAG_PROBE_S)
            late = max(time.monotonic() - start - LAG_PROBE_S, 0.0)
            self.counters["loop_lag_s"] += late
            self.counters["loop_lag_max_s"] = max(self.counters["loop_lag_max_s"], late)

    async def _wait_for_change(self, at_least: float = 0.0) -> None:
        """Until a generation finishes or the lease answers (or a poll interval passes); never
        less than ``at_least`` seconds (what is left of the interval between buffer calls),
        unless the lease answers first: its work starts without another call."""
        lease = self._lease if self._lease is not None and not self._lease.done() else None
        tasks: list[asyncio.Task[Any]] = [] if self._outbox else list(self._inflight.values())
        if lease is not None:
            tasks.append(lease)
        if not tasks:
            await asyncio.sleep(max(self.poll_interval_s, at_least))
            return
        start = time.monotonic()
        timeout = max(self.poll_interval_s, at_least) if self._outbox else self.poll_interval_s * 5
        done, _ = await asyncio.wait(tasks, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        at_least -= time.monotonic() - start
        if at_least <= 0 or (lease is not None and lease in done):
            return
        if lease is not None:
            await asyncio.wait([lease], timeout=at_least)
        else:
            await asyncio.sleep(at_least)

    async def _process(self, traj: Trajectory) -> None:
        start = time.monotonic()
        before = len(traj.response_tokens)
        try:
            traj.status = Status.RUNNING
            traj.num_segments += 1
            traj = await call_generate(self.generate_fn, traj, self.ctx)
            if traj.status.finished and traj.status is not Status.FAILED and traj.reward is None:
                traj = await self._score(traj)
            self._check_reward_key(traj)
        except Exception as exc:  # a generate function bug must not kill the worker
            traj.status = Status.FAILED
            traj.finish_reason = f"generate_error: {type(exc).__name__}: {exc}"[:500]
        finally:
            self.counters["busy_s"] += time.monotonic() - start
        self.counters["tokens"] += len(traj.response_tokens) - before
        if traj.status is Status.PARTIAL:
            self.counters["partial"] += 1
        elif traj.status is Status.FAILED:
            self.counters["failed"] += 1
        else:
            self.counters["finished"] += 1
        self._outbox.append(traj)
        self._inflight.pop(traj.id, None)
        if not self._inflight:
            self._idle.set()

    def _check_reward_key(self, traj: Trajectory) -> None:
        """A dict reward without the ``--reward-key`` entry fails here, with the keys it has,
        not later inside the trainer (a KeyError that stopped the run at step 1). Without
        ``--reward-key`` a dict of several entries trains on their sum: said once, in the log."""
        key, reward = self.reward_key, traj.reward
        if not key and isinstance(reward, dict) and len(reward) > 1 and not self._warned_sum:
            self._warned_sum = True  # once per worker: the sum is documented, but rarely meant
            log.warning("the reward function returns a dict (%s) and --reward-key is not set: training on "
                        "the sum of its entries; set --reward-key to train on one of them",
                        ", ".join(sorted(reward)))
        if key and isinstance(reward, dict) and key not in reward and traj.status is not Status.FAILED:
            traj.status = Status.FAILED
            traj.finish_reason = f"reward_key_missing: {missing_reward_key(reward, key)}"[:500]
            traj.reward = None

    async def _score(self, traj: Trajectory) -> Trajectory:
        if self.ctx.tokenizer is not None and not traj.response:
            traj.response = self.ctx.tokenizer.decode(traj.response_tokens)
        if self.local_reward is not None:
            return await self.local_reward.score(traj)
        if not self.rewards:
            return traj  # the generate function (an environment) set the reward, or nobody does
        last: Exception | None = None
        for _ in range(len(self.rewards) * 2):
            peer = self.rewards[self._reward_rr % len(self.rewards)]
            self._reward_rr += 1
            try:
                return await peer.call("score", traj)
            except Exception as exc:  # the reward actor died: try the next one
                last = exc
                await asyncio.sleep(0.2)
        traj.status = Status.FAILED
        traj.finish_reason = f"reward_worker_unavailable: {last}"[:500]
        return traj

    async def _exchange(self, lease: int) -> list[Trajectory]:
        """One call into the buffer: return the outbox and lease up to ``lease`` new ones
        (``put_and_lease_async``, waiting up to ``lease_wait_s`` for work); a put the buffer
        refuses is retried one by one, then leased."""
        if lease <= 0:
            await self._flush()
            return []
        batch, self._outbox = self._outbox, []
        self.counters["lease_calls"] += 1
        try:
            return await self.buffer.call("put_and_lease_async", batch, self.worker_id, lease, self.lease_wait_s)
        except TrajectoryError:
            self._outbox = batch + self._outbox
            await self._flush()
            return await self.buffer.call("lease_async", self.worker_id, lease, self.lease_wait_s)

    async def _flush(self) -> None:
        if not self._outbox:
            return
        batch, self._outbox = self._outbox, []
        self.counters["put_calls"] += 1
        try:
            await self.buffer.call("put_many", batch, self.worker_id)
        except TrajectoryError:
            # put_many is all-or-nothing; find the ones the buffer refuses (e.g. a lease that
            # expired while we worked: the buffer already re-queued it) and drop only those.
            for traj in batch:
                try:
                    await self.buffer.call("put", traj, self.worker_id)
                except TrajectoryError as exc:
                    self.counters["refused_puts"] += 1
                    self.last_refusal = str(exc)[:300]

    # ---- control ----------------------------------------------------------------------
    async def receive_weights(self, version: int, update: WeightUpdate | list[Any]) -> int:
        """Apply policy ``version``: stage every bucket (decoding goes on), drain unless
        partial rollouts are on, commit — never half an update (``WeightInbox``). ``update``
        is a ``WeightUpdate`` or a list of WeightBuckets / their ObjectRefs. Returns the
        engine's version afterwards; older or repeated versions are ignored, and a
        changed-only update the engine cannot build on leaves it as it was (the broadcaster
        resyncs)."""
        try:
            return await self.inbox.apply(as_update(version, update))
        finally:
            if not self.inbox.pending:
                self._draining = False

    async def _drain(self) -> None:
        """Stop leasing and wait for in-flight generations (unless partial rollouts are on)."""
        if self.partial_rollout or not self._inflight:
            return
        self._draining = True
        await self._end_waiting_lease()
        self._idle.clear()
        if self._inflight:
            await self._idle.wait()

    async def join_weight_group(self, spec: GroupSpec, rank: int) -> bool:
        """Join the trainer's weight broadcast group as ``rank`` (called by the broadcaster;
        returns once every rank joined)."""
        await self.inbox.join(spec, rank)
        return True

    async def receive_draft_weights(self, version: int, buckets: list[Any]) -> int:
        """Apply draft ``version`` to the engine's draft; returns the engine's draft version
        (-1 when the engine has no draft)."""
        from miles.actors.draft_trainer import apply_draft_buckets

        version = await apply_draft_buckets(self.engine, version, buckets)
        self.counters["draft_updates"] = self.counters.get("draft_updates", 0) + 1
        return version

    async def abort_inflight(self, hold_until_version: int = 0) -> int:
        """Abort every in-flight generation; they come back to the buffer as PARTIAL.
        With ``hold_until_version`` the worker leases nothing more until it runs that
        policy version (end of a synchronous round: resume on the new weights, not the old)."""
        self._hold_until_version = max(self._hold_until_version, hold_until_version)
        if self.engine.version < self._hold_until_version:
            await self._end_waiting_lease()
        n = len(self._inflight)
        if n:
            self.ctx.aborts += 1  # multi-turn episodes park between turns too
            await self.engine.abort(None)
            await asyncio.gather(*self._inflight.values(), return_exceptions=True)
            await self._flush()
        return n

    async def offload_rollout(self, hold_until_version: int) -> int:
        """``--offload-rollout``: park in-flight work, lease nothing before ``hold_until_version``,
        and have the engine release its memory until that version's weights arrive (their commit
        re-allocates it). Returns the bytes released."""
        await self.abort_inflight(hold_until_version)
        offload = getattr(self.engine, "offload", None)
        if offload is None:
            return 0
        return await offload(self.offload_weights)

    async def stop(self) -> dict[str, float]:
        """Stop leasing, park in-flight work in the buffer, return counters."""
        self._stopping = True
        await self._end_waiting_lease()
        await self.abort_inflight()
        await self._flush()
        await self.inbox.settle(10.0)  # a weight update that was landing finishes (its drain is over)
        return self.stats()

    async def evaluate(self, prompts: list[PromptSample], n: int, *, id_prefix: str = "eval") -> list[Trajectory]:
        """Roll out held-out prompts alongside training work (not through the buffer)."""
        trajs = [
            Trajectory(
                id=f"{id_prefix}-{p.prompt_id}-{i}", prompt_id=p.prompt_id, group_id=f"{id_prefix}-{p.prompt_id}",
                index_in_group=i, prompt_tokens=list(p.prompt_tokens), prompt=p.prompt, label=p.label,
                metadata=dict(p.metadata),
            )
            for p in prompts
            for i in range(n)
        ]

        async def one(t: Trajectory) -> Trajectory:
            t.num_segments += 1
            try:
                t = await call_generate(self.generate_fn, t, self.ctx)
                if t.status.finished and t.status is not Status.FAILED and t.reward is None:
                    t = await self._score(t)
                self._check_reward_key(t)
            except Exception as exc:
                t.status, t.finish_reason = Status.FAILED, f"generate_error: {exc}"[:500]
            return t

        return list(await asyncio.gather(*(one(t) for t in trajs)))

    def engine_failure(self) -> str | None:
        """Why the engine can serve nothing more (one request alone ran out of memory), or None."""
        oom = getattr(self.engine, "oom", None)
        return getattr(oom, "fatal", None)

    def ping(self) -> dict[str, float]:
        return self.stats()

    def stats(self) -> dict[str, float]:
        elapsed = max(time.monotonic() - self._started, 1e-9)
        out = {f"rollout/{k}": float(v) for k, v in self.counters.items()}
        out["rollout/inflight"] = float(len(self._inflight))
        out["rollout/version"] = float(self.engine.version)
        out["rollout/uptime_s"] = elapsed
        out["rollout/init_s"] = self.init_s
        out["rollout/pid"] = float(os.getpid())
        out["mem/worker_rss_mb"] = rss_mb()
        engine_stats = getattr(self.engine, "stats", None)
        if callable(engine_stats):
            out.update(engine_stats())
        if self.local_reward is not None:
            out.update(self.local_reward.stats())
        generate_stats = getattr(self.generate_fn, "stats", None)  # e.g. EnvRollout's env/...
        if callable(generate_stats):
            out.update(generate_stats())
        return out
