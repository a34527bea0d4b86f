"""Weights by torch.distributed broadcast: the trainer is rank 0, each rollout engine one rank.

The group is built with ``miles.transports.weight_sync.init_group`` (the same TCP rendezvous +
``PrefixStore(group_name)`` helper the SGLang path uses; a standalone group beside any the
processes already have). The trainer's side picks a free port on its node, the broadcaster
tells every member its rank (``RolloutWorker.join_weight_group``), and all ranks rendezvous;
a change of members (a worker restarted) makes the next publish build a fresh group under a
new name. NCCL moves GPU buffers; gloo moves host buffers through the very same code (CPU
runs and tests).

One broadcast per bucket of ``--update-weight-buffer-size`` bytes. The sender packs bucket
i + 1 (a device copy that also casts to the engine's dtype) while bucket i is on the wire:
the collective is issued asynchronously — NCCL runs it on its own stream while the next
pack runs on the current one; gloo in its own thread — and at most two buffers exist at a
time. The receiver posts the receive of bucket i + 1 before it stages bucket i; each
receive buffer is fresh and is staged *borrowed* (it becomes the engine's staging area), on
the receiver's own CUDA stream so nothing waits on the stream the engine decodes on. Every
member takes part in every broadcast — a member that will not apply an update still
receives it (into buffers it drops) — because a broadcast waits for all ranks.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import threading
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from miles.transports import weight_sync
from miles.transports.base import GroupSpec, NamedTensors, Stage, TransportError, WeightUpdate, WireBucket
from miles.utils.net import free_port
from miles.transports.weights import TensorMeta, layout, pack_into, views

_epochs = itertools.count(1)


def node_address() -> str:
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:  # no Ray: a local run
        pass
    return "127.0.0.1"


class DistributedSender:
    kind = "distributed"

    def __init__(self, *, backend: str, device: torch.device | str, dtype: torch.dtype | None = None,
                 timeout_s: float = 300.0, address: str | None = None) -> None:
        weight_sync.check_backend(backend)
        self.backend = backend
        self.device = torch.device(device) if backend == "nccl" else torch.device("cpu")
        if backend == "nccl" and self.device.type != "cuda":
            raise TransportError(f"nccl needs the trainer on a GPU, not {device}")
        self.dtype = dtype
        self.timeout_s = timeout_s
        self.address = address
        self.group: Any = None
        self.spec: GroupSpec | None = None
        self._pending: tuple[int, Sequence[NamedTensors], list[tuple[list[TensorMeta], int]]] | None = None

    @property
    def ready(self) -> bool:
        return self.group is not None

    def new_spec(self, world_size: int) -> GroupSpec:
        address = self.address or node_address()
        return GroupSpec(name=f"miles-weights-{os.getpid()}-{next(_epochs)}", address=address,
                         port=free_port(), world_size=world_size, backend=self.backend,
                         timeout_s=self.timeout_s)

    def join(self, spec: GroupSpec) -> None:
        """Host the group as rank 0; blocks until every member joined (or the timeout)."""
        self.close()
        self.group = weight_sync.init_group(master_address=spec.address, master_port=spec.port, rank=0,
                                            world_size=spec.world_size, group_name=spec.name,
                                            backend=spec.backend, timeout_s=spec.timeout_s,
                                            warmup_device=self.device if spec.backend == "nccl" else None)
        self.spec = spec

    def prepare(self, version: int, plans: Sequence[NamedTensors], *, full: bool = True, base_version: int = -1,
                members: Sequence[str] = ()) -> WeightUpdate:
        if self.spec is None or self.group is None:
            raise TransportError("distributed transport: no group (join one first)")
        if len(members) + 1 != self.spec.world_size:
            raise TransportError(f"update addressed to {len(members)} workers, group {self.spec.name} has "
                                 f"{self.spec.world_size - 1}")
        layouts = [layout(p, self.dtype) for p in plans]
        self._pending = (version, plans, layouts)
        return WeightUpdate(version=version, transport="distributed", full=full, base_version=base_version,
                            buckets=[WireBucket(metas=m, nbytes=n) for m, n in layouts],
                            group=self.spec.name, members=list(members))

    def transfer(self, update: WeightUpdate) -> None:
        if self._pending is None or self._pending[0] != update.version:
            raise TransportError(f"distributed transport: version {update.version} was not prepared")
        _, plans, layouts = self._pending
        self._pending = None
        inflight: deque[tuple[Any, torch.Tensor]] = deque()
        with _on_device(self.device):
            for plan, (metas, size) in zip(plans, layouts):
                if not size:
                    continue
                buf = torch.empty(size, dtype=torch.uint8, device=self.device)
                pack_into(buf, plan, metas)  # overlaps the broadcast of the previous bucket
                inflight.append((dist.broadcast(buf, src=0, group=self.group, async_op=True), buf))
                if len(inflight) > 1:
                    inflight.popleft()[0].wait()
            while inflight:
                inflight.popleft()[0].wait()
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()  # surface errors here

    def release(self, version: int) -> None:
        pass

    def close(self) -> None:
        if self.group is not None:
            with contextlib.suppress(Exception):
                weight_sync.destroy_group(self.group)
        self.group, self.spec, self._pending = None, None, None


class DistributedReceiver:
    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.group: Any = None
        self.spec: GroupSpec | None = None
        self._stream: Any = None
        # A (re)join waits for a receive on the old group; a receive for a group being
        # joined waits for the join (the broadcaster starts both without ordering them).
        self._cv = threading.Condition()

    def join(self, spec: GroupSpec, rank: int) -> None:
        with self._cv:
            try:
                self._join(spec, rank)
            finally:
                self._cv.notify_all()

    def _join(self, spec: GroupSpec, rank: int) -> None:
        self._close()
        if spec.backend == "nccl" and self.device.type != "cuda":
            raise TransportError(f"nccl weight group {spec.name}: this engine is on {self.device}, not a GPU")
        self.group = weight_sync.init_group(master_address=spec.address, master_port=spec.port, rank=rank,
                                            world_size=spec.world_size, group_name=spec.name,
                                            backend=spec.backend, timeout_s=spec.timeout_s,
                                            warmup_device=self.device if spec.backend == "nccl" else None)
        self.spec = spec

    async def receive(self, update: WeightUpdate, stage: Stage, *, join_timeout_s: float = 300.0) -> int:
        return await asyncio.to_thread(self._receive, update, stage, join_timeout_s)

    def _receive(self, update: WeightUpdate, stage: Stage, join_timeout_s: float) -> int:
        with self._cv:
            if not self._cv.wait_for(lambda: self.spec is not None and self.spec.name == update.group,
                                     timeout=join_timeout_s):
                raise TransportError(f"update {update.version} comes over group {update.group!r}; this worker "
                                     f"is in {self.spec.name if self.spec else 'none'}")
            return self._receive_locked(update, stage)

    def _receive_locked(self, update: WeightUpdate, stage: Stage) -> int:
        nccl = self.spec.backend == "nccl"
        device = self.device if nccl else torch.device("cpu")
        if nccl and self._stream is None:
            self._stream = torch.cuda.Stream(device)
        buckets = [b for b in update.buckets if b.nbytes]

        def post(b: WireBucket) -> tuple[Any, torch.Tensor]:
            buf = torch.empty(b.nbytes, dtype=torch.uint8, device=device)
            return dist.broadcast(buf, src=0, group=self.group, async_op=True), buf

        staged, error = 0, None
        with _on_device(device), (torch.cuda.stream(self._stream) if nccl else contextlib.nullcontext()):
            nxt = post(buckets[0]) if buckets else None
            for i, bucket in enumerate(buckets):
                work, buf = nxt
                work.wait()
                nxt = post(buckets[i + 1]) if i + 1 < len(buckets) else None
                if error is None:
                    try:
                        staged += stage(views(buf, bucket.metas))
                    except Exception as exc:  # keep receiving: the trainer waits for every rank
                        error = exc
        if error is not None:
            raise error
        return staged

    def close(self) -> None:
        with self._cv:
            self._close()

    def _close(self) -> None:
        if self.group is not None:
            with contextlib.suppress(Exception):
                weight_sync.destroy_group(self.group)
        self.group, self.spec = None, None


def _on_device(device: torch.device) -> Any:
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
