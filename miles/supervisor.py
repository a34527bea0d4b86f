"""The rollout workers' lives within a run: their start, their health, their replacement.

The driver's ``watch`` loop calls ``WorkerSupervisor.check`` every ``--health-check-interval-s``.
A worker whose ``run()`` ended (it only ends on stop) or that misses its ping is replaced: its
leased trajectories go back to the buffer's queue (exactly once: ``release_worker``), it leaves
the broadcasters, and a fresh worker of the same name starts after a backoff. The replacement
joins the run only once it answers its first ping within ``STARTUP_DEADLINE_S``; one that misses
the deadline is a slow start, retried without counting against ``--max-worker-restarts`` (which
counts crashes) up to as many slow starts again. Where its node is gone and no rollout node has
room, the run goes on with the workers it has, and fails only with none left.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import ray

from miles.actors import ray_actors
from miles.config import MilesConfig

# A replacement rollout worker's construction (engine build, checkpoint load, a gloo or NCCL
# group rebuild) may take minutes on a loaded node: it has this long to answer its first
# ping, where a running worker has only the health-ping timeout.
STARTUP_DEADLINE_S = 600.0


def backoff_s(attempts: int) -> float:
    """Seconds before the ``attempts``-th replacement of one worker: doubling, capped, so a
    worker that keeps dying does not spin the cluster."""
    return min(30.0, 0.5 * 2 ** max(0, attempts - 1))


class WorkerSupervisor:
    """Starts, pings and replaces the run's rollout workers (``actors.workers``). ``fail``
    stops the run with a message; ``note`` is the checkpoint hint a failure message ends with."""

    def __init__(self, cfg: MilesConfig, actors: Any, stop: asyncio.Event, fail: Callable[[str], None],
                 note: Callable[[], str]) -> None:
        self.cfg, self.actors, self.stop, self._fail, self._note = cfg, actors, stop, fail, note
        self.runs: dict[str, Any] = {}  # each worker's run() reference
        self.stats: dict[str, dict[str, float]] = {}  # each worker's last ping
        self.restarts: dict[str, int] = {}  # crashes of each worker name (the failure limit)
        self.slow_starts: dict[str, int] = {}  # replacements that missed their start-up deadline
        self.starting: dict[str, Any] = {}  # replacements built but not yet answering a ping
        self.respawns: set[asyncio.Task[None]] = set()

    async def start(self, worker_id: str, handle: Any) -> None:
        """Register a worker with the broadcasters and start its run loop."""
        node = self.actors.worker_nodes.get(worker_id, "")  # the transport follows per pair (by node)
        latest = await self.actors.broadcaster.register.remote(worker_id, handle, node)
        if self.actors.draft_broadcaster is not None:
            await self.actors.draft_broadcaster.register.remote(worker_id, handle)
        # Registration starts the resync of the newest weights; the worker waits for them.
        self.runs[worker_id] = handle.run.remote(max(latest, 0))

    async def check(self, timeout: float) -> None:
        """Ping every worker once (``timeout`` s each) and replace those that died."""
        for worker_id, handle in list(self.actors.workers.items()):
            run_ref = self.runs.get(worker_id)
            if run_ref is None:  # replaced while this loop awaited
                continue
            done, _ = ray.wait([run_ref], timeout=0)
            try:
                if done:
                    await run_ref  # run() only returns on stop; finishing early is a death
                    raise RuntimeError("run() returned")
                self.stats[worker_id] = await asyncio.wait_for(handle.ping.remote(), timeout)
            except Exception as exc:
                await self.replace(worker_id, exc)
                continue
            if self.stats[worker_id].get("engine/oom_fatal"):  # a restart would run out again
                self._fail(f"rollout worker {worker_id}: {await handle.engine_failure.remote()}{self._note()}")

    async def replace(self, worker_id: str, cause: BaseException, *, slow: bool = False) -> None:
        """Return the worker's leases to the queue (exactly once) and start a replacement after
        a backoff (see the module docstring for slow starts)."""
        a, cfg = self.actors, self.cfg
        name = worker_id.rsplit("-", 1)[0]
        counts = self.slow_starts if slow else self.restarts
        counts[name] = counts.get(name, 0) + 1
        handle = a.workers.pop(worker_id, None) or self.starting.pop(worker_id, None)
        if handle is not None:
            ray_actors.kill(handle)
        a.worker_nodes.pop(worker_id, None)
        self.runs.pop(worker_id, None)
        self.stats.pop(worker_id, None)
        await a.broadcaster.unregister.remote(worker_id)
        if a.draft_broadcaster is not None:
            await a.draft_broadcaster.unregister.remote(worker_id)
        returned = await a.buffer.release_worker.remote(worker_id)
        what = f"did not start within {STARTUP_DEADLINE_S:.0f} s" if slow else f"died ({type(cause).__name__})"
        print(f"[miles] rollout worker {worker_id} {what}; {returned} leased trajectories returned to the queue",
              flush=True)
        if counts[name] > cfg.run.max_worker_restarts:
            self._fail(f"rollout worker {name} {'missed its start-up deadline' if slow else 'died'} "
                       f"{counts[name]} times: {cause}")
            return
        attempts = self.restarts.get(name, 0) + self.slow_starts.get(name, 0)
        task = asyncio.create_task(self._respawn(name, backoff_s(attempts)))
        self.respawns.add(task)
        task.add_done_callback(self.respawns.discard)

    async def _respawn(self, name: str, delay: float) -> None:
        """Start a replacement for ``name`` after ``delay`` and wait for its first answer under
        the start-up deadline (building an engine and loading a checkpoint on a loaded node
        takes far longer than a health ping may); only then does it join the run."""
        await asyncio.sleep(delay)
        if self.stop.is_set():
            return
        try:
            worker_id, handle = ray_actors.start_worker(self.cfg, self.actors, name, join=False)
        except ray_actors.NoNodeLeft as exc:  # its node is gone and no rollout node has room
            if not self.actors.workers and not self.starting:
                self._fail(f"rollout worker {name} cannot be replaced: {exc}")
            else:
                print(f"[miles] rollout worker {name} is not replaced ({exc}); the run goes on with "
                      f"{len(self.actors.workers)} worker(s)", flush=True)
            return
        self.starting[worker_id] = handle
        try:
            await asyncio.wait_for(handle.ping.remote(), STARTUP_DEADLINE_S)
        except asyncio.TimeoutError as exc:
            if not self.stop.is_set():
                await self.replace(worker_id, exc, slow=True)
            return
        except Exception as exc:  # its constructor raised, or the process died: a crash
            if not self.stop.is_set():
                await self.replace(worker_id, exc)
            return
        self.starting.pop(worker_id, None)
        if self.stop.is_set():
            ray_actors.kill(handle)
            return
        self.actors.workers[worker_id] = handle
        await self.start(worker_id, handle)

    def cancel_pending(self) -> None:
        """At the end of a run (``stop`` set): no more replacements; the ones still starting go."""
        for task in list(self.respawns):
            task.cancel()
        for handle in self.starting.values():
            ray_actors.kill(handle)

    async def wind_down(self) -> list[Any]:
        """Stop every worker and wait for their run loops; returns what each stop said."""
        stopped = await asyncio.gather(*(w.stop.remote() for w in self.actors.workers.values()),
                                       return_exceptions=True)
        await asyncio.gather(*self.runs.values(), return_exceptions=True)
        return list(stopped)
