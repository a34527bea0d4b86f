"""The weight-transport contract: what one update looks like on its way to the workers.

A ``WeightUpdate`` is the plain data the WeightBroadcaster hands each worker for one policy
version: which transport carries the bytes, one descriptor per bucket, whether it holds every
tensor (``full``) or only those that changed since ``base_version``, and — for transports
whose buckets are addressed to known processes (distributed, cuda_ipc) — the ``members`` it
is addressed to. The bytes themselves never pass through the broadcaster: they sit in Ray's
object store (``BucketRef``), travel by collective broadcast (``WireBucket``) or stay in the
trainer's GPU memory behind IPC handles (``IpcBucket``).

Two small protocols pair up per transport (``object_store``, ``distributed``, ``cuda_ipc``):

- ``WeightSender`` (trainer process): ``prepare`` turns export buckets into an update (packs,
  puts, shares); ``transfer`` moves the bytes after the broadcaster has told the workers
  (only the distributed transport has anything to do there); ``release`` drops buffers
  once every addressee is done with a version.
- ``WeightReceiver`` (rollout worker process): ``receive`` hands each bucket's tensors to a
  ``stage`` callable (the engine's staging area), never committing anything itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol

import msgspec
from torch import Tensor

from miles.transports.weights import TensorMeta, WeightBucket

TransportKind = Literal["object_store", "distributed", "cuda_ipc"]
NamedTensors = list[tuple[str, Tensor]]
Stage = Callable[[NamedTensors], int]  # stages one bucket's tensors; returns how many


class TransportError(RuntimeError):
    """Weights could not be moved by this transport; the message says what to change."""


class BucketRef(msgspec.Struct, kw_only=True):
    """Object store: one packed ``WeightBucket`` (an ObjectRef under Ray, else the bucket)."""

    metas: list[TensorMeta]
    nbytes: int
    ref: Any


class WireBucket(msgspec.Struct, kw_only=True):
    """Distributed: the layout of one broadcast buffer of ``nbytes`` bytes."""

    metas: list[TensorMeta]
    nbytes: int


class IpcHandle(msgspec.Struct, frozen=True, array_like=True):
    """What ``UntypedStorage._share_cuda_()`` returns, as plain data (one per consumer)."""

    device: int
    handle: bytes
    size: int
    offset: int
    ref_counter: bytes
    ref_counter_offset: int
    event: bytes
    event_sync: bool


class IpcBucket(msgspec.Struct, kw_only=True):
    """CUDA IPC: one packed GPU buffer of the trainer, a handle per addressed worker."""

    metas: list[TensorMeta]
    nbytes: int
    gpu_uuid: str
    handles: dict[str, IpcHandle]


class GroupSpec(msgspec.Struct, frozen=True, kw_only=True):
    """A torch.distributed group for weights: rank 0 is the trainer, rank i + 1 member i."""

    name: str
    address: str
    port: int
    world_size: int
    backend: Literal["nccl", "gloo"]
    timeout_s: float


class UpdatePlan(msgspec.Struct, frozen=True, kw_only=True):
    """The broadcaster's answer before a publish: who receives, and what they need."""

    members: list[str]  # registered workers on the trainer's node, in rank order
    full: bool  # some worker cannot apply a changed-only update (new, or it missed one)
    regroup: bool  # the distributed group no longer matches the members
    remote: list[str] = []  # workers on other nodes: a group transport's update reaches them by the object store


class WeightUpdate(msgspec.Struct, kw_only=True):
    version: int
    transport: TransportKind
    buckets: list[Any]  # BucketRef | WireBucket | IpcBucket, by transport
    full: bool = True
    base_version: int = -1  # a changed-only update applies on top of exactly this version
    group: str = ""  # distributed: the group whose broadcasts carry the buckets
    members: list[str] = []  # distributed / cuda_ipc: the workers it is addressed to

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    @property
    def num_tensors(self) -> int:
        return sum(len(b.metas) for b in self.buckets)

    @property
    def addressed(self) -> bool:
        """Every member must take part (a broadcast waits for all ranks; an IPC handle holds
        a reference the receiver has to return), even when it will not apply it."""
        return self.transport in ("distributed", "cuda_ipc")

    @property
    def replayable(self) -> bool:
        """Can be handed to a worker that joins later (object-store data with every tensor)."""
        return self.transport == "object_store" and self.full


def as_update(version: int, payload: WeightUpdate | Sequence[Any]) -> WeightUpdate:
    """A WeightUpdate from either form a worker may be handed: an update, or (the original
    form, still used by the draft channel and tests) a list of WeightBuckets / ObjectRefs."""
    if isinstance(payload, WeightUpdate):
        if payload.version != version:
            raise ValueError(f"update of version {payload.version} delivered as version {version}")
        return payload
    buckets = []
    for item in payload:
        if isinstance(item, BucketRef):
            buckets.append(item)
        elif isinstance(item, WeightBucket):
            buckets.append(BucketRef(metas=item.metas, nbytes=item.nbytes, ref=item))
        else:  # an ObjectRef: its metas come with the data
            buckets.append(BucketRef(metas=[], nbytes=0, ref=item))
    return WeightUpdate(version=version, transport="object_store", buckets=buckets)


class WeightSender(Protocol):
    kind: TransportKind

    def prepare(self, version: int, plans: Sequence[NamedTensors], *, full: bool, base_version: int,
                members: Sequence[str]) -> WeightUpdate:
        """Called by the PolicyTrainer (in a thread) with the export buckets of ``version``."""
        ...

    def transfer(self, update: WeightUpdate) -> None:
        """Called after the broadcaster has the update, while the workers receive it."""
        ...

    def release(self, version: int) -> None:
        """Called once every addressee of ``version`` finished with it (or is gone)."""
        ...

    def close(self) -> None:
        ...


class WeightReceiver(Protocol):
    async def receive(self, update: WeightUpdate, stage: Stage) -> int:
        """Called by a RolloutWorker: every bucket of ``update`` through ``stage``; returns
        the number of tensors staged."""
        ...
