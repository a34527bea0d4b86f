"""Speculative sampling: draw draft tokens, then accept or correct them against the policy.

Pure tensor functions over one round of a batch: ``n`` rows, ``k`` draft tokens each, the
policy's logits at ``T = k + 1`` positions (the last accepted token and the k drafts). The
output distribution is exactly the policy's, at any temperature and with top-k / top-p:
``p`` and ``q`` below are the *processed* distributions (temperature, then truncation,
renormalised) of the policy and of the draft — the ones the plain sampler draws from.

Two modes (``--speculative-sampling``):

- ``rejection`` (default; Leviathan et al. / Chen et al.): the draft samples ``d_j ~ q_j``;
  the policy accepts it with probability ``min(1, p_j(d_j) / q_j(d_j))``; at the first
  rejection it samples from the normalised residual ``max(0, p_j - q_j)``; if all k are
  accepted it samples a bonus token from ``p_{k+1}``. Maximal acceptance
  (``Σ min(p, q)`` per token).
- ``coupled``: the draft and the policy share the Gumbel noise of the plain sampler,
  ``g(seed, position)``: ``d_j = argmax(log q_j + g_j)``, the policy's token is
  ``t_j = argmax(log p_j + g_j)`` — exactly what non-speculative decoding samples — and a
  draft is accepted iff ``d_j == t_j``. The tokens are then *identical* to non-speculative
  decoding with the same seed, whatever the draft, k, or the batch (so abort + resume and
  switching speculation on and off reproduce exactly); acceptance is somewhat lower than
  with rejection sampling when q differs from p.

Greedy rows (temperature <= 1e-6) are the same in both modes: accept iff the draft token is
the policy's argmax; the first mismatch is replaced by the argmax.

Seeded draws are counter-based (``miles.engines.sampling.counter_uniform``): the draw for
response position i depends only on (seed, i, stream), with separate streams for the
draft's choice, the accept test and the residual, and the plain sampler's own stream for
the bonus token (and for everything in ``coupled`` mode). Unseeded rows draw from the
engine's generator.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from miles.engines.sampling import (
    _C1,
    _C2,
    _GOLDEN,
    _M64,
    GREEDY_EPS,
    _lsr,
    _signed,
    _splitmix64,
    counter_uniform,
    row_key,
    to_device,
    truncate,
)
from miles.types import SamplingParams

MODES = ("rejection", "coupled")
# Salts that split one request seed into independent streams (plain sampling uses the seed).
DRAFT_STREAM, ACCEPT_STREAM, RESIDUAL_STREAM = 0xD1AF7, 0xACCE97, 0x5E51D0


def stream_seed(seed: int, salt: int) -> int:
    return _splitmix64((seed & _M64) ^ _splitmix64(salt))


def _mix(x: Tensor) -> Tensor:
    """splitmix64 on an int64 tensor (wrapping arithmetic): bitwise ``_splitmix64``."""
    x = x + _signed(_GOLDEN)
    x = (x ^ _lsr(x, 30)) * _C1
    x = (x ^ _lsr(x, 27)) * _C2
    return x ^ _lsr(x, 31)


@dataclass
class RoundParams:
    """Per-row sampling parameters of one speculative round (device tensors + host keys)."""

    temperature: Tensor  # [n] float32 (1.0 for greedy rows)
    top_k: Tensor  # [n] long (-1 for greedy rows)
    top_p: Tensor  # [n] float32 (1.0 for greedy rows)
    greedy: Tensor  # [n] bool
    greedy_host: list[bool]
    any_greedy: bool
    all_greedy: bool
    truncated: bool  # some row uses top-k / top-p
    seeds: list[int | None]
    base: list[int]  # response position of the first new token of each row

    @classmethod
    def build(cls, params: list[SamplingParams], base: list[int], device: torch.device) -> RoundParams:
        greedy = [p.temperature <= GREEDY_EPS for p in params]
        temps = [1.0 if g else p.temperature for p, g in zip(params, greedy)]
        top_k = [-1 if g else p.top_k for p, g in zip(params, greedy)]
        top_p = [1.0 if g else p.top_p for p, g in zip(params, greedy)]
        return cls(
            temperature=to_device(temps, torch.float32, device),
            top_k=to_device(top_k, torch.long, device),
            top_p=to_device(top_p, torch.float32, device),
            greedy=to_device(greedy, torch.bool, device), greedy_host=greedy,
            any_greedy=any(greedy), all_greedy=all(greedy),
            truncated=any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p),
            seeds=[p.seed for p in params], base=list(base),
        )

    def keys(self, offset: int | list[int], salt: int | None = None) -> list[int | None]:
        """Counter keys for response position ``base + offset`` of every row (one stream)."""
        offs = offset if isinstance(offset, list) else [offset] * len(self.base)
        out: list[int | None] = []
        for seed, b, o in zip(self.seeds, self.base, offs):
            if seed is None:
                out.append(None)
            else:
                out.append(row_key(seed if salt is None else stream_seed(seed, salt), b + o))
        return out

    def device_keys(self, offsets: Tensor, salt: int | None = None) -> Tensor:
        """``keys`` for per-row offsets held on the device (no host sync); unseeded rows get
        a meaningless key (their draw comes from the generator)."""
        mixed = [0 if s is None else _signed(_splitmix64((s if salt is None else stream_seed(s, salt)) & _M64))
                 for s in self.seeds]
        base = to_device(self.base, torch.int64, offsets.device)
        return _mix(to_device(mixed, torch.int64, offsets.device) ^ (base + offsets))


def processed_logprobs(logits: Tensor, rp: RoundParams) -> Tensor:
    """log of the distribution each row samples from: ``logits`` [n, V] or [n, T, V] →
    log_softmax(truncate(logits / T)) in float32 (greedy rows: log_softmax(logits))."""
    shape = logits.shape
    flat = logits.float().reshape(shape[0], -1, shape[-1])
    flat = flat / rp.temperature[:, None, None]
    if rp.truncated:
        T = flat.shape[1]
        flat = truncate(flat.reshape(-1, shape[-1]), rp.top_k.repeat_interleave(T),
                        rp.top_p.repeat_interleave(T)).reshape(flat.shape)
    return F.log_softmax(flat, dim=-1).reshape(shape)


def uniforms(keys: list[int | None], V: int, device: torch.device, generator: torch.Generator | None) -> Tensor:
    """u [m, V] in (0, 1): counter-based for keyed rows, from ``generator`` for the others."""
    seeded = [i for i, k in enumerate(keys) if k is not None]
    if not seeded:
        return torch.rand(len(keys), V, device=device, generator=generator)
    if len(seeded) == len(keys):
        return counter_uniform(to_device(keys, torch.int64, device), V)
    u = torch.rand(len(keys), V, device=device, generator=generator)
    if seeded:
        u[to_device(seeded, torch.long, device)] = counter_uniform(
            to_device([keys[i] for i in seeded], torch.int64, device), V)
    return u


def gumbel(u: Tensor) -> Tensor:
    return -torch.log(-torch.log(u))


def draft_pick(logq: Tensor, rp: RoundParams, step: int, mode: str,
               generator: torch.Generator | None) -> tuple[Tensor, Tensor | None]:
    """The draft's token for response position ``base + step`` from its processed log-probs
    ``logq`` [n, V]. Returns (tokens [n], the Gumbel noise used when ``coupled`` — the
    verify step reuses it)."""
    if rp.all_greedy:
        return logq.argmax(dim=-1), None
    V = logq.shape[-1]
    salt = None if mode == "coupled" else DRAFT_STREAM
    g = gumbel(uniforms(rp.keys(step, salt), V, logq.device, generator))
    if rp.any_greedy:
        g = g.masked_fill(rp.greedy[:, None], 0.0)
    tokens = (logq + g).argmax(dim=-1)
    return tokens, (g if mode == "coupled" else None)


@dataclass
class Verdict:
    tokens: Tensor  # [n, k + 1]: d_1..d_a, then the correction / bonus at index a
    logprobs: Tensor  # [n, k + 1]: the policy's processed log-prob of each token
    accepted: Tensor  # [n] long: a, the number of draft tokens accepted
    finite: Tensor  # [n] bool: the policy's logits were finite at every used position


def verify(logits: Tensor, draft: Tensor, logq: Tensor, rp: RoundParams, mode: str, *,
           noise: list[Tensor] | None = None, generator: torch.Generator | None = None) -> Verdict:
    """Accept or correct ``draft`` [n, k] (drawn from processed ``logq`` [n, k, V]) against
    the policy's raw ``logits`` [n, k + 1, V]. ``noise``: the k Gumbel tensors the draft
    used in ``coupled`` mode."""
    if mode not in MODES:
        raise ValueError(f"speculative sampling mode {mode!r} not in {MODES}")
    n, T, V = logits.shape
    k = T - 1
    dev = logits.device
    logp = processed_logprobs(logits, rp)
    rows = torch.arange(n, device=dev)
    rejecting = mode == "rejection" and not rp.all_greedy  # some row uses rejection sampling
    reject_rows = ~rp.greedy if mode == "rejection" else torch.zeros(n, dtype=torch.bool, device=dev)
    # Tokens of the argmax family (greedy rows; every sampled row in coupled mode).
    g = torch.zeros_like(logp)
    if mode == "coupled" and not rp.all_greedy:
        for j in range(k):
            g[:, j] = noise[j] if noise is not None else gumbel(uniforms(rp.keys(j), V, dev, generator))
        g[:, k] = gumbel(uniforms(rp.keys(k), V, dev, generator))
        g.masked_fill_(rp.greedy[:, None, None], 0.0)
    target = (logp + g).argmax(dim=-1)  # [n, T]
    accept = draft == target[:, :k]
    if rejecting:
        lp_d = logp[:, :k].gather(-1, draft[..., None])[..., 0]
        lq_d = logq.gather(-1, draft[..., None])[..., 0]
        u = torch.stack([uniforms(rp.keys(j, ACCEPT_STREAM), 1, dev, generator)[:, 0] for j in range(k)], dim=1)
        accept = torch.where(reject_rows[:, None], torch.log(u) < lp_d - lq_d, accept)
    a = accept.long().cumprod(dim=1).sum(dim=1)  # leading accepted drafts
    fix = target[rows, a]
    if rejecting:
        fix = torch.where(reject_rows, _correction(logp, logq, a, rp, generator), fix)
    tokens = torch.cat([draft, torch.zeros_like(draft[:, :1])], dim=1)
    tokens[rows, a] = fix
    logprobs = logp.gather(-1, tokens[..., None])[..., 0]
    used = torch.arange(T, device=dev)[None, :] <= a[:, None]
    finite = (torch.isfinite(logits).all(dim=-1) | ~used).all(dim=1)
    return Verdict(tokens, logprobs, a, finite)


def _correction(logp: Tensor, logq: Tensor, a: Tensor, rp: RoundParams,
                generator: torch.Generator | None) -> Tensor:
    """Rejection rows: a sample from norm(max(0, p_a - q_a)) when a draft was rejected at
    index a < k, from p_k (the bonus) when all k were accepted."""
    n, T, V = logp.shape
    k = T - 1
    rows = torch.arange(n, device=logp.device)
    p = logp[rows, a].exp()
    q = logq[rows, a.clamp(max=k - 1)].exp()
    bonus = a == k
    residual = torch.where(bonus[:, None], p, (p - q).clamp(min=0.0))
    # Rounding can leave a residual of zero mass where p and q nearly coincide: use p there.
    empty = residual.sum(dim=-1) <= 0
    residual = torch.where(empty[:, None], p, residual)
    # The bonus draws from the plain stream at base + k, a residual from its own stream at
    # base + a; both keys are computed on the device (a is not read back mid-round).
    seeded = [s is not None for s in rp.seeds]
    if any(seeded):
        keys = torch.where(bonus, rp.device_keys(torch.full_like(a, k)), rp.device_keys(a, RESIDUAL_STREAM))
        u = counter_uniform(keys, V)
        if not all(seeded):
            fresh = torch.rand(n, V, device=logp.device, generator=generator)
            u = torch.where(to_device(seeded, torch.bool, logp.device)[:, None], u, fresh)
    else:
        u = torch.rand(n, V, device=logp.device, generator=generator)
    return (torch.log(residual) + gumbel(u)).argmax(dim=-1)
