"""Length-aware decode attention in Triton (flash-decoding over the slot KV cache).

Why: torch's decode attention (``matmul`` or ``sdpa`` in ``miles.engines.kv_cache``) reads
every row of a batch up to the batch's longest context, because the shapes must be
rectangular. In RL's long-tailed batches one 2048-token row pads the reads of hundreds of
short ones: at batch 256 on a 0.5B model that padded read is ~60 GB a step against 1.2 GB
of weights. This kernel reads each row only up to its own length, so the work tracks the
useful KV positions whatever the batch's shape, and its launch shape depends only on the
batch size and the cache length: one CUDA graph per batch bucket serves every context.

Two launches per layer:

1. ``_partial``: grid (rows, KV heads, chunks of ``CHUNK`` positions). A program whose
   chunk starts past its row's length does nothing; the others run an online softmax over
   their chunk for the whole GQA group of one KV head (the group is the query axis of one
   ``tl.dot``) and store the chunk's running max, denominator and weighted sum (float32).
   Given the decode step's new K/V (``new_kv``), the programs read the cache only before
   the row's last position, and the one whose chunk holds that position writes the new K/V
   there and adds the new token to its softmax from registers after its loop (so the write
   and the reads need no ordering, and the loop is the same as without a write; swapping the
   new K/V into the loop's tiles with ``tl.where`` instead slows the loop). That is the cache
   write of a decode step without a launch of its own: the two index_put kernels it replaces
   are pure launch latency for their few kilobytes, a visible share of a small model's step.
2. ``_merge``: grid (rows, KV heads): merges the row's valid chunks exactly. A row whose
   context fits one chunk has no partials to merge: its ``_partial`` program normalises and
   stores the output itself, and the merge programs of such rows return at once (most rows
   of short-context batches fit one chunk: 256 positions in narrow grids, 1024 in wide ones).
   A grid of one chunk launches no merge.

The same kernel serves a speculative verify step (several new tokens per row, causal among
them): each query row's own limit masks the keys it may not see. A step with more than
``MAX_ROWS`` query rows per KV head (GQA group × new tokens) launches in slices, so tiles
and shared memory stay bounded. The number of new tokens and the group size are runtime
arguments: a speculative engine meets many of them, and each would otherwise compile anew.

On long-tailed batches it beats the padded sdpa CUDA graphs by the padding it does not read,
and on uniform lengths too (``benchmarks/long_tail_decode.py``, ``benchmarks/engine.py``).

An 8-bit cache's V comes stored transposed (``KVCache.positions_last``), and its dots run in
float16 (``F16_DOTS``). Why: position-major 8-bit V is the PV dot's operand along its
positions, and sm_90 has no transposing shared-memory load for 8-bit tiles, so it was
gathered a byte at a time, which left the issue-bound 8-bit loop no faster than bf16's;
transposed, with float16 dots, 8-bit V is read like K (``benchmarks/decode_attention.py``
compares the cache forms).

Each row's result depends only on its own query and cache (fixed chunking, fixed order):
the kernel is batch-invariant. Used by ``DecodeAttention`` when ``decode_attention`` is
``"triton"`` (CUDA; on the CPU only under ``TRITON_INTERPRET=1``, which the tests use).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import NamedTuple

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU install has no triton; available() says so
    triton = None

log = logging.getLogger(__name__)

CHUNK = 256  # positions per partial program, in grids of fewer than WIDE rows × KV heads
BLOCK_N = 64  # positions per inner iteration
WIDE = 128
# (CHUNK, BLOCK_N, num_warps, num_stages) by the cache's element size (16/32-bit, 8-bit), for
# wide grids and narrow ones (float32 q always runs unpipelined, see _launch), the fastest
# that benchmarks/decode_attention.py finds on Hopper. Wide grids take 1024-position chunks:
# fewer, longer programs read at a higher rate, and a row of at most 1024 positions is one
# chunk with no merge launch, for bf16 and 8-bit caches alike. Narrow grids keep
# 256-position chunks, so a few rows still spread over the SMs. The 8-bit form pipelines
# three stages, the best balance of its two batch sizes.
LAUNCH = {2: (1024, 64, 4, 2), 1: (1024, 64, 4, 3)}
NARROW = {2: (CHUNK, BLOCK_N, 4, 3), 1: (CHUNK, 32, 4, 3)}
MAX_ROWS = 64  # query rows per KV head in one launch (G × tokens; wider steps launch in slices)
# Dots over an 8-bit cache in float16 where q is bfloat16: the cache's values convert to float16
# exactly (``F2FP`` unpacks two a time), where bfloat16 tiles cost one more conversion an element
# (benchmarks/kernel_registers.py counts them). q
# saturates to float16's range (±65504) and P (in [0, 1]) keeps 3 more bits than in bfloat16.
F16_DOTS = True


def available(device: torch.device | str) -> bool:
    """True where the kernel can run: CUDA with triton, or the CPU under triton's
    interpreter (``TRITON_INTERPRET=1``, tests only: it is slow)."""
    if triton is None:
        return False
    if torch.device(device).type == "cuda":
        return True
    # the interpreter's loops with bounds loaded from memory break on numpy >= 2.4
    import numpy

    major, minor = (int(x) for x in numpy.__version__.split(".")[:2])
    return os.environ.get("TRITON_INTERPRET") == "1" and (major, minor) < (2, 4)


def supports(head_dim: int) -> bool:
    """``tl.dot`` tiles need a power-of-two head dim of at least 16."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def failure(device: str, dtype: torch.dtype, head_dim: int, kv_dtype: torch.dtype | None = None) -> str | None:
    """Why the kernel cannot serve an engine here (completing "the kernel ..."), or None.
    Beyond the static checks, one tiny launch (which also compiles it) is checked against
    a plain softmax, once per (device, dtype, head_dim, cache dtype): a GPU whose triton cannot compile
    the kernel (an old architecture without bf16 tensor-core dots, a broken install) must
    not take down an engine that asked for "auto" — it gets torch's attention instead."""
    if triton is None:
        return "needs triton and a CUDA device (triton is not installed)"
    if not available(device):
        return f"needs triton and a CUDA device (device {device!r})"
    if not supports(head_dim):
        return f"needs a power-of-two head_dim >= 16, got {head_dim}"
    return _launch_failure(str(device), dtype, head_dim, kv_dtype or dtype)


@functools.lru_cache(maxsize=None)
def _launch_failure(device: str, dtype: torch.dtype, head_dim: int, kv_dtype: torch.dtype) -> str | None:
    reason = _probe(device, dtype, head_dim, kv_dtype)
    if reason is not None:
        log.warning("the Triton decode attention %s on %s (%s, cache %s, head_dim %d): engines use torch's "
                    "attention", reason, device, dtype, kv_dtype, head_dim)
    return reason


def _probe(device: str, dtype: torch.dtype, head_dim: int, kv_dtype: torch.dtype) -> str | None:
    try:
        g = torch.Generator().manual_seed(0)
        q = torch.randn((2, 1, 2, head_dim), generator=g).to(device, dtype)
        kc, vc = (torch.randn((2, 1, 300, head_dim), generator=g).to(device, kv_dtype) for _ in range(2))
        out = decode_attention(q, kc, vc, torch.tensor([1, 300], device=device), head_dim ** -0.5, 300)
        ref = torch.stack([torch.softmax(q[b, 0].float() @ kc[b, 0, :m].float().T * head_dim ** -0.5, -1)
                           @ vc[b, 0, :m].float() for b, m in ((0, 1), (1, 300))])[:, None]
        err = (out.float() - ref).abs().max().item()
    except Exception as exc:  # noqa: BLE001 - any failure means: do not use it here
        return f"failed to run: {type(exc).__name__}: {exc}"
    if not err <= (1e-4 if dtype == torch.float32 else 5e-2):
        return f"disagreed with a plain softmax by {err:.3g}"
    return None


def decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, lengths: Tensor, scale: float,
                     max_len: int, tokens: int = 1, new_kv: tuple[Tensor, Tensor] | None = None,
                     launch: tuple[int, int, int, int] | None = None, rope: Rope | None = None,
                     direct: bool = True, chunk: int = 0, f16_dots: bool | None = None) -> Tensor:
    """Attention of ``tokens`` new queries per row over the row's cache, causal among them:
    query t of row b sees positions ``[0, lengths[b] - tokens + t]`` (one token: a decode
    step; several: a speculative verify step, the new tokens' K/V already written).

    ``q`` [n, KV, G × tokens, D] (query rows per KV head, index g × tokens + t); ``k_cache``
    / ``v_cache`` one layer's cache [slots ≥ n, KV, positions, D], row b in slot b;
    ``lengths`` [n] int (≥ tokens, ≤ ``max_len`` ≤ positions). ``max_len`` only sizes the
    grid. ``new_kv`` (one token only): the step's new K and V, [n, KV, D] each, written into
    the cache at ``lengths[b] - 1`` by the kernel itself (not written before the call).
    The caches may be float8 (``KVCache``'s 8-bit storage): tiles are converted to q's
    dtype as they load (float16 under ``f16_dots``), and the new K/V stored as
    ``KVCache.encode`` stores them (NaN as 0, clamped to the format's range, rounded).
    ``launch``: (CHUNK, BLOCK_N, num_warps, num_stages) instead of ``default_launch``'s (for
    tuning); ``chunk`` > 0: ``default_launch``'s with that CHUNK.
    ``rope`` (with ``new_kv`` only): q and the new K are the raw projections, and the kernel
    applies the q/k RMSNorms and RoPE to them itself (``Rope``). A row of one chunk gets its
    output from its one program, and a grid of one chunk (``max_len`` ≤ CHUNK) runs no merge at
    all; ``direct=False`` sends such rows through the merge too (the A/B of
    benchmarks/decode_attention.py). ``v_cache`` may be a transposed view (positions contiguous,
    ``KVCache``'s 8-bit V); K's head dim must be contiguous. ``f16_dots``: over an 8-bit cache
    with bfloat16 q, the dots in float16 (``F16_DOTS`` by default; see there).
    Returns q's shape and dtype (contiguous)."""
    n, KV, _, D = q.shape
    if k_cache.stride(-1) != 1 or 1 not in (v_cache.stride(-1), v_cache.stride(-2)):
        raise ValueError(f"k_cache needs a contiguous head dim and v_cache a contiguous head dim or position axis, "
                         f"got strides {k_cache.stride()} and {v_cache.stride()}")
    f16 = F16_DOTS if f16_dots is None else f16_dots
    f16 = f16 and q.dtype == torch.bfloat16 and k_cache.element_size() == 1
    if new_kv is not None:
        if tokens != 1 or any(t.shape != (n, KV, D) for t in new_kv):
            raise ValueError(f"new_kv: one token's K and V of shape {(n, KV, D)} each, got "
                             f"{[tuple(t.shape) for t in new_kv]} for tokens={tokens}")
    if rope is not None:
        rope.check(n, D, new_kv is not None, q.shape[2])
    out = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    for row0 in range(0, q.shape[2], MAX_ROWS):  # a verify step of a wide GQA group: in slices
        rows = slice(row0, row0 + MAX_ROWS)
        _launch(q[:, :, rows], k_cache, v_cache, lengths, scale, max_len, tokens, row0, out[:, :, rows],
                new_kv if row0 == 0 else None,
                launch or default_launch(q.shape[0] * q.shape[1], k_cache.dtype, chunk),
                rope, direct, f16)
    return out


class Rope(NamedTuple):
    """What the kernel needs to apply the q/k RMSNorms and RoPE of a decode step itself.

    Why: outside the kernel they are three launches a layer (q-norm, k-norm, RoPE), a tenth
    of a small model's decode layer for a few hundred KB of data. Inside, every program normalises and rotates its own
    [group, head_dim] query tile as it loads it, and the program that writes the new K does
    the same to it before it stores it.

    ``cos`` / ``sin`` [n, D]: each row's RoPE table entries at its new position (``Rotary``'s:
    the sine with its first half negated, ``rotate_half(x)·sin = roll(x, D/2)·signed_sin``), in
    q's dtype; ``q_norm`` / ``k_norm`` [D] the norms' weights, or None (no q/k-norm: Llama).
    The arithmetic is ``fused.rms_norm``'s and ``fused.rope_qk``'s (float32 statistics; the
    normalised value and its weight product rounded to q's dtype; the rotation in float32,
    rounded once), so the result differs from the unfused path only by the order of the
    sum of squares."""

    cos: Tensor
    sin: Tensor
    q_norm: Tensor | None
    k_norm: Tensor | None
    eps: float

    def check(self, n: int, D: int, writes: bool, rows: int) -> None:
        if not writes:
            raise ValueError("rope needs new_kv: the kernel rotates the new K before it writes it")
        if rows > MAX_ROWS:
            raise ValueError(f"rope: at most {MAX_ROWS} query rows per KV head, got {rows}")
        if (self.q_norm is None) != (self.k_norm is None):
            raise ValueError("rope: q_norm and k_norm come together (both or neither)")
        for name, t in (("cos", self.cos), ("sin", self.sin)):
            if t.shape != (n, D) or t.stride(1) != 1:
                raise ValueError(f"rope.{name} must be [{n}, {D}] with unit stride along D, got {tuple(t.shape)}")
        for name, t in (("q_norm", self.q_norm), ("k_norm", self.k_norm)):
            if t is not None and (t.shape != (D,) or t.stride(0) != 1):
                raise ValueError(f"rope.{name} must be [{D}] and contiguous, got {tuple(t.shape)}")


def default_launch(programs: int, kv_dtype: torch.dtype, chunk: int = 0) -> tuple[int, int, int, int]:
    """The launch for a grid of ``programs`` rows × KV heads over a cache of ``kv_dtype``
    (``LAUNCH`` or ``NARROW``); ``chunk`` > 0 sets its CHUNK instead
    (EngineConfig.decode_attention_chunk)."""
    size = min(torch.finfo(kv_dtype).bits // 8, 2)
    launch = (LAUNCH if programs >= WIDE else NARROW)[size]
    return (chunk, *launch[1:]) if chunk > 0 else launch


def _launch(q: Tensor, k_cache: Tensor, v_cache: Tensor, lengths: Tensor, scale: float, max_len: int,
            tokens: int, row0: int, out: Tensor, new_kv: tuple[Tensor, Tensor] | None,
            launch: tuple[int, int, int, int], rope: Rope | None = None, direct: bool = True,
            f16: bool = False) -> None:
    n, KV, G, D = q.shape  # G: query rows per KV head in this slice, from row ``row0``
    chunk, block_n, warps, stages = launch
    chunks = triton.cdiv(max_len, chunk)
    acc = torch.empty((n, KV, chunks, G, D), device=q.device, dtype=torch.float32)
    stats = torch.empty((2, n, KV, chunks, G), device=q.device, dtype=torch.float32)  # max, denominator
    G_PAD = max(16, triton.next_power_of_2(G))  # the query tile of the dots (16 rows at least)
    G_M = triton.next_power_of_2(G)  # the merge's tile: no dot, so no padding to 16 rows
    exact = q.dtype == torch.float32  # fp32 dots stay fp32 (tl.dot would use tf32)
    k_new, v_new = new_kv if new_kv is not None else (k_cache, v_cache)  # unread without WRITE
    # V stored transposed (positions contiguous, KVCache.positions_last): its tiles are loaded
    # unmasked, as a mask along the contiguous axis would split the loads into bytes (LDG.E.U8
    # in ptxas' output). So a program reads up to BLOCK_N - 1 positions past its row's length,
    # weighted by zero: they must be finite (KVCache's are: zeroed when allocated, every write
    # clamped to the format's range and NaN-free), and inside the row's storage (checked here).
    v_t = v_cache.stride(-2) == 1 and v_cache.stride(-1) != 1
    if v_t and v_cache.stride(-1) < triton.cdiv(v_cache.shape[-2], block_n) * block_n:
        raise ValueError(f"a transposed v_cache needs its positions padded to a multiple of {block_n} "
                         f"(row stride {v_cache.stride(-1)} for {v_cache.shape[-2]} positions)")
    kv_max = torch.finfo(k_cache.dtype).max if k_cache.dtype != q.dtype else 0.0  # 0: no clamp
    cos, sin = (rope.cos, rope.sin) if rope is not None else (q, q)  # unread without ROPE
    q_norm = rope.q_norm if rope is not None and rope.q_norm is not None else q
    k_norm = rope.k_norm if rope is not None and rope.k_norm is not None else q
    _partial[(n, KV, chunks)](
        q, k_cache, v_cache, lengths, acc, stats, k_new, v_new, scale, G, tokens, row0,
        *q.stride(), *k_cache.stride()[:3], *v_cache.stride()[:4], *acc.stride()[:4], *stats.stride()[:5],
        *k_new.stride()[:3], *v_new.stride()[:3],
        cos, sin, cos.stride(0), q_norm, k_norm, rope.eps if rope is not None else 0.0, out, *out.stride(),
        G_PAD=G_PAD, G_M=G_M, D=D, CHUNK=chunk, BLOCK_N=block_n, EXACT=exact, WRITE=new_kv is not None,
        KV_MAX=kv_max, DIRECT=direct, F16=f16, V_T=v_t,
        ROPE=rope is not None, QK_NORM=rope is not None and rope.q_norm is not None,
        # float32 tiles are twice the size: unpipelined they fit any GPU's shared memory
        # (3 stages took 143-230 KB on sm80/sm90; an A100 has 164 KB)
        num_stages=1 if exact else stages, num_warps=warps,
    )
    if direct and chunks == 1:  # every row is one chunk, stored by its program: nothing to merge
        return  # a launch saved per layer whenever the context fits a chunk
    _merge[(n, KV)](
        acc, stats, lengths, out, G, *acc.stride()[:4], *stats.stride()[:5], *out.stride(),
        G_M=G_M, D=D, CHUNK=chunk, DIRECT=direct,
    )


if triton is not None:

    @triton.jit
    def _norm_rope(x, x_r, w_ptr, d, half, cos, sin, eps, QK_NORM: tl.constexpr, D: tl.constexpr):
        """RMSNorm (``QK_NORM``) then RoPE of the rows of x [rows, D], given x_r, the same
        rows rolled by D/2 (``x_r[:, i] = x[:, half[i]]``): ``fused.rms_norm`` and
        ``fused.rope_qk``'s arithmetic. Returns float32 holding values of x's dtype."""
        dt = x.dtype
        x = x.to(tl.float32)
        x_r = x_r.to(tl.float32)
        if QK_NORM:
            r = tl.rsqrt(tl.sum(x * x, 1) / D + eps)[:, None]  # the rolled row has the same sum
            w = tl.load(w_ptr + d).to(tl.float32)[None, :]
            w_r = tl.load(w_ptr + half).to(tl.float32)[None, :]
            x = ((x * r).to(dt).to(tl.float32) * w).to(dt).to(tl.float32)
            x_r = ((x_r * r).to(dt).to(tl.float32) * w_r).to(dt).to(tl.float32)
        return (x * cos[None, :] + x_r * sin[None, :]).to(dt).to(tl.float32)

    # G (query rows per KV head) and T (new tokens per row) are runtime values, not
    # specialised: a speculative engine meets many T (k + 1 per round, any backlog width
    # when the draft catches up), and a fresh compile for each new value costs more than
    # the rounds it serves. Only the tile size G_PAD compiles
    # (and the statistics' strides, which follow n × G, are not specialised either).
    @triton.jit(do_not_specialize=["G", "T", "row0", "ss_w", "ss_b", "ss_h", "ss_c"])
    def _partial(q_ptr, k_ptr, v_ptr, len_ptr, acc_ptr, st_ptr, kn_ptr, vn_ptr, scale, G, T, row0,
                 sq_b, sq_h, sq_g, sq_d, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, sv_d,
                 sa_b, sa_h, sa_c, sa_g, ss_w, ss_b, ss_h, ss_c, ss_g,
                 skn_b, skn_h, skn_d, svn_b, svn_h, svn_d,
                 cos_ptr, sin_ptr, sc_b, qw_ptr, kw_ptr, eps, out_ptr, so_b, so_h, so_g, so_d,
                 G_PAD: tl.constexpr, G_M: tl.constexpr, D: tl.constexpr, CHUNK: tl.constexpr,
                 BLOCK_N: tl.constexpr, EXACT: tl.constexpr, WRITE: tl.constexpr, KV_MAX: tl.constexpr,
                 ROPE: tl.constexpr, QK_NORM: tl.constexpr, DIRECT: tl.constexpr,
                 F16: tl.constexpr, V_T: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        c = tl.program_id(2)
        length = tl.load(len_ptr + b).to(tl.int32)  # int32 positions: the loop's masks compare 32 bits, not 64
        start = c * CHUNK
        end = tl.minimum(start + CHUNK, length)
        g = tl.arange(0, G_PAD)
        d = tl.arange(0, D)
        q_rows = q_ptr + b * sq_b + h * sq_h + g[:, None] * sq_g
        q = tl.load(q_rows + d[None, :] * sq_d, mask=g[:, None] < G, other=0.0)
        if ROPE:  # q is the raw projection: normalise and rotate it here (``Rope``)
            half = (d + D // 2) % D
            cos = tl.load(cos_ptr + b * sc_b + d).to(tl.float32)
            sin = tl.load(sin_ptr + b * sc_b + d).to(tl.float32)
            q_r = tl.load(q_rows + half[None, :] * sq_d, mask=g[:, None] < G, other=0.0)
            q = _norm_rope(q, q_r, qw_ptr, d, half, cos, sin, eps, QK_NORM, D).to(q_ptr.dtype.element_ty)
        if F16:  # float16 dots over an 8-bit cache: its values convert exactly; q saturates to the range
            q = tl.minimum(tl.maximum(q.to(tl.float32), -65504.0), 65504.0).to(tl.float16)
        limit = length - (T - 1) + (row0 + g) % T  # keys each query row sees (causal among new tokens)
        m = tl.full((G_PAD,), float("-inf"), tl.float32)
        den = tl.zeros((G_PAD,), tl.float32)
        acc = tl.zeros((G_PAD, D), tl.float32)
        k_base = k_ptr + b * sk_b + h * sk_h
        v_base = v_ptr + b * sv_b + h * sv_h
        pos = length - 1  # the new token's position (WRITE: one token a row)
        if WRITE:
            end = tl.minimum(end, pos)  # the loop reads the cache before it; the tail adds it
            limit = tl.minimum(limit, end)  # and its last tile's lanes from there on are masked
        for lo in range(start, end, BLOCK_N):  # nothing when the chunk starts past the row
            t = lo + tl.arange(0, BLOCK_N)
            live = t < end
            k = tl.load(k_base + t[:, None] * sk_t + d[None, :], mask=live[:, None], other=0.0)
            k = k.to(q.dtype)  # a no-op unless the cache is 8-bit
            if EXACT:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = tl.where(t[None, :] < limit[:, None], s * scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
            alpha = tl.exp(m - m_use)
            p = tl.exp(s - m_use[:, None])
            den = den * alpha + tl.sum(p, 1)
            if V_T:  # positions contiguous, read unmasked to the next BLOCK_N (times zero weights): see _launch
                v = tl.load(v_base + t[:, None] + d[None, :] * sv_d)
            else:
                v = tl.load(v_base + t[:, None] * sv_t + d[None, :], mask=live[:, None], other=0.0)
            v = v.to(q.dtype)
            if EXACT:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        if WRITE:
            if (pos >= start) & (pos < start + CHUNK):  # this program's chunk holds the new token
                # rounded to the cache's dtype first: the score is what a later step will read
                k_new = tl.load(kn_ptr + b * skn_b + h * skn_h + d * skn_d)
                v_new = tl.load(vn_ptr + b * svn_b + h * svn_h + d * svn_d)
                if ROPE:  # the raw K projection, as one [1, D] row through the same arithmetic as q
                    k_r = tl.load(kn_ptr + b * skn_b + h * skn_h + half * skn_d)
                    k_new = _norm_rope(k_new[None, :], k_r[None, :], kw_ptr, d, half, cos, sin, eps, QK_NORM, D)
                    k_new = tl.reshape(k_new, (D,)).to(kn_ptr.dtype.element_ty)
                if KV_MAX > 0:  # an 8-bit cache: NaN to 0, then saturate, as KVCache.encode does
                    k_new = k_new.to(tl.float32)  # (tl.minimum / maximum leave NaN handling unspecified)
                    v_new = v_new.to(tl.float32)
                    k_new = tl.minimum(tl.maximum(tl.where(k_new != k_new, 0.0, k_new), -KV_MAX), KV_MAX)
                    v_new = tl.minimum(tl.maximum(tl.where(v_new != v_new, 0.0, v_new), -KV_MAX), KV_MAX)
                k_new = k_new.to(k_ptr.dtype.element_ty)
                v_new = v_new.to(v_ptr.dtype.element_ty)
                tl.store(k_base + pos * sk_t + d, k_new)
                tl.store(v_base + pos * sv_t + d * sv_d, v_new)  # sv_d 1 unless V_T
                s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], 1) * scale  # every row sees it
                m_new = tl.maximum(m, s_new)
                alpha = tl.exp(m - m_new)
                p_new = tl.exp(s_new - m_new)
                den = den * alpha + p_new
                acc = acc * alpha[:, None] + p_new[:, None] * v_new.to(tl.float32)[None, :]
                m = m_new
        if DIRECT and length <= CHUNK:  # the row has one chunk: its output, as _merge would make it
            out = acc / tl.where(g < G, den, 1.0)[:, None]
            tl.store(out_ptr + b * so_b + h * so_h + g[:, None] * so_g + d[None, :] * so_d,
                     out.to(out_ptr.dtype.element_ty), mask=((g < G) & (c == 0))[:, None])
        else:
            keep = (g < G) & (start < length)
            tl.store(acc_ptr + b * sa_b + h * sa_h + c * sa_c + g[:, None] * sa_g + d[None, :], acc,
                     mask=keep[:, None])
            st = st_ptr + b * ss_b + h * ss_h + c * ss_c + g * ss_g
            tl.store(st, m, mask=keep)
            tl.store(st + ss_w, den, mask=keep)

    # a function of its own (not inlined), the form of ``_merge`` that benchmarks/decode_attention.py times
    @triton.jit(noinline=True)
    def _merge_row(acc_ptr, st_ptr, out_ptr, b, h, G, chunks, sa_b, sa_h, sa_c, sa_g, ss_w, ss_b, ss_h, ss_c,
                   ss_g, so_b, so_h, so_g, so_d, G_M: tl.constexpr, D: tl.constexpr):
        """Merge chunks ``[0, chunks)`` of (row b, KV head h) in chunk order and store the
        output (nothing when ``chunks`` is 0), on a tile of the group's own G_M rows (no dot
        here, so no padding to the dots' 16 rows). The loads bypass L1 (``.cg``): each partial
        is read once."""
        g = tl.arange(0, G_M)
        d = tl.arange(0, D)
        rows = (g < G) & (chunks > 0)
        m = tl.full((G_M,), float("-inf"), tl.float32)
        den = tl.zeros((G_M,), tl.float32)
        acc = tl.zeros((G_M, D), tl.float32)
        for c in range(0, chunks):
            st = st_ptr + b * ss_b + h * ss_h + c * ss_c + g * ss_g
            m_c = tl.load(st, mask=rows, other=0.0, cache_modifier=".cg")
            den_c = tl.load(st + ss_w, mask=rows, other=0.0, cache_modifier=".cg")
            acc_c = tl.load(acc_ptr + b * sa_b + h * sa_h + c * sa_c + g[:, None] * sa_g + d[None, :],
                            mask=rows[:, None], other=0.0, cache_modifier=".cg")
            m_new = tl.maximum(m, m_c)
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # chunks a query row sees nothing of
            alpha, beta = tl.exp(m - m_use), tl.exp(m_c - m_use)
            den = den * alpha + den_c * beta
            acc = acc * alpha[:, None] + acc_c * beta[:, None]
            m = m_new
        out = acc / tl.where(rows, den, 1.0)[:, None]  # nothing stored where no chunk was merged
        tl.store(out_ptr + b * so_b + h * so_h + g[:, None] * so_g + d[None, :] * so_d,
                 out.to(out_ptr.dtype.element_ty), mask=rows[:, None])

    @triton.jit(do_not_specialize=["G", "ss_w", "ss_b", "ss_h", "ss_c"])
    def _merge(acc_ptr, st_ptr, len_ptr, out_ptr, G, sa_b, sa_h, sa_c, sa_g, ss_w, ss_b, ss_h, ss_c, ss_g,
               so_b, so_h, so_g, so_d, G_M: tl.constexpr, D: tl.constexpr, CHUNK: tl.constexpr,
               DIRECT: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        chunks = tl.cdiv(tl.load(len_ptr + b), CHUNK)
        if DIRECT:  # a one-chunk row: _partial stored its output
            chunks = tl.where(chunks == 1, 0, chunks)
        _merge_row(acc_ptr, st_ptr, out_ptr, b, h, G, chunks, sa_b, sa_h, sa_c, sa_g, ss_w, ss_b, ss_h, ss_c,
                   ss_g, so_b, so_h, so_g, so_d, G_M, D)
