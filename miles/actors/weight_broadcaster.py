"""WeightBroadcaster: keeps the newest versioned weights and delivers them to every worker.

The trainer publishes a version as a list of packed buckets (``miles.weights``); on the CPU
each bucket is one object in Ray's object store, so workers read it zero-copy. The
broadcaster pushes the bucket references to every registered worker without waiting for
them to apply (the trainer never blocks on rollouts), records which version each worker
has applied and how long delivery took, and hands the newest version to a worker that
(re)registers. A worker applies all buckets, then flips its version: never half an update.
GPU transports (NCCL broadcast, CUDA IPC) plug in behind the same ``publish``.

Channels: the policy channel calls each worker's ``receive_weights``; a second broadcaster
built with ``method="receive_draft_weights"`` is the DraftTrainer's draft channel (draft
versions, applied without touching policy versions). ``latest()`` serves pull-style
consumers (the DraftTrainer's policy copy) that must not count as workers to wait for.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from miles.actors.handles import Peer


class WeightBroadcaster:
    def __init__(self, method: str = "receive_weights") -> None:
        self.method = method  # the worker endpoint deliveries call
        self.workers: dict[str, Peer] = {}
        self.applied: dict[str, int] = {}
        self.latest_version = -1
        self.latest_buckets: list[Any] = []
        self._pushes: dict[str, asyncio.Task[None]] = {}
        self.delivery_s: list[float] = []
        self.failures = 0

    def register(self, worker_id: str, worker: Any) -> int:
        self.workers[worker_id] = Peer(worker)
        self.applied.setdefault(worker_id, -1)
        if self.latest_version >= 0:
            self._push(worker_id)
        return self.latest_version

    def unregister(self, worker_id: str) -> None:
        self.workers.pop(worker_id, None)
        self.applied.pop(worker_id, None)
        task = self._pushes.pop(worker_id, None)
        if task is not None:
            task.cancel()

    async def publish(self, version: int, buckets: list[Any]) -> None:
        """Make ``version`` the newest and start delivering it; returns without waiting."""
        if version <= self.latest_version:
            raise ValueError(f"version {version} is not newer than {self.latest_version}")
        self.latest_version = version
        self.latest_buckets = list(buckets)
        for worker_id in list(self.workers):
            self._push(worker_id)

    def _push(self, worker_id: str) -> None:
        previous = self._pushes.get(worker_id)
        # Pushes to one worker are sequential; a newer version simply follows the last one
        # (the worker ignores versions it already has).
        self._pushes[worker_id] = asyncio.ensure_future(
            self._deliver(worker_id, self.latest_version, self.latest_buckets, previous)
        )

    async def _deliver(self, worker_id: str, version: int, buckets: list[Any], previous: Any) -> None:
        if previous is not None and not previous.done():
            await asyncio.gather(previous, return_exceptions=True)
        peer = self.workers.get(worker_id)
        if peer is None or self.applied.get(worker_id, -1) >= version:
            return
        start = time.monotonic()
        try:
            applied = await peer.call(self.method, version, buckets)
        except Exception:
            self.failures += 1  # the driver's health check restarts dead workers
            return
        self.applied[worker_id] = max(self.applied.get(worker_id, -1), int(applied))
        self.delivery_s.append(time.monotonic() - start)

    def latest(self) -> tuple[int, list[Any]]:
        """The newest version and its bucket references (-1, [] before the first publish)."""
        return self.latest_version, list(self.latest_buckets)

    async def wait_applied(self, version: int, timeout: float | None = None) -> bool:
        """Wait until every registered worker runs ``version`` or newer (sync mode)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while any(v < version for v in self.applied.values()):
            if deadline is not None and time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.005)
        return True

    def stats(self) -> dict[str, float]:
        recent = self.delivery_s[-50:]
        return {
            "weights/version": float(self.latest_version),
            "weights/min_applied": float(min(self.applied.values(), default=-1)),
            "weights/delivery_s_mean": sum(recent) / len(recent) if recent else 0.0,
            "weights/delivery_s_max": max(recent, default=0.0),
            "weights/failures": float(self.failures),
        }
