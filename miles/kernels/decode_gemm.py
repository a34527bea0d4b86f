"""Skinny GEMMs for decode steps in Triton, with the layer's elementwise work fused in.

Why: a decode step multiplies a few rows (M = the batch, 1-256) by each weight matrix, so a
GEMM is a read of its weights; a 0.5B model's layer reads 31 MB of them in four GEMMs. On
the H200 cuBLAS ran those at ~33% of the copy bandwidth (profile_decode, 2026-11-30 17:29),
and the RMSNorm, SiLU·up and residual kernels between them cost a launch each, ~2-3 µs of
mostly latency: a batch-64 step sat at 43% of its memory roofline (engine, 2026-12-01 03:16).
``linear`` folds that elementwise work into the GEMM's loads and stores:

- ``norm_weight``: y = RMSNorm(x) · Wᵀ. The row's sum of squares is gathered while x streams
  through the K loop (every program reads all of K anyway), x is scaled by the norm weight
  as it is loaded, and the row's 1/rms scales the accumulator at the end.
- ``silu_up``: x holds [gate | up] (K = half its width); the GEMM's operand is
  silu(gate) · up, computed as it is loaded (the MLP's down projection).
- ``residual``: y = residual + x · Wᵀ, added before the one rounding to the output dtype
  (the o and down projections).

One program computes a BLOCK_M × BLOCK_N tile over all of K (no split-K: a split would need a
reduction launch, which is what this removes). Programs that share weight columns are
adjacent in the grid, so at M > BLOCK_M the weights come from L2 after the first read.

Numerics: float32 accumulation as cuBLAS; the fused forms round once where the unfused ones
round twice (the normed or gated operand is not rounded to bf16 before the weight product
and the residual is added to the float32 accumulator), so results differ from the unfused
path in bf16's last bits: not bitwise, as no GEMM of another shape is (CONSISTENCY.md).
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU install has no triton
    triton = None

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) by (rows bucket, N): benchmarks/decode_gemm.py
DEFAULT_LAUNCH = (64, 32, 128, 4, 4)


def available() -> bool:
    return triton is not None


def launch_for(M: int, N: int, K: int) -> tuple[int, int, int, int, int]:
    """The launch for an M × N × K decode GEMM: BLOCK_M covers the rows up to 64; BLOCK_N is
    chosen so that the grid has at least ~128 programs (the H200 has 132 SMs) where N allows."""
    bm = 16 if M <= 16 else 32 if M <= 32 else 64
    bn = 64 if N >= 64 * 128 else 32 if N >= 32 * 128 else 16
    return (bm, bn, 128, 4, 4)


if triton is not None:

    @triton.jit
    def _linear(x_ptr, w_ptr, y_ptr, nw_ptr, r_ptr, M, N, K, stride_x, stride_w, stride_y, stride_r, eps,
                NORM: tl.constexpr, SILU: tl.constexpr, RESIDUAL: tl.constexpr, EXACT: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_m = tl.program_id(0)  # rows fastest: the programs of one weight tile run together
        pid_n = tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_ok = rm < M
        n_ok = rn < N
        x_rows = x_ptr + rm[:, None] * stride_x
        w_rows = w_ptr + rn[:, None] * stride_w
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        sumsq = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + rk
            k_ok = k < K
            a_mask = m_ok[:, None] & k_ok[None, :]
            if SILU:
                gate = tl.load(x_rows + k[None, :], mask=a_mask, other=0.0).to(tl.float32)
                up = tl.load(x_rows + K + k[None, :], mask=a_mask, other=0.0).to(tl.float32)
                a = (gate / (1.0 + tl.exp(-gate)) * up).to(w_ptr.dtype.element_ty)
            elif NORM:
                xa = tl.load(x_rows + k[None, :], mask=a_mask, other=0.0).to(tl.float32)
                sumsq += tl.sum(xa * xa, axis=1)
                nw = tl.load(nw_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
                a = (xa * nw[None, :]).to(w_ptr.dtype.element_ty)
            else:
                a = tl.load(x_rows + k[None, :], mask=a_mask, other=0.0)
            b = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            if EXACT:  # float32 stays float32 (tl.dot would use tf32, torch does not)
                acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, tl.trans(b), acc)
        if NORM:
            acc = acc * tl.rsqrt(sumsq / K + eps)[:, None]
        out_mask = m_ok[:, None] & n_ok[None, :]
        if RESIDUAL:
            acc += tl.load(r_ptr + rm[:, None] * stride_r + rn[None, :], mask=out_mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + rm[:, None] * stride_y + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=out_mask)


def linear(x: Tensor, weight: Tensor, *, norm_weight: Tensor | None = None, eps: float = 1e-6,
           silu_up: bool = False, residual: Tensor | None = None,
           launch: tuple[int, int, int, int, int] | None = None) -> Tensor:
    """y = op(x) · weightᵀ (+ residual) for x [M, K'] (rows contiguous), weight [N, K].

    ``norm_weight``: op = RMSNorm with that weight and ``eps``; ``silu_up``: x is [M, 2K] and
    op(x) = silu(x[:, :K]) · x[:, K:]; neither: op = identity. ``residual`` [M, N] is added
    before rounding. ``launch`` overrides (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages)."""
    if norm_weight is not None and silu_up:
        raise ValueError("norm_weight and silu_up are exclusive")
    if x.dim() != 2 or weight.dim() != 2 or x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError(f"x and weight must be 2-D with contiguous rows; got {tuple(x.shape)}, {tuple(weight.shape)}")
    M, N, K = x.shape[0], weight.shape[0], weight.shape[1]
    if x.shape[1] != (2 * K if silu_up else K):
        raise ValueError(f"x has {x.shape[1]} columns; the weight takes {K}{' (×2 for silu_up)' if silu_up else ''}")
    y = torch.empty(M, N, device=x.device, dtype=x.dtype)
    if residual is not None and (residual.shape != y.shape or residual.stride(-1) != 1):
        raise ValueError(f"residual must be {tuple(y.shape)} with contiguous rows; got {tuple(residual.shape)}")
    bm, bn, bk, warps, stages = launch or launch_for(M, N, K)
    grid = (triton.cdiv(M, bm), triton.cdiv(N, bn))
    nw = norm_weight if norm_weight is not None else weight
    r = residual if residual is not None else y
    _linear[grid](x, weight, y, nw, r, M, N, K, x.stride(0), weight.stride(0), y.stride(0), r.stride(0), eps,
                  NORM=norm_weight is not None, SILU=silu_up, RESIDUAL=residual is not None,
                  EXACT=x.dtype == torch.float32,
                  BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
    return y

