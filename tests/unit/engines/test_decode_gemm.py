"""The fused decode GEMMs (``miles.kernels.decode_gemm``) against the unfused torch forms they
replace: RMSNorm then linear, SiLU·up then linear, linear then residual. Runs on CUDA, or on
the CPU in triton's interpreter (float32 and float16 there: its bfloat16 dots are not the
GPU's); skipped where triton is not installed (the default CPU install)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from miles.kernels import decode_gemm
from miles.models.fused import rms_norm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not decode_gemm.available(), reason="needs triton")
DTYPES = [torch.float32, torch.bfloat16] if DEVICE == "cuda" else [torch.float32, torch.float16]
TOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def _data(M: int, N: int, K: int, dtype: torch.dtype, xk: int | None = None):
    g = torch.Generator().manual_seed(M * 1000 + N + K)
    x = torch.randn(M, xk or K, generator=g)
    w = torch.randn(N, K, generator=g) / K ** 0.5
    nw = torch.rand(K, generator=g) + 0.5
    r = torch.randn(M, N, generator=g)
    return (t.to(DEVICE, dtype) for t in (x, w, nw, r))


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


# rows of 1, a partial row block and several; N and K off the block sizes too
SHAPES = [(1, 48, 64), (5, 96, 200), (64, 160, 256), (70, 40, 136)]
LAUNCHES = [None, (16, 16, 64, 4, 2), (64, 32, 128, 4, 3)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,N,K", SHAPES)
@pytest.mark.parametrize("launch", LAUNCHES)
def test_norm_linear_is_rmsnorm_then_linear(dtype, M, N, K, launch) -> None:
    x, w, nw, _ = _data(M, N, K, dtype)
    _close(decode_gemm.linear(x, w, norm_weight=nw, eps=1e-6, launch=launch), F.linear(rms_norm(x, nw, 1e-6), w), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,N,K", SHAPES)
@pytest.mark.parametrize("launch", LAUNCHES)
def test_silu_up_residual_is_the_mlp_down_projection(dtype, M, N, K, launch) -> None:
    x, w, _, r = _data(M, N, K, dtype, xk=2 * K)
    gate, up = x.chunk(2, dim=-1)
    want = r + F.linear(F.silu(gate) * up, w)
    _close(decode_gemm.linear(x, w, silu_up=True, residual=r, launch=launch), want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,N,K", SHAPES)
def test_plain_and_residual_linear(dtype, M, N, K) -> None:
    x, w, _, r = _data(M, N, K, dtype)
    _close(decode_gemm.linear(x, w), F.linear(x, w), dtype)
    _close(decode_gemm.linear(x, w, residual=r), r + F.linear(x, w), dtype)


def test_strided_rows_are_read_in_place() -> None:
    """The engine passes views (the attention output's rows, a slice of a wider buffer)."""
    x, w, _, _ = _data(8, 32, 64, torch.float32, xk=96)
    view = x[:, 16:80]
    _close(decode_gemm.linear(view, w), F.linear(view, w), torch.float32)


def test_bad_shapes_are_refused() -> None:
    x, w, nw, r = _data(4, 32, 64, torch.float32)
    with pytest.raises(ValueError, match="columns"):
        decode_gemm.linear(x[:, :32], w)
    with pytest.raises(ValueError, match="columns"):
        decode_gemm.linear(x, w, silu_up=True)
    with pytest.raises(ValueError, match="exclusive"):
        decode_gemm.linear(x, w, norm_weight=nw, silu_up=True)
    with pytest.raises(ValueError, match="residual"):
        decode_gemm.linear(x, w, residual=r[:, :16])
    with pytest.raises(ValueError, match="contiguous"):
        decode_gemm.linear(x.t(), w)
