"""Skinny GEMMs for decode steps in Triton: split-K over many programs, reduced in-kernel.

Why: a decode step multiplies a few rows (M = the batch, 1-256) by each weight matrix, so a
GEMM is a read of its weights: a 0.5B model's layer reads 31 MB in four GEMMs. On the H200
cuBLAS ran them at ~34% of the copy bandwidth (5-6 µs each; profile_decode, 2026-12-01
06:19): its kernels for these shapes launch 64-128 programs on 132 SMs, too few reads in
flight to stream the weights, and the o projection's split-K adds a reduction launch.

Here each program reads a BLOCK_N × (K / SPLIT_K) slice of the weights, so the grid has
N / BLOCK_N × SPLIT_K programs (256-384 for those shapes). Each stores its float32 partial
product; the last program of an output tile to finish (an atomic counter per tile, acquire /
release ordered) sums the SPLIT_K partials in split order — a fixed order, so the result does
not depend on which program came last — adds the optional residual, rounds once, and resets
the counter for the next call. No reduction launch, no memset.

An earlier form (commit 2b0e53e) fused the RMSNorm and SiLU·up into the GEMM's operand loads
instead: 2-5x slower than Inductor's kernels plus cuBLAS (benchmarks/RESULTS.md,
decode_gemm, 2026-12-01 06:22), as the transformed operands broke the load pipelining.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU install has no triton
    triton = None

MAX_ROWS = 256  # decode steps only: larger M is a prefill, where cuBLAS is compute-bound and right


def available() -> bool:
    return triton is not None


def launch_for(M: int, N: int, K: int) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages) for an M × N × K decode
    GEMM: enough programs (~256) to keep the weights streaming on 132 SMs."""
    bm = 16 if M <= 16 else 32 if M <= 32 else 64
    bn = 32 if N >= 4096 else 16
    tiles = -(-N // bn) * -(-M // bm)
    split = 1
    while split < 8 and tiles * split * 2 <= 320 and K % (split * 2 * 64) == 0:
        split *= 2
    return (bm, bn, 64, split, 4, 4)


class _Scratch:
    """Per weight matrix: the partials' workspace and the tiles' counters (zeroed once; the
    last program of each tile resets its own). Keyed by the weight, so GEMMs of different
    matrices never share counters; steps of one engine run one after another on its stream."""

    def __init__(self) -> None:
        self.counters: dict[tuple, Tensor] = {}

    def get(self, weight: Tensor, tiles: int) -> Tensor:
        key = (weight.data_ptr(), weight.device, tiles)
        c = self.counters.get(key)
        if c is None:
            c = self.counters[key] = torch.zeros(tiles, device=weight.device, dtype=torch.int32)
        return c


_SCRATCH = _Scratch()


if triton is not None:

    @triton.jit
    def _linear(x_ptr, w_ptr, y_ptr, r_ptr, part_ptr, cnt_ptr, M, N, K, stride_x, stride_w, stride_y, stride_r,
                RESIDUAL: tl.constexpr, EXACT: tl.constexpr, SPLIT_K: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)  # the splits of one tile are adjacent in launch order
        pid_m = tl.program_id(2)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_ok = rm < M
        n_ok = rn < N
        span = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
        k_lo = pid_k * span
        k_hi = tl.minimum(k_lo + span, K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            k = k0 + rk
            k_ok = k < k_hi
            a = tl.load(x_ptr + rm[:, None] * stride_x + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w_ptr + rn[:, None] * stride_w + k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            if EXACT:  # float32 stays float32 (tl.dot would use tf32, torch does not)
                acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, tl.trans(b), acc)
        out_mask = m_ok[:, None] & n_ok[None, :]
        if SPLIT_K > 1:
            tile = pid_m * tl.num_programs(0) + pid_n
            part = part_ptr + rm[:, None] * N + rn[None, :]
            tl.store(part + pid_k * M * N, acc, mask=out_mask)
            # release: the partial above is visible before the count; acquire: the last one sees all
            done = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
            if done == SPLIT_K - 1:
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for s in range(SPLIT_K):  # split order: the same sum whichever program is last
                    acc += tl.load(part + s * M * N, mask=out_mask, other=0.0, cache_modifier=".cg")
                if RESIDUAL:
                    acc += tl.load(r_ptr + rm[:, None] * stride_r + rn[None, :], mask=out_mask,
                                   other=0.0).to(tl.float32)
                tl.store(y_ptr + rm[:, None] * stride_y + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=out_mask)
                tl.atomic_xchg(cnt_ptr + tile, 0)  # ready for the next call
        else:
            if RESIDUAL:
                acc += tl.load(r_ptr + rm[:, None] * stride_r + rn[None, :], mask=out_mask, other=0.0).to(tl.float32)
            tl.store(y_ptr + rm[:, None] * stride_y + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=out_mask)


def linear(x: Tensor, weight: Tensor, *, residual: Tensor | None = None,
           launch: tuple[int, int, int, int, int, int] | None = None) -> Tensor:
    """y = x · weightᵀ (+ residual, added before the one rounding) for x [M, K] and weight
    [N, K], both with contiguous rows, residual [M, N]. ``launch`` overrides
    (BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages)."""
    if x.dim() != 2 or weight.dim() != 2 or x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError(f"x and weight must be 2-D with contiguous rows; got {tuple(x.shape)}, {tuple(weight.shape)}")
    M, N, K = x.shape[0], weight.shape[0], weight.shape[1]
    if x.shape[1] != K:
        raise ValueError(f"x has {x.shape[1]} columns; the weight takes {K}")
    y = torch.empty(M, N, device=x.device, dtype=x.dtype)
    if residual is not None and (residual.shape != y.shape or residual.stride(-1) != 1):
        raise ValueError(f"residual must be {tuple(y.shape)} with contiguous rows; got {tuple(residual.shape)}")
    if M == 0:
        return y
    bm, bn, bk, split, warps, stages = launch or launch_for(M, N, K)
    grid = (triton.cdiv(N, bn), split, triton.cdiv(M, bm))
    part = torch.empty((split, M, N), device=x.device, dtype=torch.float32) if split > 1 else y
    counters = _SCRATCH.get(weight, grid[0] * grid[2]) if split > 1 else y
    r = residual if residual is not None else y
    _linear[grid](x, weight, y, r, part, counters, M, N, K, x.stride(0), weight.stride(0), y.stride(0), r.stride(0),
                  RESIDUAL=residual is not None, EXACT=x.dtype == torch.float32, SPLIT_K=split,
                  BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
    return y
