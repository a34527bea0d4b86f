"""Weight transports: how a published policy version gets from the trainer into the engines.

Wiring: the PolicyTrainer owns a ``WeightSender`` (``make_sender`` from ``--weight-transport``,
see ``config.py``) and publishes ``WeightUpdate``s through the WeightBroadcaster, which hands
each registered RolloutWorker the update; the worker's ``WeightReceiver`` (one per transport
kind, ``make_receiver``) stages the buckets into its engine while decoding goes on, and the
worker then commits the version (the engine's only pause). Files:

- ``base.py``: the update structs and the two protocols;
- ``object_store.py``: Ray's object store (CPU, cross-node; the fallback of the others);
- ``distributed.py``: NCCL (or gloo) broadcast over a trainer + engines group;
- ``cuda_ipc.py``: colocated engines map the trainer's GPU buffers;
- ``changed.py``: changed-tensors-only updates (fingerprints);
- ``weights.py``: packed weight buckets, the wire format of every transport;
- ``weight_sync.py``: the torch.distributed group and transfers a sender and an HTTP server share;
- ``config.py``: the flags and the ``auto`` choice.
"""

from __future__ import annotations

from typing import Any

import torch

from miles.transports.base import (
    BucketRef,
    GroupSpec,
    IpcBucket,
    IpcHandle,
    TransportError,
    UpdatePlan,
    WeightReceiver,
    WeightSender,
    WeightUpdate,
    WireBucket,
    as_update,
)
from miles.transports.changed import ChangeTracker
from miles.transports.config import WeightsConfig, resolve_transport, transport_problems
from miles.transports.object_store import ObjectStoreReceiver, ObjectStoreSender


def make_sender(kind: str, *, device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
                use_ray: bool = False, timeout_s: float = 300.0) -> Any:
    """The trainer's sender for a resolved transport name (``resolve_transport``)."""
    if kind == "object_store":
        return ObjectStoreSender(use_ray=use_ray, dtype=dtype)
    if kind in ("nccl", "gloo"):
        from miles.transports.distributed import DistributedSender

        return DistributedSender(backend=kind, device=device, dtype=dtype, timeout_s=timeout_s)
    if kind == "cuda_ipc":
        from miles.transports.cuda_ipc import CudaIpcSender

        return CudaIpcSender(device, dtype=dtype)
    raise ValueError(f"unknown weight transport {kind!r} (object_store, nccl, gloo, cuda_ipc)")


def make_receiver(kind: str, *, worker_id: str, device: torch.device | str = "cpu") -> Any:
    """A worker's receiver for updates whose ``transport`` is ``kind``."""
    if kind == "object_store":
        return ObjectStoreReceiver()
    if kind == "distributed":
        from miles.transports.distributed import DistributedReceiver

        return DistributedReceiver(device)
    if kind == "cuda_ipc":
        from miles.transports.cuda_ipc import CudaIpcReceiver

        return CudaIpcReceiver(worker_id)
    raise ValueError(f"unknown transport kind {kind!r} (object_store, distributed, cuda_ipc)")


__all__ = [
    "BucketRef", "ChangeTracker", "GroupSpec", "IpcBucket", "IpcHandle", "ObjectStoreReceiver",
    "ObjectStoreSender", "TransportError", "UpdatePlan", "WeightReceiver", "WeightSender", "WeightUpdate",
    "WeightsConfig", "WireBucket", "as_update", "make_receiver", "make_sender", "resolve_transport",
    "transport_problems",
]
