"""The wire format: layout, packing with a dtype cast in the same copy, zero-copy views."""

from __future__ import annotations

import pytest
import torch

from miles.transports.weights import layout, pack, pack_all, pack_into, unpack, views


def _named() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [("a", torch.randn(3, 5, generator=g)), ("scalar", torch.tensor(2.5)), ("mask", torch.tensor([True, False, True])),
            ("ids", torch.arange(7)), ("odd", torch.randn(11, generator=g).to(torch.bfloat16))]


def test_layout_aligns_every_tensor_and_casts_only_floats() -> None:
    metas, size = layout(_named(), torch.bfloat16)
    assert all(m.offset % 16 == 0 for m in metas)
    assert [m.dtype for m in metas] == ["bfloat16", "bfloat16", "bool", "int64", "bfloat16"]
    assert metas[0].nbytes == 15 * 2 and metas[3].nbytes == 7 * 8
    assert size == metas[-1].offset + (metas[-1].nbytes + 15) // 16 * 16


@pytest.mark.parametrize("dtype", [None, torch.bfloat16, torch.float16])
def test_pack_unpack_round_trip(dtype) -> None:
    named = _named()
    bucket = pack(named, version=3, index=0, total=1, dtype=dtype)
    out = dict(unpack(bucket))
    for name, t in named:
        want = t.to(dtype) if dtype is not None and t.is_floating_point() else t
        assert out[name].dtype == want.dtype and torch.equal(out[name], want), name


def test_pack_into_a_torch_buffer_matches_the_host_pack() -> None:
    named = _named()
    metas, size = layout(named, torch.bfloat16)
    flat = torch.zeros(size, dtype=torch.uint8)
    pack_into(flat, named, metas)
    host = pack(named, version=0, index=0, total=1, dtype=torch.bfloat16)
    got = views(flat, metas)
    for (name, a), (_, b) in zip(got, unpack(host)):  # padding bytes are left as they were
        assert torch.equal(a, b), name
    assert got[0][1].data_ptr() == flat.data_ptr()  # a view, not a copy


@pytest.mark.parametrize("memcpy_bytes", [0, 64, 1 << 62])
def test_pack_into_gives_the_same_bytes_whichever_tensors_are_plain_copies(memcpy_bytes: int) -> None:
    """Large same-dtype tensors are copied one by one, the rest (casts, small ones) in one
    multi-tensor copy; the buffer must not tell which."""
    named = [*_named(), ("strided", torch.arange(64, dtype=torch.float32).view(8, 8).t())]
    metas, size = layout(named)  # no cast: every contiguous tensor may be a plain copy
    flat = torch.zeros(size, dtype=torch.uint8)
    pack_into(flat, named, metas, memcpy_bytes=memcpy_bytes)
    for (name, got), (_, want) in zip(views(flat, metas), named):
        assert torch.equal(got, want), name


def test_views_refuse_metas_past_the_buffer() -> None:
    metas, size = layout(_named())
    with pytest.raises(ValueError, match="past the bucket"):
        views(torch.zeros(size - 16, dtype=torch.uint8), metas)


def test_pack_all_buckets_by_size() -> None:
    named = [(f"t{i}", torch.zeros(256)) for i in range(10)]  # 1 KiB each
    buckets = pack_all(named, version=1, bucket_bytes=3000, dtype=torch.bfloat16)  # 512 B each on the wire
    assert [len(b.metas) for b in buckets] == [2, 2, 2, 2, 2]  # planned on the source size
    assert {b.total for b in buckets} == {5} and [b.index for b in buckets] == list(range(5))
