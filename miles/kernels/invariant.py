"""Batch-invariant Triton kernels for ``--true-on-policy`` on CUDA (bf16, float32 accumulation).

Each kernel computes an output row from that row's inputs alone, with one compiled
configuration for every shape, so a row's bits do not depend on how many rows share the
launch, where in a tile the row lands, or which path (decode over a cache, prefill, the
trainer's causal forward) called it:

- ``matmul``: y = x·Wᵀ (+ b) with one tile configuration (``GEMM``) for all M, no split-K:
  each output element sums its K tiles in order, one ``tl.dot`` per tile, from M = 1 (decode)
  to M = thousands (the trainer). cuBLAS picks its kernel, tiling and split-K by shape.
- ``attention``: a query's softmax and weighted sum of V run over keys in fixed chunks of
  ``ATTN_BLOCK_N`` positions from key 0, an online softmax whose chunks past the query's last
  visible key are exact identities (their weights are 0, the rescale 1). Rows are (GQA group
  head, query) pairs of one KV head, so a decode step reads each KV head once.
- ``rms_norm``, ``logsumexp`` / ``log_softmax``, ``softmax``: one program per row, one
  reduction tree fixed by the row length. torch's CUDA reductions pick their split of a row
  across threads and blocks by the number of rows.

The kernels are forward-only; ``miles.models.invariant`` wraps them for autograd.
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

__all__ = ["ATTN_BLOCK_M", "ATTN_BLOCK_N", "GEMM", "attention", "available", "log_softmax", "logsumexp", "matmul",
           "rms_norm", "softmax"]

GEMM = (64, 128, 64, 4, 4)  # (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages): the one tiling of every GEMM
ATTN_BLOCK_M, ATTN_BLOCK_N, ATTN_WARPS, ATTN_STAGES = 64, 64, 4, 2
ROW_WARPS = 4
LSE_BLOCK = 2048  # logits per step of a row's log-sum-exp

if triton is not None:

    @triton.jit
    def _matmul(a, b, c, bias, M, N, K, sam, sak, sbn, sbk, scm, scn,
                HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        a_ptr = a + rm[:, None].to(tl.int64) * sam + rk[None, :] * sak
        b_ptr = b + rn[None, :].to(tl.int64) * sbn + rk[:, None] * sbk
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            a_t = tl.load(a_ptr, mask=(rm[:, None] < M) & (rk[None, :] + k0 < K), other=0.0)
            b_t = tl.load(b_ptr, mask=(rn[None, :] < N) & (rk[:, None] + k0 < K), other=0.0)
            acc = tl.dot(a_t, b_t, acc)
            a_ptr += BK * sak
            b_ptr += BK * sbk
        if HAS_BIAS:
            acc += tl.load(bias + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(c + rm[:, None].to(tl.int64) * scm + rn[None, :] * scn, acc.to(c.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))

    @triton.jit
    def _attention(q, k, v, o, mask, nkeys, S, R, Q, G, sm_scale,
                   sqb, sqh, sqt, skb, skh, sks, svb, svh, svs, sob, soh, sot, smb, smh, smt, sms,
                   snb, snh, snt, D: tl.constexpr, HAS_MASK: tl.constexpr, BM: tl.constexpr,
                   BN: tl.constexpr):
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        r = tl.program_id(2) * BM + tl.arange(0, BM)  # rows: (group head g, query t) of this KV head
        live = r < R
        g = r // Q
        t = r % Q
        h = kvh * G + g
        d = tl.arange(0, D)
        qrow = b.to(tl.int64) * sqb + h.to(tl.int64) * sqh + t.to(tl.int64) * sqt
        qt = tl.load(q + qrow[:, None] + d[None, :], mask=live[:, None], other=0.0)
        n_row = tl.load(nkeys + b.to(tl.int64) * snb + h * snh + t * snt, mask=live, other=0)
        hi = tl.minimum(tl.max(n_row, 0), S)
        m_i = tl.full((BM,), float("-inf"), tl.float32)
        l_i = tl.zeros((BM,), tl.float32)
        acc = tl.zeros((BM, D), tl.float32)
        kbase = k + b.to(tl.int64) * skb + kvh.to(tl.int64) * skh
        vbase = v + b.to(tl.int64) * svb + kvh.to(tl.int64) * svh
        mrow = b.to(tl.int64) * smb + h.to(tl.int64) * smh + t.to(tl.int64) * smt
        scale = sm_scale * 1.4426950408889634
        for n0 in range(0, hi, BN):
            n = n0 + tl.arange(0, BN)
            inside = n < hi  # past the tile's last visible key nothing is read: a cache's stale slots stay out
            kt = tl.load(kbase + n[None, :].to(tl.int64) * sks + d[:, None], mask=inside[None, :], other=0.0)
            s = tl.dot(qt, kt) * scale
            ok = (n[None, :] < n_row[:, None]) & inside[None, :] & live[:, None]
            if HAS_MASK:
                ok = ok & (tl.load(mask + mrow[:, None] + n[None, :].to(tl.int64) * sms,
                                   mask=inside[None, :] & live[:, None], other=0) != 0)
            s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_use[:, None])
            alpha = tl.exp2(m_i - m_use)
            l_i = l_i * alpha + tl.sum(p, 1)
            vt = tl.load(vbase + n[:, None].to(tl.int64) * svs + d[None, :], mask=inside[:, None], other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt)
            m_i = m_new
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        orow = b.to(tl.int64) * sob + h.to(tl.int64) * soh + t.to(tl.int64) * sot
        tl.store(o + orow[:, None] + d[None, :], out.to(o.dtype.element_ty), mask=live[:, None])

    @triton.jit
    def _rms_norm(x, w, y, D, eps, sx, sy, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, BLOCK)
        inside = c < D
        xv = tl.load(x + row * sx + c, mask=inside, other=0.0).to(tl.float32)
        r = 1.0 / tl.sqrt(tl.sum(xv * xv, 0) / D + eps)
        normed = (xv * r).to(y.dtype.element_ty).to(tl.float32)
        wv = tl.load(w + c, mask=inside, other=0.0).to(y.dtype.element_ty).to(tl.float32)
        tl.store(y + row * sy + c, (wv * normed).to(y.dtype.element_ty), mask=inside)

    @triton.jit
    def _lse(x, out, V, sx, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, BLOCK)
        m = tl.full((BLOCK,), float("-inf"), tl.float32)
        for v0 in range(0, V, BLOCK):
            m = tl.maximum(m, tl.load(x + row * sx + v0 + c, mask=v0 + c < V, other=float("-inf")).to(tl.float32))
        top = tl.max(m, 0)
        top_use = tl.where(top == float("-inf"), 0.0, top)
        acc = tl.zeros((BLOCK,), tl.float32)
        for v0 in range(0, V, BLOCK):
            xv = tl.load(x + row * sx + v0 + c, mask=v0 + c < V, other=float("-inf")).to(tl.float32)
            acc += tl.exp(xv - top_use)
        tl.store(out + row, top_use + tl.log(tl.sum(acc, 0)))

    @triton.jit
    def _softmax(x, y, V, sx, sy, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, BLOCK)
        xv = tl.load(x + row * sx + c, mask=c < V, other=float("-inf")).to(tl.float32)
        e = tl.exp(xv - tl.max(xv, 0))
        tl.store(y + row * sy + c, (e / tl.sum(e, 0)).to(y.dtype.element_ty), mask=c < V)


def matmul(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x`` [..., K] · ``weight`` [N, K]ᵀ (+ ``bias``) in ``x``'s dtype; ``weight`` must be in it."""
    K = x.shape[-1]
    if weight.shape[-1] != K:
        raise ValueError(f"matmul: input width {K} != weight width {weight.shape[-1]}")
    a = x.reshape(-1, K)
    M, N = a.shape[0], weight.shape[0]
    c = torch.empty((M, N), device=x.device, dtype=x.dtype)
    if M and N:
        BM, BN, BK, warps, stages = GEMM
        _matmul[(triton.cdiv(N, BN), triton.cdiv(M, BM))](
            a, weight, c, bias if bias is not None else c, M, N, K, a.stride(0), a.stride(1), weight.stride(0),
            weight.stride(1), c.stride(0), c.stride(1), HAS_BIAS=bias is not None, BM=BM, BN=BN, BK=BK,
            num_warps=warps, num_stages=stages)
    return c.view(*x.shape[:-1], N)


def attention(q: Tensor, k: Tensor, v: Tensor, nkeys: Tensor, mask: Tensor | None = None,
              scale: float | None = None) -> Tensor:
    """Queries [B, H, Q, D] over keys and values [B, Hkv, S, D] (H a multiple of Hkv; any
    strides with a unit last one): query (b, h, t) sees keys ``j < nkeys[b, h, t]`` (nkeys
    broadcastable to [B, H, Q], int32) and, with ``mask`` (bool, broadcastable to
    [B, H, Q, S]), only those where it is True. Key j sits at index j of every row."""
    B, H, Q, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    if H % Hkv or D & (D - 1) or D < 16:
        raise ValueError(f"attention: {H} heads over {Hkv} KV heads, head dim {D} (a power of two >= 16)")
    G = H // Hkv
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    o = torch.empty((B, H, Q, D), device=q.device, dtype=q.dtype)
    n = nkeys.to(torch.int32).expand(B, H, Q)
    if mask is not None:
        mask = mask.expand(B, H, Q, S)
        if mask.dtype != torch.bool:
            raise ValueError("attention: mask must be bool")
        m, ms = mask.view(torch.uint8), mask.stride()
    else:
        m, ms = n, (0, 0, 0, 0)
    R = G * Q
    grid = (B, Hkv, triton.cdiv(R, ATTN_BLOCK_M))
    if B and R:
        _attention[grid](q, k, v, o, m, n, S, R, Q, G, D ** -0.5 if scale is None else scale,
                         *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3], *ms, *n.stride(),
                         D=D, HAS_MASK=mask is not None, BM=ATTN_BLOCK_M, BN=ATTN_BLOCK_N, num_warps=ATTN_WARPS,
                         num_stages=ATTN_STAGES)
    return o


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """transformers' RMSNorm in ``x``'s dtype: float32 statistics, normalised x rounded to x's
    dtype, times the weight rounded to it (``miles.models.fused.rms_norm``'s arithmetic)."""
    D = x.shape[-1]
    a = x.reshape(-1, D)
    if a.stride(-1) != 1:
        a = a.contiguous()
    y = torch.empty(a.shape, device=x.device, dtype=x.dtype)
    if a.shape[0]:
        _rms_norm[(a.shape[0],)](a, weight, y, D, eps, a.stride(0), y.stride(0), BLOCK=triton.next_power_of_2(D),
                                 num_warps=ROW_WARPS)
    return y.view(x.shape)


def logsumexp(x: Tensor) -> Tensor:
    """log Σ exp over the last dimension, in float32: [..., V] → [...]."""
    V = x.shape[-1]
    a = x.reshape(-1, V)
    if a.stride(-1) != 1:
        a = a.contiguous()
    out = torch.empty(a.shape[0], device=x.device, dtype=torch.float32)
    if a.shape[0]:
        _lse[(a.shape[0],)](a, out, V, a.stride(0), BLOCK=min(LSE_BLOCK, triton.next_power_of_2(V)),
                            num_warps=ROW_WARPS)
    return out.view(x.shape[:-1])


def log_softmax(x: Tensor) -> Tensor:
    """``x - logsumexp(x)`` over the last dimension, in float32: the log-prob of token j is
    ``x[j] - lse`` however it is taken (the engine's gather, the trainer's log-softmax)."""
    x = x.float()
    return x - logsumexp(x)[..., None]


def softmax(x: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """Softmax over the last dimension (at most 65536 entries), in ``dtype`` (default x's)."""
    V = x.shape[-1]
    a = x.reshape(-1, V)
    if a.stride(-1) != 1:
        a = a.contiguous()
    y = torch.empty(a.shape, device=x.device, dtype=dtype or x.dtype)
    if a.shape[0]:
        _softmax[(a.shape[0],)](a, y, V, a.stride(0), y.stride(0), BLOCK=triton.next_power_of_2(V),
                                num_warps=ROW_WARPS)
    return y.view(x.shape)


def causal_nkeys(Q: int, S: int, device: torch.device) -> Tensor:
    """nkeys [1, 1, Q] of causal attention whose Q queries are the last of S keys."""
    return torch.arange(S - Q + 1, S + 1, device=device, dtype=torch.int32)[None, None]


def mask_nkeys(mask: Tensor) -> Tensor:
    """The smallest nkeys a bool mask [..., S] allows: one past its last True key (0 if none)."""
    S = mask.shape[-1]
    idx = torch.arange(1, S + 1, device=mask.device, dtype=torch.int32)
    return (mask.to(torch.int32) * idx).amax(-1).to(torch.int32)

