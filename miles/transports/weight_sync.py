"""Weights over a torch.distributed group, in the shape SGLang's update path uses.

Both ends of ``/init_weights_update_group`` + ``/update_weights_from_distributed`` use this
module: the ``miles serve`` server (receiver, rank ``rank_offset``) and the SGLang adapter
(sender, rank 0, in the rollout worker's process). The group is built the way SGLang builds
its own (REFERENCES A.7): a TCP rendezvous at ``master_address:master_port`` hosted by rank
0, wrapped in ``PrefixStore(group_name)``, then a standalone process group that is not the
default one — so it coexists with whatever groups the process already has. Two sides that
rendezvous differently hang (pitfall C.6), which is why both ends share this code.

Transfers: one ``broadcast`` from rank 0 per tensor, in list order, or — with
``load_format="flattened_bucket"`` — one ``uint8`` buffer holding the tensors' bytes back to
back in list order, without padding (SGLang's FlattenedTensorBucket layout; miles' own
``miles.transports.weights`` buckets pad to 16 bytes and are not this wire format). The sender builds a
fresh buffer per call (pitfall C.5). Backend "gloo" moves CPU tensors, "nccl" CUDA tensors.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from miles.transports.weights import TensorMeta, dtype_name

_BACKENDS = ("gloo", "nccl")


class WeightSyncError(ValueError):
    """A weight-transfer request is malformed; the message names the field."""


def parse_dtype(name: str) -> torch.dtype:
    """'bfloat16' or 'torch.bfloat16' → torch.bfloat16 (only the dtypes miles transports)."""
    short = str(name).removeprefix("torch.")
    try:
        dtype = getattr(torch, short)
        dtype_name(dtype)  # raises for dtypes outside the transport set
    except (AttributeError, ValueError, TypeError):
        raise WeightSyncError(f"unsupported dtype {name!r}") from None
    return dtype


def check_backend(backend: str) -> str:
    if backend not in _BACKENDS:
        raise WeightSyncError(f"backend {backend!r} is not one of {_BACKENDS}")
    if backend == "nccl" and not torch.cuda.is_available():
        raise WeightSyncError("backend 'nccl' needs CUDA; use 'gloo' on the CPU")
    return backend


def init_group(*, master_address: str, master_port: int, rank: int, world_size: int,
               group_name: str, backend: str, timeout_s: float,
               warmup_device: torch.device | str | None = None) -> Any:
    """Join (rank > 0) or host (rank 0) a standalone group; blocks until all ranks joined.

    NCCL builds its communicator at the first collective, which blocks until every rank
    makes one. ``warmup_device`` runs that first collective here, while every rank is known
    to be in this call: pass it only when every rank does (miles' own transports), not
    towards a server that does not (SGLang's ``init_weights_update_group`` does not)."""
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    check_backend(backend)
    if not 0 <= rank < world_size:
        raise WeightSyncError(f"rank {rank} is outside world_size {world_size}")
    timeout = datetime.timedelta(seconds=timeout_s)
    url = f"tcp://{master_address}:{master_port}"
    store, rank, world_size = next(rendezvous(url, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    # torch has no public API for a second, non-default "world" group; this is the helper
    # init_process_group uses, called the way SGLang's init_custom_process_group calls it.
    group, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store,
                                         group_name=group_name, backend_options=None,
                                         timeout=timeout)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    if warmup_device is not None and backend == "nccl":
        device = torch.device(warmup_device)
        with torch.cuda.device(device):
            probe = torch.zeros(1, device=device)
            dist.all_reduce(probe, group=group)
            torch.cuda.synchronize(device)
    return group


def destroy_group(group: Any) -> None:
    """Leave ``group`` without waiting for the other ranks.

    NCCL's graceful destroy (``ncclCommFinalize``) is collective: it blocks until every
    rank destroys too, so two ranks that destroy one after the other (a client waiting for
    the server's HTTP reply, a sender closing before its receiver) deadlock. Aborting the
    communicator is local; gloo's destroy already is."""
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is not None and dist.get_backend(group) == "nccl":
        abort(group)
        return
    dist.destroy_process_group(group)


def plan(names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]]) -> list[TensorMeta]:
    """Validated metadata of one transfer, with byte offsets of the flattened layout."""
    if not (len(names) == len(dtypes) == len(shapes)):
        raise WeightSyncError(f"names, dtypes and shapes have different lengths "
                              f"({len(names)}, {len(dtypes)}, {len(shapes)})")
    if not names:
        raise WeightSyncError("names is empty")
    metas, offset = [], 0
    for name, dt, shape in zip(names, dtypes, shapes):
        if not isinstance(name, str) or not name:
            raise WeightSyncError(f"tensor name {name!r} is not a non-empty string")
        if not isinstance(shape, (list, tuple)) or not all(isinstance(d, int) and d >= 0 for d in shape):
            raise WeightSyncError(f"shape of {name!r} is {shape!r}, not a list of sizes")
        dtype = parse_dtype(dt)
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        metas.append(TensorMeta(name, dtype_name(dtype), tuple(shape), offset, nbytes))
        offset += nbytes
    return metas


def _view(raw: Tensor, meta: TensorMeta) -> Tensor:
    dtype = parse_dtype(meta.dtype)
    if raw.storage_offset() % torch.empty((), dtype=dtype).element_size():
        raw = raw.clone()  # a reinterpreting view needs an aligned start
    return raw.view(dtype).reshape(meta.shape)


def flatten(tensors: Sequence[tuple[str, Tensor]], device: torch.device | str) -> Tensor:
    parts = [t.detach().to(device).contiguous().reshape(-1).view(torch.uint8) for _, t in tensors]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=device)


def unflatten(flat: Tensor, metas: Sequence[TensorMeta]) -> list[tuple[str, Tensor]]:
    return [(m.name, _view(flat[m.offset : m.offset + m.nbytes], m)) for m in metas]


def receive(group: Any, metas: Sequence[TensorMeta], *, flattened: bool,
            device: torch.device | str) -> list[tuple[str, Tensor]]:
    """Receiver side: every broadcast the sender makes for this call, in order."""
    if flattened:
        total = sum(m.nbytes for m in metas)
        flat = torch.empty(total, dtype=torch.uint8, device=device)
        dist.broadcast(flat, src=0, group=group)
        return unflatten(flat, metas)
    out = []
    for m in metas:
        t = torch.empty(m.shape, dtype=parse_dtype(m.dtype), device=device)
        dist.broadcast(t, src=0, group=group)
        out.append((m.name, t))
    return out


def start_send(group: Any, tensors: Sequence[tuple[str, Tensor]], *, flattened: bool,
               device: torch.device | str) -> list[tuple[Any, Tensor]]:
    """Sender side (rank 0): start the broadcasts; returns (work handle, buffer) pairs — the
    buffers must stay alive until the work completes."""
    buffers = [flatten(tensors, device)] if flattened else [
        t.detach().to(device).contiguous() for _, t in tensors]
    return [(dist.broadcast(b, src=0, group=group, async_op=True), b) for b in buffers]


def describe(tensors: Sequence[tuple[str, Tensor]]) -> dict[str, list[Any]]:
    """The ``names``/``dtypes``/``shapes`` fields of an update request for these tensors."""
    return {
        "names": [n for n, _ in tensors],
        "dtypes": [dtype_name(t.dtype) for _, t in tensors],
        "shapes": [list(t.shape) for _, t in tensors],
    }
