"""Batched token sampling with the log-prob of the distribution actually sampled from.

One call samples one token for every row of a decode (or prefill) batch, each row with its
own SamplingParams:

- ``temperature <= 1e-6``: greedy (argmax). The recorded log-prob is ``log_softmax(logits)``
  at the argmax (temperature 1), since a point mass has no useful log-prob.
- otherwise the distribution is ``softmax(logits / T)`` restricted to the top-k and then the
  top-p nucleus and renormalised; the recorded log-prob is the sampled token's log-prob
  under exactly that distribution. With ``top_p = 1, top_k = -1`` it equals
  ``log_softmax(logits / T)[token]``, which is what the trainer computes
  (``miles.models.token_logprobs``).

Draws use the Gumbel-max trick: ``argmax(logp + g)`` with ``g = -log(-log(u))``. For rows with
a seed, ``u`` comes from a counter-based hash of (seed, response position, vocab index) —
no generator state — so the draw for response token i depends only on (seed, i): an
aborted and re-prefilled request reproduces an uninterrupted one, whatever else is in the
batch. Rows without a seed draw ``u`` from the engine's torch.Generator (through
``fused_sample``: a key drawn from it, hashed as a seeded row's).

On CUDA, batches without truncation take ``fused_sample`` (``miles.kernels.sampling``): the
same draw in one pass over the logits instead of ~15 kernels.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from miles.kernels.constants import GOLDEN as _GOLDEN
from miles.kernels.constants import GREEDY_EPS, UNIFORM_BITS, UNIFORM_SHIFT
from miles.kernels.constants import MIX1 as _MIX1
from miles.kernels.constants import MIX2 as _MIX2
from miles.types import SamplingParams
from miles.utils.device import to_device

log = logging.getLogger(__name__)

_M64 = (1 << 64) - 1


def _signed(x: int) -> int:
    x &= _M64
    return x - (1 << 64) if x >> 63 else x


def _splitmix64(x: int) -> int:
    """splitmix64 on Python ints (per-row key derivation; exact, platform independent)."""
    x = (x + _GOLDEN) & _M64
    x = ((x ^ (x >> 30)) * _MIX1) & _M64
    x = ((x ^ (x >> 27)) * _MIX2) & _M64
    return x ^ (x >> 31)


def row_key(seed: int, position: int) -> int:
    """A 64-bit key for (seed, response position), as a signed int for an int64 tensor."""
    return _signed(_splitmix64(_splitmix64(seed & _M64) ^ (position & _M64)))


_C1, _C2 = _signed(_MIX1), _signed(_MIX2)


def _lsr(x: Tensor, s: int) -> Tensor:
    """Logical shift right of an int64 tensor (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


# UNIFORM_BITS: why 23 bits, see miles.kernels.constants


def counter_uniform(keys: Tensor, vocab: int) -> Tensor:
    """u[b, v] in (0, 1), float32, a pure function of (keys[b], v): splitmix64's finaliser on
    ``key + v * golden`` (int64 arithmetic wraps, as on every torch backend)."""
    return _mix(keys, _golden(vocab, keys.device))


def _golden(vocab: int, device: torch.device) -> Tensor:
    """``v * golden`` for v < vocab (int64, wrapping)."""
    return torch.arange(vocab, device=device, dtype=torch.int64) * _signed(_GOLDEN)


def _mix(keys: Tensor, offsets: Tensor) -> Tensor:
    """``counter_uniform`` given the per-index offsets ``v * golden``. The compiled copy takes
    them as an input: computed inside the kernel, the product of an index and the 64-bit
    constant fails Triton's compile where inductor picks int32 indices (as it does for one
    key: the kernel's index runs over the vocabulary alone), and that failure used to
    switch every draw to eager."""
    z = keys[:, None] + offsets[None, :]
    z = (z ^ _lsr(z, 30)) * _C1
    z = (z ^ _lsr(z, 27)) * _C2
    z = z ^ _lsr(z, 31)
    return unit(_lsr(z, UNIFORM_SHIFT))


def unit(k: Tensor) -> Tensor:
    """u in (0, 1) from the hash's top ``UNIFORM_BITS`` bits ``k`` (int64, 0 ≤ k < 2^23)."""
    return (k.float() + 0.5) * (1.0 / (1 << UNIFORM_BITS))


_fast_uniform: Any = None  # a torch.compile'd _mix, once ``compile_counter_uniform`` vouched for it
_fast_classes: set[tuple[bool, bool]] = set()  # the shape classes it reproduced bitwise
_offsets: dict[tuple[int, torch.device], Tensor] = {}  # v * golden per (vocab, device)
_compiled = False  # compile_counter_uniform ran in this process (it runs once)


def _shape_class(keys: Tensor, vocab: int) -> tuple[bool, bool]:
    """(one key, one draw): the size-1 dimensions dynamo specialises, each a graph of its own."""
    return keys.numel() == 1, vocab == 1


def hashed_uniform(keys: Tensor, vocab: int) -> Tensor:
    """``counter_uniform``, through the compiled copy when there is one for this shape class:
    on CUDA its ~15 elementwise int64 passes over [rows, vocab] fuse into one kernel (integer
    arithmetic: bitwise the same numbers). A class the compiler failed on stays eager, and
    only that class: at 256 rows and a 152k vocabulary an eager draw is ~15 passes over
    39M int64 values every decode step."""
    fn = _fast_uniform
    cls = _shape_class(keys, vocab)
    if fn is None or keys.device.type != "cuda" or cls not in _fast_classes:
        return counter_uniform(keys, vocab)
    try:
        return _call(fn, keys, vocab)
    except Exception as exc:  # a shape the compiler cannot handle: this class stays eager
        _fast_classes.discard(cls)
        log.warning("compiled seeded draw failed for shape class %s (%s); eager for it from now on",
                    cls, _summary(exc))
        return counter_uniform(keys, vocab)


def _summary(exc: Exception) -> str:
    """An exception's type and first line (a compiler error runs to pages of generated code)."""
    lines = str(exc).splitlines()
    return f"{type(exc).__name__}: {lines[0][:200] if lines else ''}"


def _call(fn: Any, keys: Tensor, vocab: int) -> Tensor:
    """``fn(keys, offsets)`` without the inputs dynamo would guard on apart from their sizes:
    the grad mode (a stepping thread does not inherit no_grad) and a view's base
    (speculation's [rows, k] keys flattened: k = 1 after k = 4 failed a guard on the base's
    shape). Each failed guard is a recompile of a second or so in the middle of a rollout,
    and adaptive speculation changes k all the time."""
    with torch.no_grad():
        offsets = _offsets.get((vocab, keys.device))
        if offsets is None:  # made once per (vocab, device)
            offsets = _offsets[(vocab, keys.device)] = _golden(vocab, keys.device)
        return fn(keys if keys._base is None else keys.clone(), offsets)


def _probes(device: torch.device) -> list[tuple[Tensor, int]]:
    """A small and a model-sized vocabulary (the compiler specialises on size), and the
    size-1 cases dynamo compiles apart (one key: batch 1 and k 1; one draw per key: the
    acceptance tests), so that no draw compiles in the middle of a rollout."""
    keys = torch.tensor([row_key(1, 2), row_key(3, 4), -5], dtype=torch.int64, device=device)
    one = keys[:1].clone()
    return [(keys, 1000), (keys, 151936), (keys, 1), (one, 1000), (one, 151936), (one, 1)]


def verified_classes(fn: Any, device: torch.device) -> set[tuple[bool, bool]]:
    """The shape classes in which ``fn`` (a compiled ``_mix``) reproduces ``counter_uniform``
    bitwise on every probe; a probe that raises fails its class only."""
    good: dict[tuple[bool, bool], bool] = {}
    for keys, vocab in _probes(device):
        cls = _shape_class(keys, vocab)
        try:
            same = torch.equal(_call(fn, keys, vocab), counter_uniform(keys, vocab))
        except Exception as exc:
            log.warning("compiled seeded draw fails for shape class %s (%s); that class stays eager",
                        cls, _summary(exc))
            same = False
        good[cls] = good.get(cls, True) and same
    return {c for c, ok in good.items() if ok}


def fused_draw_classes() -> int:
    """How many of the four shape classes the compiled seeded draw serves (0: every draw is
    eager; an engine reports it, so a compile regression shows in the run's metrics)."""
    return len(_fast_classes)  # filled only together with _fast_uniform


def compile_counter_uniform(device: torch.device) -> bool:
    """Compile the seeded draw for CUDA and keep it for each shape class whose probes it
    reproduces bitwise (a class that fails, or raises, stays eager; the others keep the
    fused kernel). Returns whether the compiled copy serves the common class (many keys,
    a vocabulary)."""
    global _fast_uniform, _compiled
    if device.type != "cuda" or _compiled:
        return (False, False) in _fast_classes
    _compiled = True  # once a process: each new try recompiled every class (~0.7 s an engine)
    try:
        fn = torch.compile(_mix, dynamic=True, fullgraph=True)
    except Exception:  # an optimisation only
        return False
    _fast_classes.clear()
    _fast_classes.update(verified_classes(fn, device))
    _fast_uniform = fn if _fast_classes else None
    return (False, False) in _fast_classes


@dataclass
class SamplingBatch:
    """Per-row sampling parameters of one batch, built on the host from SamplingParams."""

    temperature: list[float]
    top_p: list[float]
    top_k: list[int]
    keys: list[int | None]  # row_key(seed, position) or None (unseeded)

    @classmethod
    def build(cls, params: list[SamplingParams], positions: list[int]) -> SamplingBatch:
        return cls(
            temperature=[p.temperature for p in params],
            top_p=[p.top_p for p in params],
            top_k=[p.top_k for p in params],
            keys=[None if p.seed is None else row_key(p.seed, pos) for p, pos in zip(params, positions)],
        )

    def uniforms(self, rows: list[int], V: int, dev: torch.device, gen: torch.Generator | None) -> Tensor:
        """``uniforms`` for these rows: what a kernel adds its Gumbel noise from."""
        return uniforms([self.keys[i] for i in rows], V, dev, gen)

    def truncates(self, rows: Any = None) -> bool:
        """Whether any of ``rows`` (default: all) samples from a top-k / top-p truncation."""
        rows = range(len(self.top_k)) if rows is None else rows
        return any(self.top_k[i] > 0 or self.top_p[i] < 1.0 for i in rows)


def truncate(logits: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Set logits outside each row's top-k, then outside its top-p nucleus, to -inf.

    ``top_k <= 0`` keeps all; the most likely token is always kept."""
    V = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    rank = torch.arange(V, device=logits.device)[None, :]
    k = torch.where(top_k > 0, top_k, V)[:, None]
    keep = rank < k
    probs = F.softmax(sorted_logits.masked_fill(~keep, float("-inf")), dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass of strictly more likely tokens
    keep &= (before < top_p[:, None]) | (rank == 0)
    kept = sorted_logits.masked_fill(~keep, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter(-1, order, kept)


def sample(logits: Tensor, batch: SamplingBatch, generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
    """Sample one token per row of ``logits`` [n, V] (float32). Returns (tokens, logprobs)."""
    n, V = logits.shape
    dev = logits.device
    greedy = [t <= GREEDY_EPS for t in batch.temperature]
    if all(greedy):
        return _greedy(logits)
    if not any(greedy):
        return _sampled(logits, batch, range(n), generator)
    tokens = torch.empty(n, dtype=torch.long, device=dev)
    logprobs = torch.empty(n, dtype=torch.float32, device=dev)
    g_rows = [i for i in range(n) if greedy[i]]
    s_rows = [i for i in range(n) if not greedy[i]]
    g_idx, s_idx = to_device(g_rows, torch.long, dev), to_device(s_rows, torch.long, dev)
    tokens[g_idx], logprobs[g_idx] = _greedy(logits[g_idx])
    tokens[s_idx], logprobs[s_idx] = _sampled(logits[s_idx], batch, s_rows, generator)
    return tokens, logprobs


def _greedy(logits: Tensor) -> tuple[Tensor, Tensor]:
    tok = logits.argmax(dim=-1)
    return tok, _logprob(logits, tok)


def _sampled(logits: Tensor, batch: SamplingBatch, rows: Any, generator: torch.Generator | None
             ) -> tuple[Tensor, Tensor]:
    dev = logits.device
    rows = list(rows)
    temps = [batch.temperature[i] for i in rows]
    scaled = logits if all(t == 1.0 for t in temps) else logits / to_device(temps, torch.float32, dev)[:, None]
    if batch.truncates(rows):
        top_k = to_device([batch.top_k[i] for i in rows], torch.long, dev)
        top_p = to_device([batch.top_p[i] for i in rows], torch.float32, dev)
        scaled = truncate(scaled, top_k, top_p)
    # Gumbel-max: argmax(scaled + g) ~ softmax(scaled); -inf (truncated) never wins.
    u = uniforms([batch.keys[i] for i in rows], logits.shape[1], dev, generator)
    tok = (scaled - torch.log(-torch.log(u))).argmax(dim=-1)
    return tok, _logprob(scaled, tok)


def _logprob(scaled: Tensor, tok: Tensor) -> Tensor:
    """Each row's log-prob of its token under ``scaled`` (the tempered, maybe truncated logits)."""
    return scaled.gather(-1, tok[:, None])[:, 0] - torch.logsumexp(scaled, dim=-1)


def recorded_logprobs(logits: Tensor, batch: SamplingBatch, tokens: Tensor) -> Tensor:
    """``sample``'s recorded log-probs of ``tokens`` for a batch that does not truncate, by its
    torch ops: under --true-on-policy their log-sum-exp is the trainer's kernel, so the fused
    draw's tokens get the log-probs the trainer recomputes, bit for bit (its own are ~1e-6 off)."""
    logits = logits.float()
    temps = [1.0 if t <= GREEDY_EPS else t for t in batch.temperature]
    scaled = logits if all(t == 1.0 for t in temps) else logits / to_device(temps, torch.float32, logits.device)[:, None]
    return _logprob(scaled, tokens)


def uniforms(keys: list[int | None], V: int, dev: torch.device, gen: torch.Generator | None) -> Tensor:
    """[rows, V] uniforms in [0, 1): a seeded row's from its key (the same on every replay),
    the others' from ``gen``."""
    seeded = [i for i, k in enumerate(keys) if k is not None]
    if not seeded:
        return torch.rand(len(keys), V, device=dev, generator=gen)
    hashed = hashed_uniform(to_device([keys[i] for i in seeded], torch.int64, dev), V)
    if len(seeded) == len(keys):
        return hashed
    u = torch.rand(len(keys), V, device=dev, generator=gen)
    u[to_device(seeded, torch.long, dev)] = hashed
    return u


def fused_sample(logits: Tensor, batch: SamplingBatch, generator: torch.Generator | None
                 ) -> tuple[Tensor, Tensor] | None:
    """``sample`` and the stepper's finiteness check in one Triton pass over ``logits`` [n, V]
    (float32 or the model's dtype; ``miles.kernels.sampling``). Returns tokens [n] and
    [3, n] float64 rows (token, log-prob, finite), or None for a batch that truncates (a
    sort: the torch path). Seeded rows draw exactly as ``sample`` does; an unseeded row
    hashes a key drawn from ``generator`` instead of drawing its uniforms from it."""
    if batch.truncates():
        return None
    from miles.kernels import sampling as kernel

    n, dev = logits.shape[0], logits.device
    packed = np.empty(2 * n, dtype=np.int64)  # keys, then the temperatures' float64 bits: one upload
    packed[:n] = [0 if k is None else k for k in batch.keys]
    packed[n:] = np.asarray(batch.temperature, dtype=np.float64).view(np.int64)
    packed = to_device(packed, torch.int64, dev)
    keys, temps = packed[:n], packed[n:].view(torch.float64)
    seeded = [k is not None for k in batch.keys]
    if not all(seeded):
        drawn = torch.randint(-(1 << 63), (1 << 63) - 1, (n,), device=dev, dtype=torch.int64, generator=generator)
        keys = torch.where(to_device(seeded, torch.bool, dev), keys, drawn)
    return kernel.sample(logits, temps, keys)


@functools.lru_cache(maxsize=None)
def fused_failure(device: str) -> str | None:
    """Why ``fused_sample`` cannot serve an engine on ``device``, or None. Beyond triton's
    presence, one small draw (which also compiles the kernels) must match ``sample``'s tokens
    and log-probs, once per device: a GPU whose triton miscompiles it gets the torch path."""
    from miles.kernels import sampling as kernel

    if kernel.triton is None or not kernel.available(device):
        return f"needs triton and a CUDA device (device {device!r})"
    try:
        g = torch.Generator().manual_seed(0)
        logits = (torch.randn(4, 3000, generator=g) * 4).to(device)
        batch = SamplingBatch([1.0, 0.6, 0.0, 1.7], [1.0] * 4, [-1] * 4, [row_key(s, 9) for s in range(4)])
        want_tok, want_lp = sample(logits, batch, None)
        tok, out = fused_sample(logits, batch, None)
        ok = torch.equal(tok, want_tok) and bool(torch.allclose(out[1].float(), want_lp, atol=1e-4))
    except Exception as exc:  # noqa: BLE001 - any failure means: not here
        return f"failed to run: {_summary(exc)}"
    if not ok:
        return f"disagreed with the torch draw (tokens {tok.tolist()} against {want_tok.tolist()})"
    return None
