"""Flattened weight buckets: the wire format of every weight transport.

A bucket is one contiguous ``uint8`` buffer plus a list of ``TensorMeta`` (name, dtype,
shape, byte offset): one object-store put per bucket, one NCCL broadcast per bucket, one
CUDA IPC handle per bucket (``miles.transports``). Names are Hugging Face parameter names,
so any engine (embedded or SGLang) can load them. ``layout`` computes the metas without
touching data (each tensor 16-byte aligned); ``pack`` fills a host (numpy) buffer,
``pack_into`` a buffer on any device, both converting to the wire dtype in the same copy.
Unpacking returns views into the buffer (no copy), which the engine stages.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator, Sequence

import msgspec
import numpy as np
import torch

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_NAMES = {v: k for k, v in _DTYPES.items()}


class TensorMeta(msgspec.Struct, frozen=True, array_like=True):
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int  # bytes from the start of the bucket
    nbytes: int


class WeightBucket(msgspec.Struct, kw_only=True):
    """A packed bucket; ``data`` is a 1-D uint8 numpy array (zero-copy through Ray)."""

    version: int
    index: int
    total: int  # number of buckets in this update; the engine commits after the last
    metas: list[TensorMeta]
    data: np.ndarray | None = None

    @property
    def nbytes(self) -> int:
        return 0 if self.data is None else int(self.data.nbytes)


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _NAMES[dtype]
    except KeyError:
        raise ValueError(f"unsupported dtype for weight transport: {dtype}") from None


def plan_buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group tensors into lists of at most ``bucket_bytes`` (a larger tensor goes alone)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket size must be positive, got {bucket_bytes}")
    current: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > bucket_bytes:
            yield current
            current, size = [], 0
        current.append((name, tensor))
        size += nbytes
    if current:
        yield current


def wire_dtype(t: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype a tensor travels in: ``dtype`` for floating tensors when given, else its own."""
    return dtype if dtype is not None and t.is_floating_point() else t.dtype


def layout(tensors: Sequence[tuple[str, torch.Tensor]], dtype: torch.dtype | None = None) -> tuple[list[TensorMeta], int]:
    """Metas of a bucket holding ``tensors`` (floating ones cast to ``dtype``), and its size."""
    metas: list[TensorMeta] = []
    offset = 0
    for name, t in tensors:
        dt = wire_dtype(t, dtype)
        nbytes = t.numel() * dt.itemsize
        metas.append(TensorMeta(name, dtype_name(dt), tuple(t.shape), offset, nbytes))
        offset += (nbytes + 15) // 16 * 16
    return metas, offset


def slots(flat: torch.Tensor, metas: Sequence[TensorMeta]) -> list[torch.Tensor]:
    """Each tensor's slot in ``flat`` (uint8, any device) as a view of its dtype and shape."""
    return [flat[m.offset : m.offset + m.nbytes].view(_DTYPES[m.dtype]).view(m.shape) for m in metas]


# pack_into copies a same-dtype tensor at least this large on its own: at GPU copy bandwidth
# its copy outlasts what a memcpy launch costs the host, so the pack stays device-bound (with
# a much smaller threshold a 0.5B model's hundreds of launches make its pack host-bound;
# benchmarks/weight_sync.py)
MEMCPY_BYTES = 16 << 20


def pack_into(flat: torch.Tensor, tensors: Sequence[tuple[str, torch.Tensor]], metas: Sequence[TensorMeta],
              *, dsts: list[torch.Tensor] | None = None, memcpy_bytes: int = MEMCPY_BYTES) -> None:
    """Copy (and cast) each tensor into its slot of ``flat`` (uint8, any device). ``dsts``:
    the slots (``slots(flat, metas)``) kept from an earlier update into the same buffer.

    A contiguous tensor of at least ``memcpy_bytes`` that keeps its dtype is one plain copy
    (a device memcpy on CUDA, at the copy ceiling); the rest — casts, small tensors — go in
    one multi-tensor copy, a few kernel launches for all of them instead of one each.
    """
    dsts = slots(flat, metas) if dsts is None else dsts
    rest_dst, rest_src = [], []
    for dst, (_, t) in zip(dsts, tensors):
        t = t.detach()
        if t.dtype == dst.dtype and t.is_contiguous() and t.numel() * t.element_size() >= memcpy_bytes:
            dst.copy_(t)
        else:
            rest_dst.append(dst)
            rest_src.append(t)
    if rest_dst:
        torch._foreach_copy_(rest_dst, rest_src)


def pack(tensors: Sequence[tuple[str, torch.Tensor]], *, version: int, index: int, total: int,
         dtype: torch.dtype | None = None, out: torch.Tensor | None = None) -> WeightBucket:
    """Copy tensors (any device) into one host uint8 buffer, 16-byte aligned per tensor;
    floating tensors are cast to ``dtype`` when given. ``out``: a host uint8 tensor of at
    least the bucket's size to pack into (a reused, possibly pinned, scratch buffer: the
    bucket's data then aliases it)."""
    metas, size = layout(tensors, dtype)
    flat = torch.from_numpy(np.empty(size, dtype=np.uint8)) if out is None else out[:size]
    devices = {t.device for _, t in tensors}
    if len(devices) == 1 and next(iter(devices)).type == "cuda":
        # Pack on the GPU (one multi-tensor copy), then one device-to-host copy of the bucket
        # instead of a synchronous small copy per tensor.
        staging = torch.empty(size, dtype=torch.uint8, device=next(iter(devices)))
        pack_into(staging, tensors, metas)
        flat.copy_(staging)
    else:
        pack_into(flat, tensors, metas)
    return WeightBucket(version=version, index=index, total=total, metas=metas, data=flat.numpy())


def views(flat: torch.Tensor, metas: Sequence[TensorMeta]) -> list[tuple[str, torch.Tensor]]:
    """(name, view) per meta into a flat uint8 buffer (any device); no copy. Every meta is
    checked to lie inside the buffer first."""
    for meta in metas:
        if meta.offset + meta.nbytes > flat.numel():
            raise ValueError(f"tensor {meta.name!r} ends at byte {meta.offset + meta.nbytes}, "
                             f"past the bucket's {flat.numel()} bytes")
    return [(meta.name, slot) for meta, slot in zip(metas, slots(flat, metas))]


def unpack(bucket: WeightBucket) -> list[tuple[str, torch.Tensor]]:
    """Views into the bucket's buffer, one per tensor (read-only if the buffer is)."""
    if bucket.data is None:
        raise ValueError(f"bucket {bucket.index} of version {bucket.version} has no data")
    buf = bucket.data
    if not buf.flags.writeable:
        # Ray's zero-copy arrays are read-only; torch warns about wrapping those, and the
        # engine only ever reads them (it copies into its own parameters).
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(buf, dtype=torch.uint8) if buf.nbytes else torch.empty(0, dtype=torch.uint8)
    else:
        flat = torch.from_numpy(buf)
    return views(flat, bucket.metas)


def pack_all(named: Iterable[tuple[str, torch.Tensor]], *, version: int, bucket_bytes: int,
             dtype: torch.dtype | None = None) -> list[WeightBucket]:
    plans = list(plan_buckets(named, bucket_bytes))
    return [pack(p, version=version, index=i, total=len(plans), dtype=dtype) for i, p in enumerate(plans)]
