"""A rollout worker's end of the transports: receive, stage, commit — never half an update.

``RolloutWorker.receive_weights`` hands every update to ``WeightInbox.apply``:

1. **stage** (under the staging lock, so updates stage in the order they come): the update
   must be newer than what the engine runs or has staged, and a changed-only update must
   build on exactly that version (else ``resync``: the broadcaster arranges a full one). Its
   buckets go through the receiver of its transport into the engine's staging area,
   borrowing the receive buffers where the engine supports that
   (``stage_weights(..., borrow=True)``). An update that will not be applied is still
   *taken part in* for transports that need every addressee (a broadcast waits for all
   ranks; an IPC handle carries a count to return), then dropped.
2. **drain** (the worker's callback; without ``--partial-rollout`` it waits for in-flight
   generations to finish on the old weights) — with no lock held, so the next update can
   stage meanwhile: the trainer's broadcast never waits for a worker's long tail.
3. **commit** whatever is staged, newest version, in one swap between two decode steps.
   Updates staged during a drain are committed together; a later ``apply`` then finds its
   version already running.

If staging fails half-way, everything staged is dropped and the engine keeps the version it
runs (the broadcaster resyncs it); a refused commit (non-finite values) likewise.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, Literal

import torch

from miles.transports import make_receiver
from miles.transports.base import GroupSpec, NamedTensors, WeightUpdate

Outcome = Literal["staged", "stale", "resync"]


class WeightInbox:
    def __init__(self, worker_id: str, engine: Any, *, counters: dict[str, float] | None = None,
                 keep_kv_cache: bool = True, drain: Callable[[], Awaitable[None]] | None = None) -> None:
        self.worker_id = worker_id
        self.engine = engine
        self.counters = counters if counters is not None else {}
        self.keep_kv_cache = keep_kv_cache
        self.drain = drain
        self.receivers: dict[str, Any] = {}
        self.staged_version = -1  # newest version staged and not yet committed
        self.active = 0  # ``apply`` calls under way
        self._lock: asyncio.Lock | None = None
        self._borrow = "borrow" in inspect.signature(engine.stage_weights).parameters

    @property
    def device(self) -> torch.device:
        return torch.device(getattr(self.engine, "device", "cpu"))

    @property
    def pending(self) -> bool:
        return self.staged_version > self.engine.version

    def receiver(self, kind: str) -> Any:
        if kind not in self.receivers:
            self.receivers[kind] = make_receiver(kind, worker_id=self.worker_id, device=self.device)
        return self.receivers[kind]

    def _staging_lock(self) -> asyncio.Lock:
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    async def join(self, spec: GroupSpec, rank: int) -> None:
        """Join the distributed weight group ``spec`` as ``rank`` (blocks until all joined)."""
        await asyncio.to_thread(self.receiver("distributed").join, spec, rank)

    def stage_tensors(self, named: NamedTensors) -> int:
        if self._borrow:
            return self.engine.stage_weights(named, borrow=True)
        return self.engine.stage_weights(named)

    async def apply(self, update: WeightUpdate) -> int:
        """Stage ``update``, drain if asked to, commit; returns the engine's version."""
        self.active += 1
        try:
            t0 = time.monotonic()
            async with self._staging_lock():
                outcome = await self._stage(update)
            if outcome == "resync":
                self._count("weight_resyncs")
                return self.engine.version
            if outcome == "staged":
                self._count("stage_s", time.monotonic() - t0)
            return await self._commit(update.transport if outcome == "staged" else None)
        finally:
            self.active -= 1

    async def settle(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) for the updates under way to land (worker shutdown)."""
        deadline = time.monotonic() + timeout_s
        while self.active and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    async def _stage(self, update: WeightUpdate) -> Outcome:
        current = max(self.engine.version, self.staged_version)
        if update.version <= current:
            await self._skip(update)
            return "stale"
        if not update.full and update.base_version != current:
            await self._skip(update)
            return "resync"
        try:
            await self.receiver(update.transport).receive(update, self.stage_tensors)
        except BaseException:
            self.discard_staged()
            raise
        self.staged_version = update.version
        return "staged"

    async def _commit(self, transport: str | None) -> int:
        if not self.pending:
            return self.engine.version
        if self.drain is not None:
            t0 = time.monotonic()
            await self.drain()
            self._count("drain_s", time.monotonic() - t0)
        async with self._staging_lock():
            if self.pending:
                t0 = time.monotonic()
                try:
                    await self.engine.commit_weights(self.staged_version, keep_kv_cache=self.keep_kv_cache)
                except BaseException:
                    self.discard_staged()
                    raise
                self._count("swap_s", time.monotonic() - t0)
                self._count("weight_updates")
                if transport is not None:
                    self._count(f"weight_updates_{transport}")
        return self.engine.version

    async def _skip(self, update: WeightUpdate) -> None:
        if update.transport == "distributed":
            await self.receiver("distributed").receive(update, lambda named: 0)
        elif update.transport == "cuda_ipc":
            self.receiver("cuda_ipc").discard(update)

    def _count(self, key: str, value: float = 1.0) -> None:
        self.counters[key] = self.counters.get(key, 0) + value

    def discard_staged(self) -> None:
        """Drop everything staged; the engine keeps running the version it has."""
        self.staged_version = -1
        discard = getattr(self.engine, "discard_staged", None)
        if callable(discard):
            discard()

    def close(self) -> None:
        for receiver in self.receivers.values():
            close = getattr(receiver, "close", None)
            if callable(close):
                close()
