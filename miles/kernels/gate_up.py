"""The MLP's gate/up projection and SiLU·up in one Triton GEMM, for small decode batches.

Why: at decode sizes a kernel costs mostly its launch, ramp and tail, whatever its bytes, and
a decode layer runs the gate/up GEMM and then a kernel of its own for ``silu(gate) * up``.
Here each program computes a tile of the gate columns
and the same tile of the up columns (two dots on one A tile) and writes ``silu(gate) * up``
from registers: one launch, and half the output written.

``x`` [M, K] and the fused ``w`` [2I, K] (gate rows, then up rows: ``MLP.gate_up``) in one
dtype; returns [M, I]. The gate and up sums are rounded to ``x``'s dtype before the SiLU, as
the unfused path's GEMM output is, so the two differ only by the GEMMs' summation order.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU install has no triton
    triton = None

from miles.kernels.decode_attention import available  # the same rule: CUDA, or the interpreter

__all__ = ["MIN_ROWS", "available", "default_launch", "failure", "gate_up_silu"]

# (BM, BN, BK, warps, stages) by the batch's rows: the fastest launches that
# benchmarks/decode_mlp.py finds for a Qwen3-0.6B-sized MLP on Hopper, each faster than cuBLAS
# and the SiLU·up kernel at its batch sizes.
LAUNCHES = ((64, (64, 32, 128, 4, 4)), (128, (64, 64, 64, 4, 5)), (1 << 62, (64, 64, 64, 4, 4)))
# Decode steps of fewer rows keep cuBLAS and the SiLU·up kernel (the runner's rule): at batch 1
# the fused kernel loses to them, from 8 rows up it wins (benchmarks/decode_mlp.py).
MIN_ROWS = 8


def default_launch(rows: int) -> tuple[int, int, int, int, int]:
    return next(launch for top, launch in LAUNCHES if rows <= top)


def gate_up_silu(x: Tensor, w: Tensor, launch: tuple[int, int, int, int, int] | None = None) -> Tensor:
    """``silu(x @ w[:I].T) * (x @ w[I:].T)`` for ``x`` [M, K] and ``w`` [2I, K], as [M, I]."""
    M, K = x.shape
    BM, BN, BK, warps, stages = launch or default_launch(M)
    if w.dim() != 2 or w.shape[1] != K or w.shape[0] % 2:
        raise ValueError(f"gate_up_silu: w must be [2I, {K}], got {tuple(w.shape)}")
    if x.stride(1) != 1 or w.stride(1) != 1:
        raise ValueError("gate_up_silu: x and w need unit stride along K")
    I = w.shape[0] // 2
    out = torch.empty((M, I), device=x.device, dtype=x.dtype)
    if M == 0:
        return out
    grid = (triton.cdiv(I, BN), triton.cdiv(M, BM))
    _gate_up_silu[grid](x, w, out, M, K, I, x.stride(0), w.stride(0), out.stride(0),
                        BM=BM, BN=BN, BK=BK, EVEN=K % BK == 0 and I % BN == 0, EXACT=x.dtype == torch.float32,
                        num_warps=warps, num_stages=stages)
    return out


@functools.lru_cache(maxsize=None)
def failure(device: str, dtype: torch.dtype) -> str | None:
    """Why the kernel cannot serve decode steps on ``device`` in ``dtype``, or None: beyond
    triton and a CUDA device, one small launch (which also compiles it) must match torch's
    GEMMs, once per (device, dtype), so a GPU whose triton miscompiles it keeps the two-launch
    path."""
    if triton is None or torch.device(device).type != "cuda":
        return f"needs triton and a CUDA device (device {device!r})"
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(5, 96, generator=g).to(device, dtype)
        w = (torch.randn(2 * 80, 96, generator=g) / 8).to(device, dtype)  # tails in K and I
        gate, up = torch.nn.functional.linear(x, w).float().chunk(2, dim=-1)
        want = torch.nn.functional.silu(gate) * up
        got = gate_up_silu(x, w, (16, 32, 64, 4, 2)).float()
        tol = 1e-4 if dtype == torch.float32 else 5e-2
        ok = bool(torch.allclose(got, want, atol=tol, rtol=tol))
    except Exception as exc:  # noqa: BLE001 - any failure means: not here
        return f"failed to run: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    return None if ok else "disagreed with torch's GEMMs"


if triton is not None:

    @triton.jit(do_not_specialize=["M"])
    def _gate_up_silu(x_ptr, w_ptr, out_ptr, M, K, I, sx, sw, so,
                      BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN: tl.constexpr,
                      EXACT: tl.constexpr):
        pn = tl.program_id(0)
        pm = tl.program_id(1)
        rm = pm * BM + tl.arange(0, BM)
        rn = pn * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        live = rm < M
        cols = rn < I
        a_ptr = x_ptr + rm[:, None] * sx + rk[None, :]
        g_ptr = w_ptr + rn[:, None] * sw + rk[None, :]
        u_ptr = w_ptr + (I + rn)[:, None] * sw + rk[None, :]
        acc_g = tl.zeros((BM, BN), tl.float32)
        acc_u = tl.zeros((BM, BN), tl.float32)
        for k0 in range(0, K, BK):
            if EVEN:  # the shapes the engine meets: whole tiles, no masks on the weights
                a = tl.load(a_ptr, mask=live[:, None], other=0.0)
                wg = tl.load(g_ptr)
                wu = tl.load(u_ptr)
            else:
                ks = (k0 + rk) < K
                a = tl.load(a_ptr, mask=live[:, None] & ks[None, :], other=0.0)
                wg = tl.load(g_ptr, mask=cols[:, None] & ks[None, :], other=0.0)
                wu = tl.load(u_ptr, mask=cols[:, None] & ks[None, :], other=0.0)
            if EXACT:  # float32: no tf32 rounding of the operands
                acc_g = tl.dot(a, tl.trans(wg), acc_g, input_precision="ieee")
                acc_u = tl.dot(a, tl.trans(wu), acc_u, input_precision="ieee")
            else:
                acc_g = tl.dot(a, tl.trans(wg), acc_g)
                acc_u = tl.dot(a, tl.trans(wu), acc_u)
            a_ptr += BK
            g_ptr += BK
            u_ptr += BK
        dtype = out_ptr.dtype.element_ty
        gate = acc_g.to(dtype).to(tl.float32)  # the GEMM's output, as the unfused path rounds it
        up = acc_u.to(dtype).to(tl.float32)
        y = (gate * tl.sigmoid(gate)).to(dtype).to(tl.float32) * up  # F.silu(gate) in the dtype, times up
        tl.store(out_ptr + rm[:, None] * so + rn[None, :], y.to(dtype), mask=live[:, None] & cols[None, :])
