"""A rollout worker's end of the transports: receivers by kind, staging into its engine.

``RolloutWorker.receive_weights`` asks the inbox to ``stage`` an update, then commits it
itself. The inbox decides whether the engine can take the update at all — it must be newer
than the engine's version, and a changed-only update must build on exactly the engine's
version — and stages it through the receiver of its transport, borrowing the receive buffers
where the engine supports that (``stage_weights(..., borrow=True)``). An update it will not
apply is still *taken part in* for the transports that need every addressee (a broadcast
waits for all ranks; an IPC handle carries a count to return), then dropped.

Outcomes: ``"staged"``, ``"stale"`` (the engine already runs this version or a newer one)
and ``"resync"`` (a changed-only update on top of a version this engine does not run: it
needs a full update, which the broadcaster arranges).
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any, Literal

import torch

from miles.transports import make_receiver
from miles.transports.base import GroupSpec, NamedTensors, WeightUpdate

Outcome = Literal["staged", "stale", "resync"]


class WeightInbox:
    def __init__(self, worker_id: str, engine: Any) -> None:
        self.worker_id = worker_id
        self.engine = engine
        self.receivers: dict[str, Any] = {}
        stage = engine.stage_weights
        self._borrow = "borrow" in inspect.signature(stage).parameters

    @property
    def device(self) -> torch.device:
        return torch.device(getattr(self.engine, "device", "cpu"))

    def receiver(self, kind: str) -> Any:
        if kind not in self.receivers:
            self.receivers[kind] = make_receiver(kind, worker_id=self.worker_id, device=self.device)
        return self.receivers[kind]

    async def join(self, spec: GroupSpec, rank: int) -> None:
        """Join the distributed weight group ``spec`` as ``rank`` (blocks until all joined)."""
        await asyncio.to_thread(self.receiver("distributed").join, spec, rank)

    def stage_tensors(self, named: NamedTensors) -> int:
        if self._borrow:
            return self.engine.stage_weights(named, borrow=True)
        return self.engine.stage_weights(named)

    async def stage(self, update: WeightUpdate) -> Outcome:
        current = self.engine.version
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
        return "staged"

    async def _skip(self, update: WeightUpdate) -> None:
        if update.transport == "distributed":
            await self.receiver("distributed").receive(update, lambda named: 0)
        elif update.transport == "cuda_ipc":
            self.receiver("cuda_ipc").discard(update)

    def discard_staged(self) -> None:
        discard = getattr(self.engine, "discard_staged", None)
        if callable(discard):
            discard()

    def close(self) -> None:
        for receiver in self.receivers.values():
            close = getattr(receiver, "close", None)
            if callable(close):
                close()
