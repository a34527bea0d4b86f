"""Triton kernels behind ``lowp``'s decode-sized GEMMs (module-level, as ``gate_up``: absent
where triton is not installed).

- ``w4a16``: INT4 W4A16 for small M (decode, M ≤ 16). Decode is bound by weight bytes, so the
  kernel streams the packed weight once at the width the GPU reads best: each program owns
  ``BN`` output rows and walks K one quantization group at a time (``UNROLL`` groups per loop
  step, so several loads are in flight), each row's packed bytes contiguous. The packed layout
  stays the quantizer's (low nibble the even column), so the even and odd columns are two
  half-tiles multiplied by the even and odd activations: nothing is interleaved in registers.
  Each group's partial sums are ``Σ x·q`` in float32 (exact products of integers with the
  activations), scaled once per group and row. ``DOT`` picks the tensor-core form (``tl.dot``,
  rows padded to 16) or the CUDA-core form (broadcast multiply and sum, for one to four rows).
  ``ACC2D`` (CUDA-core form) keeps per-lane float32 sums over all groups and reduces across
  threads once at the end instead of once per group. ``split`` > 1 cuts K into that many slices written to a float32 buffer that ``sum_splits``
  adds in a fixed order: no atomics, so the result is deterministic.
- ``w4a16_gemv`` and ``w4a16_dott``: the same product read as int32 words (eight nibbles, the
  columns ``8·w … 8·w + 7`` of word ``w``: the packed layout's bytes in little-endian order), so
  each thread loads 16 contiguous bytes of a row. ``w4a16_gemv`` (one batch row a program)
  is CUDA-core only: each nibble plane ``i`` of a ``[BN, U, G/8]`` tile of words becomes
  ``q − 8`` with the mantissa trick, multiplied by the activations ``x[8·w + i]`` and summed per
  lane in float32 (scaled once per word and group), reduced across lanes once at the end.
  ``w4a16_dott`` puts the weights on the tensor cores' wide side: ``yᵀ [BN, BM] += s ·
  Σ_i q_i [BN, G/8] · xᵀ_i [G/8, BM]``, so the batch pads only to the dot's narrow side.
  Launch options measured per shape (``lowp.TUNED``): ``PF``, the next step's words loaded by
  hand before this step's arithmetic (Triton pipelines only loads that feed a dot);
  ``INPLACE`` (gemv), each nibble taken where it lies in the word, one shift a word; ``NIB16``
  2 (dott), the nibble ORed into bf16 128's mantissa and used biased, ``136·Σx`` taken off the
  float32 product once a group; ``SWAP`` (dott), the weights the dot's second operand; ``RED``,
  split-K's partials added by the last program of each tile (``_last_adds``), one launch.
- ``fp8_act_quant``: the quantizer's 1 × 128 activation groups in one kernel (amax, scale =
  max(amax · fl32(1/448), 1e-12), round-to-nearest-even e4m3 of ``x / scale``, an IEEE division),
  bit-identical to ``quantize.fp8_quantize_act``; scales written with any strides (cuBLAS wants
  them outer-major), rows past M written as zero groups (cuBLAS's row padding).
- ``fp8_gemm``: block-scaled FP8 GEMM, ``y = Σ_kblocks (a_q · b_qᵀ) · s_a · s_b`` with the
  scales applied per 128-K block in the float32 accumulation (DeepSeek-V3's recipe), split-K
  over a grid axis where the tiles alone leave SMs idle (float32 partials, ``sum_splits``). With
  ``FUSED`` the activation tile is quantized in the prologue from the bf16 input with the same
  arithmetic as ``fp8_act_quant`` (so the same values as the unfused path), and no quantized
  copy of the activations is written.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU install has no triton
    triton = None

if triton is not None:

    @triton.jit
    def _nibble(n, MAGIC: tl.constexpr, KIND: tl.constexpr):
        """A 4-bit field n (0..15, the stored q + 8) as q in the GEMM's dtype (KIND 0 float32,
        1 bf16, 2 fp16). MAGIC: n ORed into the mantissa of 2^23 (float32), 128 (bf16) or 1024
        (fp16), minus that plus 8: two integer ops and a subtraction, all exact, where an
        int-to-float conversion runs at a quarter of the rate of the FMA that follows."""
        if MAGIC:
            if KIND == 0:
                w = (n.to(tl.uint32) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
            elif KIND == 1:
                w = (n.to(tl.uint16) | 0x4300).to(tl.bfloat16, bitcast=True) - 136.0
            else:
                w = (n.to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True) - 1032.0
        else:
            w = n.to(tl.int32) - 8
        if KIND == 0:
            return w.to(tl.float32)
        elif KIND == 1:
            return w.to(tl.bfloat16)
        else:
            return w.to(tl.float16)

    @triton.jit
    def w4a16(x_ptr, w_ptr, s_ptr, y_ptr, M, N, k_per, sxm, swn, ssn, sys_, sym,
              G: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, UNROLL: tl.constexpr, DOT: tl.constexpr,
              MAGIC: tl.constexpr, KIND: tl.constexpr, ACC2D: tl.constexpr):
        pid_n, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        rj = tl.arange(0, G // 2)
        m_ok, n_ok = rm < M, rn < N
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        acc3 = tl.zeros((BM, BN, G // 2), dtype=tl.float32)
        k_lo = pid_k * k_per
        for k0 in range(k_lo, k_lo + k_per, G * UNROLL):
            for u in tl.static_range(UNROLL):
                kg = k0 + u * G
                p = tl.load(w_ptr + rn[:, None] * swn + (kg // 2 + rj)[None, :], mask=n_ok[:, None], other=0)
                lo = _nibble(p & 0xF, MAGIC, KIND)
                hi = _nibble(p >> 4, MAGIC, KIND)
                s = tl.load(s_ptr + rn * ssn + kg // G, mask=n_ok, other=0.0)
                xrow = x_ptr + rm[:, None] * sxm + (kg + 2 * rj)[None, :]
                xe = tl.load(xrow, mask=m_ok[:, None], other=0.0)
                xo = tl.load(xrow + 1, mask=m_ok[:, None], other=0.0)
                if DOT:
                    part = tl.dot(xe, tl.trans(lo)) + tl.dot(xo, tl.trans(hi))
                    acc += part * s[None, :]
                else:
                    prod = (xe.to(tl.float32)[:, None, :] * lo[None, :, :]
                            + xo.to(tl.float32)[:, None, :] * hi[None, :, :])
                    if ACC2D:  # each thread keeps its lanes' sums; one cross-thread reduction at the end
                        acc3 += prod * s[None, :, None]
                    else:
                        acc += tl.sum(prod, axis=2) * s[None, :]
        if ACC2D:
            acc = tl.sum(acc3, axis=2)
        tl.store(y_ptr + pid_k * sys_ + rm[:, None] * sym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _plane(p, i: tl.constexpr):
        """Nibble ``i`` of each int32 word (its column ``8·w + i``) as ``q − 8`` in float32."""
        return (((p >> (4 * i)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0

    @triton.jit
    def _half(p, i: tl.constexpr, KIND: tl.constexpr, NIB16: tl.constexpr):
        """Nibble ``i`` of each word in the dot's dtype (KIND 1 bf16, 2 fp16): ``q − 8`` (NIB16 0:
        by the float32 mantissa trick and a conversion; 1: by the 16-bit one), or (NIB16 2) the
        biased ``q + 8 + 128`` (bf16) / ``q + 8 + 1024`` (fp16) that the 16-bit trick gives
        before its subtraction, which the caller takes out of the product once (``_unbias``)."""
        if NIB16 == 2:
            if KIND == 1:
                return (((p >> (4 * i)) & 0xF) | 0x4300).to(tl.uint16).to(tl.bfloat16, bitcast=True)
            else:
                return (((p >> (4 * i)) & 0xF) | 0x6400).to(tl.uint16).to(tl.float16, bitcast=True)
        elif NIB16:
            return _nibble((p >> (4 * i)) & 0xF, True, KIND)
        elif KIND == 1:
            return _plane(p, i).to(tl.bfloat16)
        else:
            return _plane(p, i).to(tl.float16)

    @triton.jit
    def _last_adds(p_ptr, y_ptr, cnt_ptr, offs, mask, total):
        """Split-K's sum inside the GEMM: each program has stored its float32 partial (slice
        ``pid_k`` of ``p_ptr``); the last of a tile's programs to count itself in (a counter per
        tile, ``cnt_ptr``, zero between calls) adds the partials in slice order, as ``sum_splits``
        does, so the result is the same bits, and puts the counter back to zero. The barrier and
        the acq_rel atomic order every thread's partial before the count (CUTLASS's semaphore);
        the reads bypass L1."""
        tl.debug_barrier()
        tile = tl.program_id(0) + tl.program_id(2) * tl.num_programs(0)
        seen = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
        if seen == tl.num_programs(1) - 1:
            acc = tl.load(p_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg")
            for k in range(1, tl.num_programs(1)):
                acc += tl.load(p_ptr + k * total + offs, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(cnt_ptr + tile, 0)

    @triton.jit
    def _plane_at(p, i: tl.constexpr):
        """Nibble ``i`` (0..3) of each word's low 16 bits left in place, as ``(q − 8)·16^i`` in
        float32: the field ORed into 2^23's mantissa (one logic op, no shift), minus 2^23 + 8·16^i;
        exact, since (q + 8)·16^i < 2^16. The caller scales the activation by 16^-i instead."""
        if i == 0:
            return ((p & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
        elif i == 1:
            return ((p & 0xF0) | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0
        elif i == 2:
            return ((p & 0xF00) | 0x4B000000).to(tl.float32, bitcast=True) - 8390656.0
        else:
            return ((p & 0xF000) | 0x4B000000).to(tl.float32, bitcast=True) - 8421376.0

    @triton.jit
    def _gemv_words(p, xrow, sxp, INPLACE: tl.constexpr):
        """``Σ_i (q_i − 8)·x[8·w + i]`` per word of ``p`` [BN, U, W] in float32 (``xrow``: the
        activations at the columns 8·w, [U, W]; column 8·w + i at ``xrow + i·sxp``)."""
        if INPLACE:  # planes 0-3 of the word and of its upper half, each field left in place
            hi = p >> 16
            part = _plane_at(p, 0) * tl.load(xrow).to(tl.float32)[None, :, :]
            part += _plane_at(hi, 0) * tl.load(xrow + 4 * sxp).to(tl.float32)[None, :, :]
            for i in tl.static_range(1, 4):
                f = 1.0 / (1 << (4 * i))
                part += _plane_at(p, i) * (tl.load(xrow + i * sxp).to(tl.float32) * f)[None, :, :]
                part += _plane_at(hi, i) * (tl.load(xrow + (4 + i) * sxp).to(tl.float32) * f)[None, :, :]
        else:
            part = _plane(p, 0) * tl.load(xrow).to(tl.float32)[None, :, :]
            for i in tl.static_range(1, 8):
                part += _plane(p, i) * tl.load(xrow + i * sxp).to(tl.float32)[None, :, :]
        return part

    @triton.jit
    def w4a16_gemv(x_ptr, w_ptr, s_ptr, y_ptr, N, kw_per, sxm, sxw, sxp, swn, ssn, sys_, sym,
                   G: tl.constexpr, BN: tl.constexpr, U: tl.constexpr, PF: tl.constexpr = False,
                   INPLACE: tl.constexpr = False, out_ptr=None, cnt_ptr=None, RED: tl.constexpr = False):
        """Rows [pid_n·BN, +BN) of batch row pid_m over the words [pid_k·kw_per, +kw_per) of K
        (``w_ptr``: the packed weight as int32 words, ``swn`` in words). The activations are
        eight strided loads a word (cached); one 16-byte load a word expanded along a fourth
        axis measured twice as slow. The column 8·w + i of x is at ``w·sxw + i·sxp``: (8, 1) for
        x itself, (1, K/8) for its plane-major copy (``lowp._int4_words``'s ``XP``), where each
        plane's loads are contiguous. ``PF``: the next step's words and scales are loaded before
        this step's arithmetic (registers double-buffered by hand: the compiler pipelines only
        loads that feed a ``tl.dot``), so a program keeps a load in flight while it computes.
        ``INPLACE``: each nibble taken where it lies in the word (``_plane_at``), one shift a
        word instead of one a nibble."""
        pid_n, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        W: tl.constexpr = G // 8
        rn = pid_n * BN + tl.arange(0, BN)
        ru = tl.arange(0, U)
        rw = tl.arange(0, W)
        n_ok = rn < N
        acc = tl.zeros((BN, U, W), dtype=tl.float32)
        kw_lo = pid_k * kw_per
        ku = ru[:, None] * W + rw[None, :]  # [U, W]: a step's words along K
        w_row = w_ptr + rn[:, None, None] * swn
        s_row = s_ptr + rn[:, None] * ssn
        if PF:
            p_next = tl.load(w_row + (kw_lo + ku)[None, :, :], mask=n_ok[:, None, None], other=0)
            s_next = tl.load(s_row + (kw_lo // W + ru)[None, :], mask=n_ok[:, None], other=0.0)
        for kw0 in range(kw_lo, kw_lo + kw_per, W * U):
            if PF:
                p, s = p_next, s_next
                more = n_ok & (kw0 + W * U < kw_lo + kw_per)
                p_next = tl.load(w_row + (kw0 + W * U + ku)[None, :, :], mask=more[:, None, None], other=0)
                s_next = tl.load(s_row + ((kw0 + W * U) // W + ru)[None, :], mask=more[:, None], other=0.0)
            else:
                p = tl.load(w_row + (kw0 + ku)[None, :, :], mask=n_ok[:, None, None], other=0)
                s = tl.load(s_row + (kw0 // W + ru)[None, :], mask=n_ok[:, None], other=0.0)
            part = _gemv_words(p, x_ptr + pid_m * sxm + (kw0 + ku) * sxw, sxp, INPLACE)
            acc += part * s[:, :, None]
        y = tl.sum(tl.sum(acc, axis=2), axis=1)
        tl.store(y_ptr + pid_k * sys_ + pid_m * sym + rn, y.to(y_ptr.dtype.element_ty), mask=n_ok)
        if RED:
            _last_adds(y_ptr, out_ptr, cnt_ptr, pid_m * sym + rn, n_ok, sys_)

    @triton.jit
    def _dott_group(p, x_ptr, rm, m_ok, sxm, kw, G: tl.constexpr, KIND: tl.constexpr, JOIN: tl.constexpr,
                    NIB16: tl.constexpr, SWAP: tl.constexpr):
        """One group's ``Σ_k (q − 8)·x`` as a [BN, BM] float32 tile from its words ``p`` [BN, G/8]
        (the first at word ``kw``); with ``SWAP`` (and ``JOIN``) as [BM, BN], the activations the
        dot's first operand and the weights its second (read from shared memory by the MMA)."""
        W: tl.constexpr = G // 8
        rw = tl.arange(0, W)
        if JOIN:  # axes (a, b, c) of nibble 4a + 2b + c, joined innermost last: column 8w + i
            h = (_half(p, 0, KIND, NIB16), _half(p, 1, KIND, NIB16), _half(p, 2, KIND, NIB16),
                 _half(p, 3, KIND, NIB16), _half(p, 4, KIND, NIB16), _half(p, 5, KIND, NIB16),
                 _half(p, 6, KIND, NIB16), _half(p, 7, KIND, NIB16))
            t = tl.join(tl.join(tl.join(h[0], h[4]), tl.join(h[2], h[6])),
                        tl.join(tl.join(h[1], h[5]), tl.join(h[3], h[7])))
            rk = tl.arange(0, G)
            if SWAP:
                xr = tl.load(x_ptr + rm[:, None] * sxm + (kw * 8 + rk)[None, :], mask=m_ok[:, None], other=0.0)
                part = tl.dot(xr, tl.trans(tl.reshape(t, (p.shape[0], G))))
                if NIB16 == 2:
                    part = _unbias(part, tl.sum(xr.to(tl.float32), axis=1)[:, None], KIND)
            else:
                xt = tl.load(x_ptr + rm[None, :] * sxm + (kw * 8 + rk)[:, None], mask=m_ok[None, :], other=0.0)
                part = tl.dot(tl.reshape(t, (p.shape[0], G)), xt)
                if NIB16 == 2:
                    part = _unbias(part, tl.sum(xt.to(tl.float32), axis=0)[None, :], KIND)
        else:
            xcol = x_ptr + rm[None, :] * sxm + ((kw + rw) * 8)[:, None]  # [W, BM]: xᵀ at the columns 8·w
            x0 = tl.load(xcol, mask=m_ok[None, :], other=0.0)
            part = tl.dot(_half(p, 0, KIND, NIB16), x0)
            if NIB16 == 2:
                xs = tl.sum(x0.to(tl.float32), axis=0)
            for i in tl.static_range(1, 8):
                xi = tl.load(xcol + i, mask=m_ok[None, :], other=0.0)
                part = tl.dot(_half(p, i, KIND, NIB16), xi, part)
                if NIB16 == 2:
                    xs += tl.sum(xi.to(tl.float32), axis=0)
            if NIB16 == 2:
                part = _unbias(part, xs[None, :], KIND)
        return part

    @triton.jit
    def _unbias(part, xsum, KIND: tl.constexpr):
        """``part`` of ``_half``'s NIB16 2 operands less the bias they carry above ``q − 8``
        times the group's activation sums ``xsum`` (broadcast along the weight rows)."""
        if KIND == 1:
            return part - 136.0 * xsum
        else:
            return part - 1032.0 * xsum

    @triton.jit
    def _along_n(v, SWAP: tl.constexpr):
        """A per-weight-row vector broadcast against the tile (rows first, or columns with SWAP)."""
        if SWAP:
            return v[None, :]
        else:
            return v[:, None]

    @triton.jit
    def w4a16_dott(x_ptr, w_ptr, s_ptr, y_ptr, M, N, kw_per, sxm, swn, ssn, sys_, sym,
                   G: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, U: tl.constexpr, KIND: tl.constexpr,
                   JOIN: tl.constexpr, NIB16: tl.constexpr, PF: tl.constexpr = False, SWAP: tl.constexpr = False,
                   out_ptr=None, cnt_ptr=None, RED: tl.constexpr = False):
        """``yᵀ`` tile [BN, BM] (weight rows × batch rows) over the words [pid_k·kw_per, +kw_per).
        ``JOIN``: the eight nibble planes joined back into the group's column order, one dot of
        depth G against one contiguous ``xᵀ`` tile, instead of eight dots of depth G/8.
        ``NIB16``: how a nibble becomes the dot's operand (``_half``; which form the compiler
        does best is measured). With NIB16 2 the operand is ``q + 136`` (bf16), exact, and
        ``136·Σx`` per group comes off the float32 product: the dot's sums grow ~17×, still far
        below bf16 round-off. ``PF`` (one group a step): the next group's words and scales are
        loaded before this group's arithmetic, by hand, as ``w4a16_gemv`` does. ``SWAP``
        (with ``JOIN``): the tile is ``y`` [BM, BN], the weights the dot's second operand."""
        pid_n, pid_k, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        W: tl.constexpr = G // 8
        rn = pid_n * BN + tl.arange(0, BN)
        rm = pid_m * BM + tl.arange(0, BM)
        rw = tl.arange(0, W)
        n_ok, m_ok = rn < N, rm < M
        acc = tl.zeros((BM, BN) if SWAP else (BN, BM), dtype=tl.float32)
        kw_lo = pid_k * kw_per
        w_row = w_ptr + rn[:, None] * swn
        if PF:
            p_next = tl.load(w_row + (kw_lo + rw)[None, :], mask=n_ok[:, None], other=0)
            s_next = tl.load(s_ptr + rn * ssn + kw_lo // W, mask=n_ok, other=0.0)
            for kw in range(kw_lo, kw_lo + kw_per, W):
                p, s = p_next, s_next
                more = n_ok & (kw + W < kw_lo + kw_per)
                p_next = tl.load(w_row + (kw + W + rw)[None, :], mask=more[:, None], other=0)
                s_next = tl.load(s_ptr + rn * ssn + (kw + W) // W, mask=more, other=0.0)
                acc += _dott_group(p, x_ptr, rm, m_ok, sxm, kw, G, KIND, JOIN, NIB16, SWAP) * _along_n(s, SWAP)
        else:
            for kw0 in range(kw_lo, kw_lo + kw_per, W * U):
                for u in tl.static_range(U):
                    kw = kw0 + u * W
                    p = tl.load(w_row + (kw + rw)[None, :], mask=n_ok[:, None], other=0)
                    s = tl.load(s_ptr + rn * ssn + kw // W, mask=n_ok, other=0.0)
                    acc += _dott_group(p, x_ptr, rm, m_ok, sxm, kw, G, KIND, JOIN, NIB16, SWAP) * _along_n(s, SWAP)
        if SWAP:
            offs, ok = rm[:, None] * sym + rn[None, :], m_ok[:, None] & n_ok[None, :]
        else:
            offs, ok = rm[None, :] * sym + rn[:, None], n_ok[:, None] & m_ok[None, :]
        tl.store(y_ptr + pid_k * sys_ + offs, acc.to(y_ptr.dtype.element_ty), mask=ok)
        if RED:
            _last_adds(y_ptr, out_ptr, cnt_ptr, offs, ok, sys_)

    @triton.jit
    def sum_splits(p_ptr, y_ptr, total, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < total
        acc = tl.load(p_ptr + offs, mask=ok, other=0.0)
        for i in tl.static_range(1, SPLIT):
            acc += tl.load(p_ptr + i * total + offs, mask=ok, other=0.0)
        tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _quant_tile(x, FP8_MAX: tl.constexpr):
        """x: float32 [R, 128] → (e4m3 values, float32 scale per row), the quantizer's arithmetic."""
        amax = tl.max(tl.abs(x), axis=1)
        scale = tl.maximum(amax * (1.0 / FP8_MAX), 1e-12)
        q = tl.math.div_rn(x, tl.broadcast_to(scale[:, None], x.shape))
        q = tl.minimum(tl.maximum(q, -FP8_MAX), FP8_MAX)
        return q.to(tl.float8e4nv, fp_downcast_rounding="rtne"), scale

    @triton.jit
    def fp8_act_quant(x_ptr, q_ptr, s_ptr, M, R, K, sxm, sqm, ssm, ssg,
                      BR: tl.constexpr, GB: tl.constexpr, FP8_MAX: tl.constexpr):
        """Rows [pid_r·BR, +BR) × group pid_g of x [M, K] into R ≥ M rows: rows ≥ M (padding)
        quantize zeros."""
        pid_r, pid_g = tl.program_id(0), tl.program_id(1)
        rr = pid_r * BR + tl.arange(0, BR)
        rk = pid_g * GB + tl.arange(0, GB)
        k_ok = rk < K
        x = tl.load(x_ptr + rr[:, None] * sxm + rk[None, :], mask=(rr[:, None] < M) & k_ok[None, :], other=0.0)
        q, scale = _quant_tile(x.to(tl.float32), FP8_MAX)
        tl.store(q_ptr + rr[:, None] * sqm + rk[None, :], q, mask=(rr[:, None] < R) & k_ok[None, :])
        tl.store(s_ptr + rr * ssm + pid_g * ssg, scale, mask=rr < R)

    @triton.jit
    def fp8_gemm(x_ptr, a_ptr, as_ptr, b_ptr, bs_ptr, y_ptr, M, N, K, k_per, sxm, sam, sasm, sasg, sbn, sbsn, sbsk,
                 sym, sys_, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, FUSED: tl.constexpr,
                 FP8_MAX: tl.constexpr):
        """Tile (pid_m, pid_n) over the K slice [pid_k·k_per, +k_per) (split-K: each slice's
        float32 partial at ``y_ptr + pid_k·sys_``, added by ``sum_splits``)."""
        pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        m_ok, n_ok = rm < M, rn < N
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(pid_k * k_per, tl.minimum(pid_k * k_per + k_per, K), BK):
            k_ok = (k0 + rk) < K
            if FUSED:
                x = tl.load(x_ptr + rm[:, None] * sxm + (k0 + rk)[None, :], mask=m_ok[:, None] & k_ok[None, :],
                            other=0.0)
                a, sa = _quant_tile(x.to(tl.float32), FP8_MAX)
            else:
                a = tl.load(a_ptr + rm[:, None] * sam + (k0 + rk)[None, :], mask=m_ok[:, None] & k_ok[None, :],
                            other=0.0)
                sa = tl.load(as_ptr + rm * sasm + (k0 // BK) * sasg, mask=m_ok, other=0.0)
            b = tl.load(b_ptr + rn[:, None] * sbn + (k0 + rk)[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            sb = tl.load(bs_ptr + (rn // BK) * sbsn + (k0 // BK) * sbsk, mask=n_ok, other=0.0)
            acc += tl.dot(a, tl.trans(b)) * (sa[:, None] * sb[None, :])
        tl.store(y_ptr + pid_k * sys_ + rm[:, None] * sym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])
