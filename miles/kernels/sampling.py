"""One-pass Gumbel-max sampling of a decode step in Triton: token, log-prob and finiteness.

Why: the torch draw (``miles.engines.sampling``) makes ~15 passes over the step's
[rows, vocab] logits — upcast, uniforms, two logs, the add, argmax, logsumexp, gather, the
finiteness check, the stack — each a kernel of its own. With a 152k vocabulary that is a
fifth of a large batch's decode step, fifty times the time of reading the logits once. Here
one read does all of it:

1. ``_chunk``: grid (rows, vocab chunks). Each program draws its chunk's uniforms from the
   row's key with the same splitmix64 hash as ``counter_uniform`` (bitwise the same u), adds
   the Gumbel noise, keeps the best score and its first index, and the chunk's max and
   exp-sum of the tempered logits (for the log-softmax), and counts non-finite logits. Each
   lane keeps its own best, index, exp-sum and count over the blocks it walks, and the program
   reduces them once at the end: only the running max is reduced every block.
2. ``_finish``: grid (rows,). Merges the chunks in order (ties go to the lower index, as
   ``argmax``), and writes the token, and the host-bound [3, rows] float64 (token, log-prob,
   finite) the stepper copies back.

The draw is the torch path's: the same u, the same logs (libdevice's, as torch's CUDA
kernels), the same tempered logits (IEEE division, skipped at T = 1 as ``logits / 1`` is the
logits), so a row samples the same token either way except where two scores tie to the last
bit. The log-sum-exp uses the fast exp: the log-prob differs from torch's by float32 sums
(~1e-6). Top-k / top-p truncation needs a sort: such batches keep the torch path.
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

# the torch draw's constants: bitwise the same u
from miles.kernels.constants import GOLDEN as _GOLDEN
from miles.kernels.constants import GREEDY_EPS, UNIFORM_SHIFT
from miles.kernels.constants import MIX1 as _MIX1
from miles.kernels.constants import MIX2 as _MIX2
from miles.kernels.decode_attention import available  # the same rule: CUDA, or the interpreter

__all__ = ["BLOCK", "CHUNK", "WARPS", "available", "sample"]

# The launch: the per-lane form's fastest in benchmarks/sampling.py over a 152k vocabulary,
# (1024, 4096, 8) for small batches and (1024, 8192, 8) for wide ones. A wider BLOCK holds more
# running state a thread (16 entries at 2048) and halves the programs an SM
# (benchmarks/kernel_registers.py), which makes the per-lane form slower than per block.
BLOCK = 1024  # vocabulary entries per inner iteration
CHUNK = 4096  # vocabulary entries per program (38 programs a row for a 152k vocabulary)
WIDE_CHUNK = 8192  # per program in batches of WIDE rows or more (already enough programs)
WIDE = 128
WARPS = 8


def sample(logits: Tensor, temperature: Tensor, keys: Tensor, *, block: int | None = None, chunk: int | None = None,
           warps: int | None = None, lanes: bool = True) -> tuple[Tensor, Tensor]:
    """Draw one token per row of ``logits`` [n, V] (any float dtype, unit stride along V).

    ``temperature`` [n] float32 or float64, rounded to float32 (≤ ``GREEDY_EPS``: greedy,
    log-prob at temperature 1);
    ``keys`` [n] int64, each row's draw key (``row_key``). Returns tokens [n] int64 and
    [3, n] float64 rows (token, log-prob, 1.0 if every logit of the row is finite).
    ``block`` / ``chunk`` / ``warps``: launch shape (default the module's; benchmarks/sampling.py).
    ``lanes=False``: reduce every block across the program (the first form, for the A/B of
    benchmarks/sampling.py) instead of once at the end; the same token and log-prob either way."""
    n, V = logits.shape
    block, chunk, warps = block or BLOCK, chunk or (WIDE_CHUNK if n >= WIDE else CHUNK), warps or WARPS
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    chunks = triton.cdiv(V, chunk)
    precise = logits.device.type == "cuda"  # libdevice; the interpreter (CPU tests) lacks it
    part = torch.empty((4, n, chunks), device=logits.device, dtype=torch.float32)  # best, max, sum, bad
    part_idx = torch.empty((n, chunks), device=logits.device, dtype=torch.int32)
    tokens = torch.empty(n, device=logits.device, dtype=torch.int64)
    out = torch.empty((3, n), device=logits.device, dtype=torch.float64)
    if n == 0:
        return tokens, out
    _chunk[(n, chunks)](logits, temperature, keys, part, part_idx, V, logits.stride(0), n * chunks, chunks,
                        _GOLDEN, _MIX1, _MIX2, GREEDY_EPS, CHUNK=chunk, BLOCK=block, PRECISE=precise, LANES=lanes,
                        SHIFT=UNIFORM_SHIFT, num_warps=warps)
    _finish[(n,)](logits, temperature, part, part_idx, tokens, out, logits.stride(0), n * chunks, chunks, n,
                  GREEDY_EPS, C_PAD=max(16, triton.next_power_of_2(chunks)), PRECISE=precise)
    return tokens, out


if triton is not None:

    @triton.jit
    def _log(x, PRECISE: tl.constexpr):
        """libdevice's logf on the GPU (torch's); the interpreter has only tl.log."""
        if PRECISE:
            y = libdevice.log(x)
        else:
            y = tl.log(x)
        return y

    @triton.jit(do_not_specialize=["V", "sx", "plane", "chunks"])
    def _chunk(x_ptr, t_ptr, key_ptr, part_ptr, idx_ptr, V, sx, plane, chunks, golden, c1, c2, eps,
               CHUNK: tl.constexpr, BLOCK: tl.constexpr, PRECISE: tl.constexpr, LANES: tl.constexpr,
               SHIFT: tl.constexpr):
        b = tl.program_id(0)
        c = tl.program_id(1)
        temp = tl.load(t_ptr + b).to(tl.float32)
        greedy = temp <= eps
        unit = greedy | (temp == 1.0)  # logits / 1 is the logits: no division
        key = tl.load(key_ptr + b).to(tl.uint64, bitcast=True)
        if LANES:  # per-lane running values, reduced across the program once, after the loop
            best = tl.full((BLOCK,), float("-inf"), tl.float32)
            best_i = tl.zeros((BLOCK,), tl.int32)
            s = tl.zeros((BLOCK,), tl.float32)
            bad = tl.zeros((BLOCK,), tl.float32)
        else:
            best = float("-inf")
            best_i = 0
            s = 0.0
            bad = 0.0
        m = float("-inf")  # the tempered logits' running max: one reduction a block either way
        for lo in range(c * CHUNK, c * CHUNK + CHUNK, BLOCK):
            v = lo + tl.arange(0, BLOCK)
            live = v < V
            x = tl.load(x_ptr + b * sx + v, mask=live, other=0.0).to(tl.float32)
            nonfinite = tl.where(live & ((x != x) | (tl.abs(x) == float("inf"))), 1.0, 0.0)
            if unit:
                scaled = x
            else:
                scaled = tl.div_rn(x, temp)  # IEEE, as torch's division
            if greedy:
                score = scaled
            else:
                z = key + v.to(tl.uint64) * golden  # counter_uniform: splitmix64's finaliser
                z = (z ^ (z >> 30)) * c1
                z = (z ^ (z >> 27)) * c2
                z = z ^ (z >> 31)
                u = ((z >> SHIFT).to(tl.int32).to(tl.float32) + 0.5) * (1.0 / (1 << (64 - SHIFT)))  # exact, < 1
                score = scaled - _log(-_log(u, PRECISE), PRECISE)
            score = tl.where(live, score, float("-inf"))
            # the log-sum-exp with the fast exp: its error (~2 ulp a term) is below the
            # float32 sum's own, and the draw does not depend on it
            sm = tl.where(live, scaled, float("-inf"))
            m_new = tl.maximum(m, tl.max(sm, 0))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            if LANES:
                take = score > best  # strict: a lane's earlier index keeps a tie
                best_i = tl.where(take, v, best_i)
                best = tl.where(take, score, best)
                s = s * tl.exp(m - m_use) + tl.exp(sm - m_use)
                bad += nonfinite
            else:
                blk_best, blk_i = tl.max(score, 0, return_indices=True, return_indices_tie_break_left=True)
                take = blk_best > best  # strict: an earlier index keeps a tie
                best_i = tl.where(take, blk_i + lo, best_i)
                best = tl.where(take, blk_best, best)
                s = s * tl.exp(m - m_use) + tl.sum(tl.exp(sm - m_use), 0)
                bad += tl.sum(nonfinite, 0)
            m = m_new
        if LANES:  # the best score, and the lowest index holding it (argmax's tie rule)
            top = tl.max(best, 0)
            best_i = tl.min(tl.where(best == top, best_i, 2147483647), 0)
            best = top
            s = tl.sum(s, 0)
            bad = tl.sum(bad, 0)
        at = b * chunks + c
        tl.store(part_ptr + at, best)
        tl.store(part_ptr + plane + at, m)
        tl.store(part_ptr + 2 * plane + at, s)
        tl.store(part_ptr + 3 * plane + at, bad)
        tl.store(idx_ptr + at, best_i)

    @triton.jit(do_not_specialize=["sx", "plane", "chunks", "n"])
    def _finish(x_ptr, t_ptr, part_ptr, idx_ptr, tok_ptr, out_ptr, sx, plane, chunks, n, eps,
                C_PAD: tl.constexpr, PRECISE: tl.constexpr):
        b = tl.program_id(0)
        c = tl.arange(0, C_PAD)
        live = c < chunks
        at = b * chunks + c
        best = tl.load(part_ptr + at, mask=live, other=float("-inf"))
        m = tl.load(part_ptr + plane + at, mask=live, other=float("-inf"))
        s = tl.load(part_ptr + 2 * plane + at, mask=live, other=0.0)
        bad = tl.sum(tl.load(part_ptr + 3 * plane + at, mask=live, other=0.0), 0)
        idx = tl.load(idx_ptr + at, mask=live, other=0)
        top = tl.max(best, 0)
        first = tl.min(tl.where(live & (best == top), c, C_PAD), 0)  # the lowest chunk holding the best
        token = tl.sum(tl.where(c == first, idx, 0), 0)
        m_all = tl.max(m, 0)
        m_use = tl.where(m_all == float("-inf"), 0.0, m_all)
        lse = m_use + _log(tl.sum(s * tl.exp(m - m_use), 0), PRECISE)
        temp = tl.load(t_ptr + b).to(tl.float32)
        x = tl.load(x_ptr + b * sx + token).to(tl.float32)
        scaled = tl.where(temp <= eps, x, tl.div_rn(x, tl.where(temp <= eps, 1.0, temp)))
        tl.store(tok_ptr + b, token.to(tl.int64))
        tl.store(out_ptr + b, token.to(tl.float64))
        tl.store(out_ptr + n + b, (scaled - lse).to(tl.float64))
        tl.store(out_ptr + 2 * n + b, tl.where(bad == 0.0, 1.0, 0.0).to(tl.float64))
