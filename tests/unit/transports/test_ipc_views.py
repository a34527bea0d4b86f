"""The CUDA IPC receiver keeps the named views of a mapped full-update buffer while the
buffer and its layout stay the same (host time saved per update), and rebuilds them when
either changes. The mapping itself needs a GPU (tests/gpu/test_weights_gpu.py); the
bookkeeping is checked here on host tensors."""

from __future__ import annotations

import torch

from miles.transports.cuda_ipc import POOL, CudaIpcReceiver
from miles.transports.weights import layout


def test_views_are_reused_for_the_same_buffer_and_layout_only() -> None:
    rx = CudaIpcReceiver("w0")
    tensors = [("a", torch.zeros(4, 8)), ("b", torch.zeros(8))]
    metas, size = layout(tensors, torch.bfloat16)
    flat = torch.arange(size, dtype=torch.int64).to(torch.uint8)
    first = rx._keep(b"h1", flat, metas)
    assert [n for n, _ in first] == ["a", "b"] and first[0][1].dtype == torch.bfloat16
    assert rx._keep(b"h1", flat, metas) is first  # same mapping, same layout: no rebuild
    other, _ = layout(list(reversed(tensors)), torch.bfloat16)
    assert rx._keep(b"h1", flat, other) is not first  # the layout changed
    moved = flat.clone()  # another storage under the same handle (a fresh mapping)
    again = rx._keep(b"h1", moved, other)
    assert again[0][1].untyped_storage().data_ptr() == moved.untyped_storage().data_ptr()
    for i in range(POOL + 1):  # bounded: the oldest mappings go
        rx._keep(f"x{i}".encode(), flat, metas)
    assert len(rx._mapped) == POOL and b"h1" not in rx._mapped
