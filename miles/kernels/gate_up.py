"""The MLP's gate/up projection and SiLU·up in one Triton GEMM, for small decode batches.

Why: at decode sizes a kernel costs mostly its launch, ramp and tail (a 4-13 MB cuBLAS GEMM
took 5-7 µs whatever its bytes on the H200, benchmarks/RESULTS.md, decode_gemm), and a decode
layer runs the gate/up GEMM and then a kernel of its own for ``silu(gate) * up`` (1.9 µs a
layer at batch 64, 2026-12-02 00:11). Here each program computes a tile of the gate columns
and the same tile of the up columns (two dots on one A tile) and writes ``silu(gate) * up``
from registers: one launch, and half the output written.

``x`` [M, K] and the fused ``w`` [2I, K] (gate rows, then up rows: ``MLP.gate_up``) in one
dtype; returns [M, I]. The gate and up sums are rounded to ``x``'s dtype before the SiLU, as
the unfused path's GEMM output is, so the two differ only by the GEMMs' summation order.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU install has no triton
    triton = None

from miles.kernels.decode_attention import available  # the same rule: CUDA, or the interpreter

__all__ = ["LAUNCH", "available", "gate_up_silu", "supports"]

LAUNCH = (64, 32, 128, 4, 4)  # (BM, BN, BK, warps, stages): a first guess, before a sweep


def supports(x: Tensor, w: Tensor, block_k: int, block_n: int) -> bool:
    """Shapes this kernel takes: K a multiple of the K tile, I of the N tile."""
    return x.shape[1] % block_k == 0 and (w.shape[0] // 2) % block_n == 0 and w.shape[1] == x.shape[1]


def gate_up_silu(x: Tensor, w: Tensor, launch: tuple[int, int, int, int, int] | None = None) -> Tensor:
    BM, BN, BK, warps, stages = launch or LAUNCH
    M, K = x.shape
    I = w.shape[0] // 2
    if not supports(x, w, BK, BN):
        raise ValueError(f"gate_up_silu: K {K} must be a multiple of {BK} and I {I} of {BN}")
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError("gate_up_silu: x and w need unit stride along K")
    out = torch.empty((M, I), device=x.device, dtype=x.dtype)
    if M == 0:
        return out
    grid = (I // BN, triton.cdiv(M, BM))
    _gate_up_silu[grid](x, w, out, M, K, I, x.stride(0), w.stride(0), out.stride(0),
                        BM=BM, BN=BN, BK=BK, EXACT=x.dtype == torch.float32, num_warps=warps, num_stages=stages)
    return out


if triton is not None:

    @triton.jit(do_not_specialize=["M"])
    def _gate_up_silu(x_ptr, w_ptr, out_ptr, M, K, I, sx, sw, so,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EXACT: tl.constexpr):
        pn = tl.program_id(0)
        pm = tl.program_id(1)
        rm = pm * BM + tl.arange(0, BM)
        rn = pn * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        live = rm < M
        a_ptr = x_ptr + rm[:, None] * sx + rk[None, :]
        g_ptr = w_ptr + rn[:, None] * sw + rk[None, :]
        u_ptr = w_ptr + (I + rn)[:, None] * sw + rk[None, :]
        acc_g = tl.zeros((BM, BN), tl.float32)
        acc_u = tl.zeros((BM, BN), tl.float32)
        for _ in range(0, K, BK):
            a = tl.load(a_ptr, mask=live[:, None], other=0.0)
            if EXACT:  # float32: no tf32 rounding of the operands
                acc_g = tl.dot(a, tl.trans(tl.load(g_ptr)), acc_g, input_precision="ieee")
                acc_u = tl.dot(a, tl.trans(tl.load(u_ptr)), acc_u, input_precision="ieee")
            else:
                acc_g = tl.dot(a, tl.trans(tl.load(g_ptr)), acc_g)
                acc_u = tl.dot(a, tl.trans(tl.load(u_ptr)), acc_u)
            a_ptr += BK
            g_ptr += BK
            u_ptr += BK
        dtype = out_ptr.dtype.element_ty
        gate = acc_g.to(dtype).to(tl.float32)  # the GEMM's output, as the unfused path rounds it
        up = acc_u.to(dtype).to(tl.float32)
        y = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32) * up  # F.silu(gate) in the dtype, times up
        tl.store(out_ptr + rm[:, None] * so + rn[None, :], y.to(dtype), mask=live[:, None])
