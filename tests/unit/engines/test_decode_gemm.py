"""The split-K decode GEMM (``miles.kernels.decode_gemm``) against torch's linear: plain and
with the residual, every split count (the in-kernel reduction by the last program of a tile),
repeated calls (its counters reset themselves). Runs on CUDA, or on the CPU in triton's
interpreter (float32 and float16 there: its bfloat16 dots are not the GPU's); skipped where
triton is not installed (the default CPU install)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from miles.kernels import decode_gemm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not decode_gemm.available(), reason="needs triton")
DTYPES = [torch.float32, torch.bfloat16] if DEVICE == "cuda" else [torch.float32, torch.float16]
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}


def _data(M: int, N: int, K: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(M * 1000 + N + K)
    x = torch.randn(M, K, generator=g)
    w = torch.randn(N, K, generator=g) / K ** 0.5
    r = torch.randn(M, N, generator=g)
    return (t.to(DEVICE, dtype) for t in (x, w, r))


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


# rows of 1, a partial row block and several; N and K off the block sizes too
SHAPES = [(1, 48, 256), (5, 96, 200), (64, 160, 512), (70, 40, 136)]
LAUNCHES = [None, (16, 16, 64, 1, 4, 2), (16, 16, 64, 4, 4, 2), (64, 32, 32, 8, 4, 3)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,N,K", SHAPES)
@pytest.mark.parametrize("launch", LAUNCHES)
def test_linear_and_residual_match_torch(dtype, M, N, K, launch) -> None:
    x, w, r = _data(M, N, K, dtype)
    for _ in range(2):  # the second call reuses the counters the first left at zero
        _close(decode_gemm.linear(x, w, launch=launch), F.linear(x, w), dtype)
        _close(decode_gemm.linear(x, w, residual=r, launch=launch), r + F.linear(x, w), dtype)


def test_split_sums_in_a_fixed_order() -> None:
    """Whichever program of a tile finishes last, it sums the partials in split order: two
    calls give the same bits."""
    x, w, r = _data(64, 64, 1024, torch.float32)
    a = decode_gemm.linear(x, w, residual=r, launch=(64, 16, 64, 8, 4, 3))
    b = decode_gemm.linear(x, w, residual=r, launch=(64, 16, 64, 8, 4, 3))
    assert torch.equal(a, b)


def test_default_launch_gives_many_programs() -> None:
    """The shapes of a 0.5B model's decode GEMMs get ~256 programs or more (the point of the
    split), and the split divides K into whole tiles."""
    for M, N, K in ((64, 4096, 1024), (64, 1024, 2048), (64, 6144, 1024), (64, 1024, 3072), (256, 1024, 3072)):
        bm, bn, bk, split, _, _ = decode_gemm.launch_for(M, N, K)
        programs = -(-N // bn) * -(-M // bm) * split
        assert programs >= 160, (M, N, K, programs)
        assert K % (split * bk) == 0


def test_strided_rows_are_read_in_place() -> None:
    """The engine passes views (a slice of a wider buffer's rows)."""
    x, w, _ = _data(8, 32, 96, torch.float32)
    view = x[:, 16:80]
    w = w[:, :64].contiguous()
    _close(decode_gemm.linear(view, w), F.linear(view, w), torch.float32)


def test_bad_shapes_are_refused() -> None:
    x, w, r = _data(4, 32, 64, torch.float32)
    with pytest.raises(ValueError, match="columns"):
        decode_gemm.linear(x[:, :32], w)
    with pytest.raises(ValueError, match="residual"):
        decode_gemm.linear(x, w, residual=r[:, :16])
    with pytest.raises(ValueError, match="contiguous"):
        decode_gemm.linear(x.t(), w)
