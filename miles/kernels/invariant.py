"""Batch-invariant Triton kernels for ``--true-on-policy`` on CUDA (bf16, float32 accumulation).

Each kernel computes an output row from that row's inputs alone, summing in an order that
the reduction's length fixes, never the shape of the call, so a row's bits do not depend on
how many rows share the launch, where in a tile the row lands, or which path (decode over a
cache, prefill, the trainer's causal forward) called it:

- ``matmul``: y = x·Wᵀ (+ b), no split-K: each output element sums its K tiles of ``BLOCK_K``
  in order, one accumulating ``tl.dot`` per tile, from M = 1 (decode) to M = thousands (the
  trainer). cuBLAS picks its kernel, tiling and split-K by shape. The M × N tile and the warps
  only decide which program computes an element, not the order of its sum, so on CUDA they are
  picked by shape (``gemm_config``: enough programs to fill the GPU); every candidate gives
  the same bits as every other (``tests/gpu/test_true_on_policy_gpu.py`` checks it).
  Elsewhere (triton's interpreter, whose ``tl.dot`` is numpy's, on float32 tiles: its bf16 dot is broken)
  one tiling serves all shapes.
- ``attention``: a query's softmax and weighted sum of V run over keys in fixed chunks of
  ``ATTN_BLOCK_N`` positions from key 0, an online softmax whose chunks past the query's last
  visible key are exact identities (their weights are 0, the rescale 1). Rows are (GQA group
  head, query) pairs of one KV head, so a decode step reads each KV head once. Every sum is an
  accumulating ``tl.dot`` (P·V into the rescaled accumulator, and the softmax's denominator as
  P·1): a ``tl.sum`` over a tile reduces in an order set by the tile's register layout, which
  the compiler picks by tile size and by the code around it (a mask load changed it). So the
  row tile (and the warps) can follow the call on CUDA: 16 rows for decode's few, 64 otherwise.
  A query is bounded by its key count (``nkeys``); a bool ``mask`` compiles another kernel,
  whose bits can differ from the bounded one's for the same visible keys, so the mode's
  engine (decode, verify) and trainer (causal, right-padded) all pass key counts.
- ``rms_norm``, ``logsumexp`` / ``log_softmax``, ``softmax``: one program per row, one
  reduction tree fixed by the row length (``logsumexp`` in one pass over the row, an online
  maximum per lane). torch's CUDA reductions pick their split of a row across threads and
  blocks by the number of rows.
- ``qk_norm_rope``: a layer's q/k-norms and RoPE from the qkv projection in one launch, with
  eager torch's roundings (the norm as ``rms_norm``, each RoPE product and their sum rounded to
  the model's dtype, as bf16 tensor ops round): bitwise the unfused ops the trainer runs, in
  place of the nine launches a decode layer made of them.
- ``silu_mul``: SiLU·up with eager torch's roundings (libdevice's ``expf`` and an IEEE
  division, as torch's CUDA SiLU computes, then the product), one launch for torch's two;
  ``matmul(..., residual=h)`` adds the residual stream in the GEMM's epilogue, rounded as
  ``h + linear(x, w)`` is. A decode layer makes four launches fewer.
- ``kv_write``: a decode step's new K and V into each row's cache position, one launch. It
  computes nothing; it replaces two advanced-index writes, which under
  ``torch.use_deterministic_algorithms`` (the mode's) sort their indices every layer.

Where a kernel rounds an intermediate to bf16 as torch would (``rms_norm``, ``qk_norm_rope``,
``silu_mul``, the residual add) it rounds with integer operations (``_rne``): triton folds
``x.to(bf16).to(float32)`` away and contracts the products around it into FMAs, so a cast pair
does not round.

The kernels are forward-only; ``miles.models.invariant`` wraps them for autograd.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # the CPU install has no triton
    triton = None

from miles.kernels.decode_attention import available  # the same rule: CUDA, or the interpreter

__all__ = ["ATTN_BLOCK_M", "ATTN_BLOCK_N", "CUDA_GEMMS", "GEMM", "attention", "available", "gemm_config", "kv_write",
           "log_softmax", "logsumexp", "matmul", "qk_norm_rope", "rms_norm", "silu_mul", "softmax"]

GEMM = (64, 128, 64, 4, 4)  # (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages): the tiling off CUDA
BLOCK_K = GEMM[2]  # the reduction tile: fixed for every GEMM on every device
# CUDA's candidates, largest tile first; each has BLOCK_K, so all give the same bits
CUDA_GEMMS = ((128, 128, BLOCK_K, 8, 3), (64, 128, BLOCK_K, 4, 4), (64, 64, BLOCK_K, 4, 4), (64, 32, BLOCK_K, 4, 4),
              (16, 32, BLOCK_K, 4, 4), (16, 16, BLOCK_K, 2, 4))
ATTN_BLOCK_M, ATTN_BLOCK_N, ATTN_WARPS, ATTN_STAGES = 64, 64, 4, 2
ATTN_DECODE_BLOCK_M = 16  # CUDA's row tile where a call has at most this many rows per KV head
ATTN_DECODE_WARPS = 2  # and its warps: the fastest for decode's few rows (every count gives the same bits)
ROW_WARPS = 4
LSE_BLOCK, LSE_WARPS = 4096, 8  # logits per step of a row's log-sum-exp

if triton is not None:

    @triton.jit
    def _matmul(a, b, c, bias, res, M, N, K, sam, sak, sbn, sbk, scm, scn, srm, srn,
                HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, BF16: tl.constexpr, BM: tl.constexpr,
                BN: tl.constexpr, BK: tl.constexpr, UPCAST: tl.constexpr):
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
            acc = tl.dot(_up(a_t, UPCAST), _up(b_t, UPCAST), acc)
            a_ptr += BK * sak
            b_ptr += BK * sbk
        if HAS_BIAS:
            acc += tl.load(bias + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        inside = (rm[:, None] < M) & (rn[None, :] < N)
        acc = _rne(acc, BF16)  # CUDA's cast rounds so too; the interpreter's would truncate
        if HAS_RES:  # the residual add, as torch's: the GEMM's output rounded, plus h, rounded
            h = tl.load(res + rm[:, None].to(tl.int64) * srm + rn[None, :] * srn, mask=inside, other=0.0)
            acc = _rne(acc + h.to(tl.float32), BF16)
        tl.store(c + rm[:, None].to(tl.int64) * scm + rn[None, :] * scn, acc.to(c.dtype.element_ty), mask=inside)

    @triton.jit
    def _attention(q, k, v, o, mask, nkeys, S, R, Q, G, sm_scale,
                   sqb, sqh, sqt, skb, skh, sks, svb, svh, svs, sob, soh, sot, smb, smh, smt, sms,
                   snb, snh, snt, D: tl.constexpr, HAS_MASK: tl.constexpr, BM: tl.constexpr,
                   BN: tl.constexpr, UPCAST: tl.constexpr):
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
        l_acc = tl.zeros((BM, 16), tl.float32)  # the denominator, 16 equal columns of P·1
        acc = tl.zeros((BM, D), tl.float32)
        kbase = k + b.to(tl.int64) * skb + kvh.to(tl.int64) * skh
        vbase = v + b.to(tl.int64) * svb + kvh.to(tl.int64) * svh
        mrow = b.to(tl.int64) * smb + h.to(tl.int64) * smh + t.to(tl.int64) * smt
        scale = sm_scale * 1.4426950408889634
        for n0 in range(0, hi, BN):
            n = n0 + tl.arange(0, BN)
            inside = n < hi  # past the tile's last visible key nothing is read: a cache's stale slots stay out
            kt = tl.load(kbase + n[None, :].to(tl.int64) * sks + d[:, None], mask=inside[None, :], other=0.0)
            s = tl.dot(_up(qt, UPCAST), _up(kt, UPCAST)) * scale
            ok = (n[None, :] < n_row[:, None]) & inside[None, :] & live[:, None]
            if HAS_MASK:
                ok = ok & (tl.load(mask + mrow[:, None] + n[None, :].to(tl.int64) * sms,
                                   mask=inside[None, :] & live[:, None], other=0) != 0)
            s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp2(s - m_use[:, None])
            alpha = tl.exp2(m_i - m_use)
            vt = tl.load(vbase + n[:, None].to(tl.int64) * svs + d[None, :], mask=inside[:, None], other=0.0)
            pv = p.to(vt.dtype)
            acc = tl.dot(_up(pv, UPCAST), _up(vt, UPCAST), acc * alpha[:, None])
            ones = (tl.zeros((BN, 16), tl.float32) + 1.0).to(vt.dtype)
            l_acc = tl.dot(_up(pv, UPCAST), _up(ones, UPCAST), l_acc * alpha[:, None])
            m_i = m_new
        l_i = tl.max(l_acc, 1)
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        orow = b.to(tl.int64) * sob + h.to(tl.int64) * soh + t.to(tl.int64) * sot
        tl.store(o + orow[:, None] + d[None, :], out.to(o.dtype.element_ty), mask=live[:, None])

    @triton.jit
    def _kv_write(kc, vc, k, v, pos, skb, skh, sks, svb, svh, svs, sxb, sxh, syb, syh, D: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        p = tl.load(pos + b).to(tl.int64)
        d = tl.arange(0, D)
        tl.store(kc + b * skb + h * skh + p * sks + d, tl.load(k + b * sxb + h * sxh + d))
        tl.store(vc + b * svb + h * svh + p * svs + d, tl.load(v + b * syb + h * syh + d))

    @triton.jit
    def _up(t, UPCAST: tl.constexpr):
        """``t`` as float32 for a ``tl.dot`` under triton's interpreter, whose bf16 dot is not a
        product at all (its values come out ~1e10); on CUDA ``t`` as it is."""
        if UPCAST:
            t = t.to(tl.float32)
        return t

    @triton.jit
    def _rne(v, BF16: tl.constexpr):
        """float32 ``v`` rounded to the nearest bf16 (ties to even), as float32, when BF16:
        torch's rounding, in integer operations that the compiler keeps."""
        if BF16:
            bits = v.to(tl.int32, bitcast=True)
            bits = (bits + (((bits >> 16) & 1) + 0x7FFF)) & -65536
            v = bits.to(tl.float32, bitcast=True)
        return v

    @triton.jit
    def _inv_rms(xv, D, eps):
        """1 / RMS of a row (float32, zeros past its D entries)."""
        return 1.0 / tl.sqrt(tl.sum(xv * xv, 0) / D + eps)

    @triton.jit
    def _normed(xv, r, wv, BF16: tl.constexpr):
        """RMSNorm's output entries: x·r rounded, times the weight rounded, rounded."""
        return _rne(_rne(wv, BF16) * _rne(xv * r, BF16), BF16)

    @triton.jit
    def _rms_norm(x, w, y, D, eps, sx, sy, BLOCK: tl.constexpr, BF16: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, BLOCK)
        inside = c < D
        xv = tl.load(x + row * sx + c, mask=inside, other=0.0).to(tl.float32)
        wv = tl.load(w + c, mask=inside, other=0.0).to(tl.float32)
        tl.store(y + row * sy + c, _normed(xv, _inv_rms(xv, D, eps), wv, BF16).to(y.dtype.element_ty), mask=inside)

    @triton.jit
    def _qk_norm_rope(x, qn, kn, cos, sin, y, H, T, eps, sx, sy, scb, sct, ssb, sst, NORM: tl.constexpr,
                      D: tl.constexpr, BF16: tl.constexpr):
        row = tl.program_id(0)  # token b * T + t
        h = tl.program_id(1)  # head: H query heads, then the KV heads
        b, t = row // T, row % T
        d = tl.arange(0, D)
        rolled = (d + D // 2) % D  # torch.roll(x, D / 2)[d]
        src = x + row.to(tl.int64) * sx + h * D
        xv = tl.load(src + d).to(tl.float32)
        xr = tl.load(src + rolled).to(tl.float32)
        if NORM:  # _rms_norm's arithmetic, for the element and its rolled partner
            w = qn if h < H else kn
            r = _inv_rms(xv, D, eps)
            xv = _normed(xv, r, tl.load(w + d).to(tl.float32), BF16)
            xr = _normed(xr, r, tl.load(w + rolled).to(tl.float32), BF16)
        c = _rne(tl.load(cos + b.to(tl.int64) * scb + t.to(tl.int64) * sct + d).to(tl.float32), BF16)
        sn = _rne(tl.load(sin + b.to(tl.int64) * ssb + t.to(tl.int64) * sst + d).to(tl.float32), BF16)
        out = _rne(_rne(xv * c, BF16) + _rne(xr * sn, BF16), BF16)
        tl.store(y + row.to(tl.int64) * sy + h * D + d, out.to(y.dtype.element_ty))

    @triton.jit
    def _silu_mul(x, y, I, sx, sy, BLOCK: tl.constexpr, BF16: tl.constexpr, PRECISE: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = c < I
        g = tl.load(x + row * sx + c, mask=inside, other=0.0).to(tl.float32)
        u = tl.load(x + row * sx + I + c, mask=inside, other=0.0).to(tl.float32)
        if PRECISE:  # torch's CUDA silu: x / (1 + expf(-x)), libdevice's expf and an IEEE division
            e = libdevice.exp(-g)
        else:  # triton's interpreter has no libdevice
            e = tl.exp(-g)
        s = tl.math.div_rn(g, 1.0 + e)
        tl.store(y + row * sy + c, _rne(_rne(s, BF16) * u, BF16).to(y.dtype.element_ty), mask=inside)

    @triton.jit
    def _lse(x, out, V, sx, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, BLOCK)
        m = tl.full((BLOCK,), float("-inf"), tl.float32)  # each lane's running maximum and its sum
        acc = tl.zeros((BLOCK,), tl.float32)
        for v0 in range(0, V, BLOCK):
            xv = tl.load(x + row * sx + v0 + c, mask=v0 + c < V, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, xv)
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            acc = acc * tl.exp(m - m_use) + tl.exp(xv - m_use)
            m = m_new
        top = tl.max(m, 0)
        top_use = tl.where(top == float("-inf"), 0.0, top)
        tl.store(out + row, top_use + tl.log(tl.sum(acc * tl.exp(m - top_use), 0)))

    @triton.jit
    def _softmax(x, y, V, sx, sy, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, BLOCK)
        xv = tl.load(x + row * sx + c, mask=c < V, other=float("-inf")).to(tl.float32)
        e = tl.exp(xv - tl.max(xv, 0))
        tl.store(y + row * sy + c, (e / tl.sum(e, 0)).to(y.dtype.element_ty), mask=c < V)


_SMS: dict[int, int] = {}  # streaming multiprocessors per CUDA device index


def gemm_config(M: int, N: int, device: torch.device) -> tuple[int, int, int, int, int]:
    """The tiling of an M × N GEMM: off CUDA ``GEMM``; on CUDA the largest ``CUDA_GEMMS`` tile no
    taller than M needs (at least 16 rows) that still makes one program per multiprocessor."""
    if device.type != "cuda":
        return GEMM
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SMS:
        _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    rows = max(16, triton.next_power_of_2(M))
    fits = [c for c in CUDA_GEMMS if c[0] <= rows]
    for cfg in fits:
        if triton.cdiv(M, cfg[0]) * triton.cdiv(N, cfg[1]) >= _SMS[idx]:
            return cfg
    return fits[-1]


def matmul(x: Tensor, weight: Tensor, bias: Tensor | None = None,
           config: tuple[int, int, int, int, int] | None = None, residual: Tensor | None = None) -> Tensor:
    """``x`` [..., K] · ``weight`` [N, K]ᵀ (+ ``bias``) in ``x``'s dtype; ``weight`` must be in it.
    ``residual`` [..., N] (x's dtype): ``residual + matmul(x, weight, bias)`` with torch's two
    roundings, in the GEMM's epilogue (a decode layer's two residual adds are launches of their
    own otherwise). ``config`` overrides ``gemm_config`` (the tests' check that every tiling agrees)."""
    K = x.shape[-1]
    if weight.shape[-1] != K:
        raise ValueError(f"matmul: input width {K} != weight width {weight.shape[-1]}")
    a = x.reshape(-1, K)
    M, N = a.shape[0], weight.shape[0]
    r = None
    if residual is not None:
        if residual.shape[:-1] != x.shape[:-1] or residual.shape[-1] != N or residual.dtype != x.dtype:
            raise ValueError(f"matmul: residual {tuple(residual.shape)} {residual.dtype} for an output of "
                             f"{(*x.shape[:-1], N)} {x.dtype}")
        r = residual.reshape(M, N)
    c = torch.empty((M, N), device=x.device, dtype=x.dtype)
    if M and N:
        BM, BN, BK, warps, stages = config or gemm_config(M, N, x.device)
        if BK != BLOCK_K:
            raise ValueError(f"matmul: the reduction tile is {BLOCK_K} on every device, not {BK}")
        _matmul[(triton.cdiv(N, BN), triton.cdiv(M, BM))](
            a, weight, c, bias if bias is not None else c, r if r is not None else c, M, N, K, a.stride(0),
            a.stride(1), weight.stride(0), weight.stride(1), c.stride(0), c.stride(1),
            *(r.stride() if r is not None else (0, 0)), HAS_BIAS=bias is not None, HAS_RES=r is not None,
            BF16=x.dtype == torch.bfloat16, BM=BM, BN=BN, BK=BK, UPCAST=x.device.type != "cuda", num_warps=warps,
            num_stages=stages)
    return c.view(*x.shape[:-1], N)


def silu_mul(gate_up: Tensor) -> Tensor:
    """``F.silu(gate) * up`` of ``gate_up`` [..., 2·I] (gate then up), in its dtype with eager
    torch's roundings (SiLU in float32 rounded, the product rounded): one launch for the two."""
    I2 = gate_up.shape[-1]
    if I2 % 2 or gate_up.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"silu_mul: width {I2} in {gate_up.dtype} (even, float32 or bf16)")
    a = gate_up.reshape(-1, I2)
    if a.stride(-1) != 1:
        a = a.contiguous()
    I = I2 // 2
    y = torch.empty((a.shape[0], I), device=a.device, dtype=a.dtype)
    if a.shape[0] and I:
        block = min(1024, triton.next_power_of_2(I))
        _silu_mul[(a.shape[0], triton.cdiv(I, block))](a, y, I, a.stride(0), y.stride(0), BLOCK=block,
                                                      BF16=a.dtype == torch.bfloat16,
                                                      PRECISE=a.device.type == "cuda", num_warps=ROW_WARPS)
    return y.view(*gate_up.shape[:-1], I)


def attention(q: Tensor, k: Tensor, v: Tensor, nkeys: Tensor, mask: Tensor | None = None,
              scale: float | None = None, block_m: int | None = None) -> Tensor:
    """Queries [B, H, Q, D] over keys and values [B, Hkv, S, D] (H a multiple of Hkv; any
    strides with a unit last one): query (b, h, t) sees keys ``j < nkeys[b, h, t]`` (nkeys
    broadcastable to [B, H, Q], int32) and, with ``mask`` (bool, broadcastable to
    [B, H, Q, S]), only those where it is True. Key j sits at index j of every row.
    ``block_m`` overrides the row tile (the tests' check that every tile agrees)."""
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
    BM = block_m or (ATTN_DECODE_BLOCK_M if q.device.type == "cuda" and R <= ATTN_DECODE_BLOCK_M else ATTN_BLOCK_M)
    grid = (B, Hkv, triton.cdiv(R, BM))
    if B and R:
        _attention[grid](q, k, v, o, m, n, S, R, Q, G, D ** -0.5 if scale is None else scale,
                         *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *o.stride()[:3], *ms, *n.stride(),
                         D=D, HAS_MASK=mask is not None, BM=BM, BN=ATTN_BLOCK_N, UPCAST=q.device.type != "cuda",
                         num_warps=ATTN_DECODE_WARPS if BM == ATTN_DECODE_BLOCK_M else ATTN_WARPS,
                         num_stages=ATTN_STAGES)
    return o


def qk_norm_rope(qkv: Tensor, H: int, KV: int, q_norm: Tensor | None, k_norm: Tensor | None, eps: float,
                 cos: Tensor, sin: Tensor) -> Tensor:
    """q/k-norms (when given) and RoPE of the qkv projection [B, T, (H + 2·KV)·D] (rows with a
    unit last stride): returns [B, T, H + KV, D], q's heads then k's, in qkv's dtype (float32 or
    bf16), bitwise ``fused.rope_qk(rms_norm(q), rms_norm(k), cos, sin)``. ``cos`` / ``sin`` (the
    signed sin of ``Rotary``): [B or 1, 1, T, D] with a unit last stride."""
    B, T, width = qkv.shape
    D = width // (H + 2 * KV)
    if (D * (H + 2 * KV) != width or D & (D - 1) or qkv.stride(-1) != 1 or (q_norm is None) != (k_norm is None)
            or qkv.dtype not in (torch.float32, torch.bfloat16)):
        raise ValueError(f"qk_norm_rope: width {width} over {H}+2x{KV} heads in {qkv.dtype} (float32 or bf16, a "
                         f"power-of-two head dim, unit stride, both norms or none)")
    rows = qkv.reshape(B * T, width)
    y = torch.empty((B, T, H + KV, D), device=qkv.device, dtype=qkv.dtype)
    cb, sb = (cos.stride(0) if cos.shape[0] > 1 else 0), (sin.stride(0) if sin.shape[0] > 1 else 0)
    if B * T:
        _qk_norm_rope[(B * T, H + KV)](rows, q_norm if q_norm is not None else rows,
                                       k_norm if k_norm is not None else rows, cos, sin, y, H, T, eps,
                                       rows.stride(0), (H + KV) * D, cb, cos.stride(2), sb, sin.stride(2),
                                       NORM=q_norm is not None, D=D, BF16=qkv.dtype == torch.bfloat16,
                                       num_warps=ROW_WARPS)
    return y


def kv_write(k_cache: Tensor, v_cache: Tensor, k: Tensor, v: Tensor, positions: Tensor) -> None:
    """``k_cache[b, :, positions[b]] = k[b]`` and the same for V, for rows b < n: caches
    [slots, KV, S, D] (unit last stride, the new entries' dtype), k and v [n, KV, D]."""
    n, KV, D = k.shape
    if v.shape != k.shape or k_cache.dtype != k.dtype or v_cache.dtype != v.dtype or D & (D - 1):
        raise ValueError(f"kv_write: K {tuple(k.shape)} {k.dtype}, V {tuple(v.shape)} {v.dtype} into caches of "
                         f"{k_cache.dtype} / {v_cache.dtype} (head dim a power of two)")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("kv_write: the caches' head dim must be contiguous")
    k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (k, v))
    if n:
        _kv_write[(n, KV)](k_cache, v_cache, k, v, positions, *k_cache.stride()[:3], *v_cache.stride()[:3],
                           *k.stride()[:2], *v.stride()[:2], D=D, num_warps=1)


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
                                 BF16=x.dtype == torch.bfloat16, num_warps=ROW_WARPS)
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
                            num_warps=LSE_WARPS)
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

