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
batch. Rows without a seed draw ``u`` from the engine's torch.Generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from miles.types import SamplingParams

GREEDY_EPS = 1e-6
_M64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _signed(x: int) -> int:
    x &= _M64
    return x - (1 << 64) if x >> 63 else x


def _splitmix64(x: int) -> int:
    """splitmix64 on Python ints (per-row key derivation; exact, platform independent)."""
    x = (x + _GOLDEN) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def row_key(seed: int, position: int) -> int:
    """A 64-bit key for (seed, response position), as a signed int for an int64 tensor."""
    return _signed(_splitmix64(_splitmix64(seed & _M64) ^ (position & _M64)))


_C1, _C2 = _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


def _lsr(x: Tensor, s: int) -> Tensor:
    """Logical shift right of an int64 tensor (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def counter_uniform(keys: Tensor, vocab: int) -> Tensor:
    """u[b, v] in (0, 1), float32, a pure function of (keys[b], v): splitmix64's finaliser on
    ``key + v * golden`` (int64 arithmetic wraps, as on every torch backend)."""
    v = torch.arange(vocab, device=keys.device, dtype=torch.int64) * _signed(_GOLDEN)
    z = keys[:, None] + v[None, :]
    z = (z ^ _lsr(z, 30)) * _C1
    z = (z ^ _lsr(z, 27)) * _C2
    z = z ^ _lsr(z, 31)
    return (_lsr(z, 40).float() + 0.5) * (1.0 / (1 << 24))


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
    tokens = torch.empty(n, dtype=torch.long, device=dev)
    logprobs = torch.empty(n, dtype=torch.float32, device=dev)
    g_rows = [i for i in range(n) if greedy[i]]
    s_rows = [i for i in range(n) if not greedy[i]]
    if g_rows:
        idx = torch.tensor(g_rows, device=dev) if len(g_rows) < n else None
        lg = logits if idx is None else logits[idx]
        tok = lg.argmax(dim=-1)
        lp = F.log_softmax(lg, dim=-1).gather(-1, tok[:, None])[:, 0]
        _put(tokens, logprobs, idx, tok, lp)
    if s_rows:
        idx = torch.tensor(s_rows, device=dev) if len(s_rows) < n else None
        lg = logits if idx is None else logits[idx]
        temp = torch.tensor([batch.temperature[i] for i in s_rows], device=dev, dtype=torch.float32)
        scaled = lg / temp[:, None]
        if any(batch.top_k[i] > 0 or batch.top_p[i] < 1.0 for i in s_rows):
            top_k = torch.tensor([batch.top_k[i] for i in s_rows], device=dev)
            top_p = torch.tensor([batch.top_p[i] for i in s_rows], device=dev, dtype=torch.float32)
            scaled = truncate(scaled, top_k, top_p)
        logp = F.log_softmax(scaled, dim=-1)
        u = _uniforms([batch.keys[i] for i in s_rows], V, dev, generator)
        tok = (logp - torch.log(-torch.log(u))).argmax(dim=-1)
        _put(tokens, logprobs, idx, tok, logp.gather(-1, tok[:, None])[:, 0])
    return tokens, logprobs


def _put(tokens: Tensor, logprobs: Tensor, idx: Tensor | None, tok: Tensor, lp: Tensor) -> None:
    if idx is None:
        tokens.copy_(tok)
        logprobs.copy_(lp)
    else:
        tokens[idx] = tok
        logprobs[idx] = lp


def _uniforms(keys: list[int | None], V: int, dev: torch.device, gen: torch.Generator | None) -> Tensor:
    seeded = [i for i, k in enumerate(keys) if k is not None]
    if not seeded:
        return torch.rand(len(keys), V, device=dev, generator=gen)
    key_t = torch.tensor([keys[i] for i in seeded], device=dev, dtype=torch.int64)
    hashed = counter_uniform(key_t, V)
    if len(seeded) == len(keys):
        return hashed
    u = torch.rand(len(keys), V, device=dev, generator=gen)
    u[torch.tensor(seeded, device=dev)] = hashed
    return u
