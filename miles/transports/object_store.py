"""Weights through Ray's object store: the CPU transport, and the fallback of the GPU ones.

The sender packs each export bucket into one host ``uint8`` numpy buffer (casting floating
tensors to the engine's dtype in the same copy) and makes ONE ``ray.put`` of it — under Ray
into a scratch buffer it reuses (``put`` copies into shared memory; pinned when the trainer
is on a GPU, so the device-to-host copy runs at full speed, and never page-faulted twice); the
receiver awaits each reference — a zero-copy, read-only view of shared memory on the same
node — and stages views into that buffer: on a CPU engine the view is borrowed (no copy at
all until the commit), on a GPU engine staging is the one host-to-device copy. The next
bucket is fetched while the current one is staged.

Without Ray (unit tests, in-process runs) the buckets themselves stand in for references.
Updates through the object store are the only ones the broadcaster can replay to a worker
that registers later, so the GPU transports fall back to this one for such workers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import torch

from miles.transports.base import BucketRef, NamedTensors, Stage, TransportError, WeightUpdate
from miles.transports.weights import WeightBucket, layout, pack, unpack


class ObjectStoreSender:
    kind = "object_store"

    def __init__(self, *, use_ray: bool, dtype: torch.dtype | None = None) -> None:
        self.use_ray = use_ray
        self.dtype = dtype
        self._scratch: torch.Tensor | None = None

    def _scratch_for(self, plan: NamedTensors) -> torch.Tensor | None:
        if not self.use_ray:
            return None  # in-process the bucket itself travels: it must own its buffer
        size = layout(plan, self.dtype)[1]
        if self._scratch is None or self._scratch.numel() < size:
            pin = torch.cuda.is_available() and any(t.is_cuda for _, t in plan)
            self._scratch = torch.empty(size, dtype=torch.uint8, pin_memory=pin)
        return self._scratch

    def prepare(self, version: int, plans: Sequence[NamedTensors], *, full: bool = True, base_version: int = -1,
                members: Sequence[str] = ()) -> WeightUpdate:
        buckets = []
        for i, plan in enumerate(plans):
            bucket = pack(plan, version=version, index=i, total=len(plans), dtype=self.dtype,
                          out=self._scratch_for(plan))
            ref: Any = bucket
            if self.use_ray:
                import ray

                ref = ray.put(bucket)  # a copy: the scratch buffer is free again
            buckets.append(BucketRef(metas=bucket.metas, nbytes=bucket.nbytes, ref=ref))
        return WeightUpdate(version=version, transport="object_store", buckets=buckets, full=full,
                            base_version=base_version)

    def transfer(self, update: WeightUpdate) -> None:
        pass  # the data is in the object store already

    def release(self, version: int) -> None:
        pass  # Ray frees an object once no reference is left

    def close(self) -> None:
        pass


async def _fetch(ref: Any) -> WeightBucket:
    return ref if isinstance(ref, WeightBucket) else await ref


class ObjectStoreReceiver:
    async def receive(self, update: WeightUpdate, stage: Stage) -> int:
        staged = 0
        refs = [b.ref for b in update.buckets]
        nxt = asyncio.ensure_future(_fetch(refs[0])) if refs else None
        for i in range(len(refs)):
            bucket = await nxt
            nxt = asyncio.ensure_future(_fetch(refs[i + 1])) if i + 1 < len(refs) else None
            if not isinstance(bucket, WeightBucket) or bucket.version != update.version:
                got = getattr(bucket, "version", type(bucket).__name__)
                if nxt is not None:
                    nxt.cancel()
                raise TransportError(f"bucket {i} of update {update.version} holds {got!r}, not a "
                                     f"WeightBucket of that version")
            staged += await asyncio.to_thread(stage, unpack(bucket))
        return staged
