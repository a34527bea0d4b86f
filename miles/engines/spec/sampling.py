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
engine's generator. Every key is computed on the device from per-row stream seeds and
response positions, so a round makes no host round trip until its results are read back,
and a fully seeded round can be captured in a CUDA graph (``graphs.RoundGraphs``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from miles.engines.sampling import _C1, _C2, _GOLDEN, _M64, GREEDY_EPS, _lsr, _signed, _splitmix64, hashed_uniform, truncate
from miles.types import SamplingParams

MODES = ("rejection", "coupled")
# Salts that split one request seed into independent streams (plain sampling uses the seed).
DRAFT_STREAM, ACCEPT_STREAM, RESIDUAL_STREAM = 0xD1AF7, 0xACCE97, 0x5E51D0
PLAIN, DRAFT, ACCEPT, RESIDUAL = range(4)  # rows of RoundParams.seeds
_SALTS = (None, DRAFT_STREAM, ACCEPT_STREAM, RESIDUAL_STREAM)


def stream_seed(seed: int, salt: int) -> int:
    return _splitmix64((seed & _M64) ^ _splitmix64(salt))


def _mix(x: Tensor) -> Tensor:
    """splitmix64 on an int64 tensor (wrapping arithmetic): bitwise ``_splitmix64``."""
    x = x + _signed(_GOLDEN)
    x = (x ^ _lsr(x, 30)) * _C1
    x = (x ^ _lsr(x, 27)) * _C2
    return x ^ _lsr(x, 31)


def _premixed(seed: int | None, salt: int | None) -> int:
    if seed is None:
        return 0
    return _signed(_splitmix64((seed if salt is None else stream_seed(seed, salt)) & _M64))


@dataclass
class RoundParams:
    """Per-row sampling parameters of one round: device tensors plus host-side flags."""

    temperature: Tensor  # [n] float32 (1.0 for greedy rows)
    top_p: Tensor  # [n] float32 (1.0 for greedy rows)
    top_k: Tensor  # [n] long (-1 for greedy rows)
    greedy: Tensor  # [n] bool
    seeded: Tensor  # [n] bool
    seeds: Tensor  # [4, n] int64: splitmix64 of each stream's seed (PLAIN, DRAFT, ACCEPT, RESIDUAL)
    base: Tensor  # [n] int64: response position of the first new token
    any_greedy: bool
    all_greedy: bool
    all_seeded: bool
    truncated: bool  # some row uses top-k / top-p

    @classmethod
    def build(cls, params: list[SamplingParams], base: list[int], device: torch.device) -> RoundParams:
        from miles.utils.device import to_device

        greedy = [p.temperature <= GREEDY_EPS for p in params]
        floats = [[1.0 if g else p.temperature for p, g in zip(params, greedy)],
                  [1.0 if g else p.top_p for p, g in zip(params, greedy)]]
        ints = [[-1 if g else p.top_k for p, g in zip(params, greedy)], [int(g) for g in greedy],
                [int(p.seed is not None) for p in params], list(base),
                *[[_premixed(p.seed, salt) for p in params] for salt in _SALTS]]
        f = to_device(floats, torch.float32, device)
        i = to_device(ints, torch.int64, device)
        return cls(temperature=f[0], top_p=f[1], top_k=i[0], greedy=i[1].bool(), seeded=i[2].bool(), base=i[3],
                   seeds=i[4:], any_greedy=any(greedy), all_greedy=all(greedy),
                   all_seeded=all(p.seed is not None or g for p, g in zip(params, greedy)),
                   truncated=any(k > 0 for k in ints[0]) or any(p < 1.0 for p in floats[1]))

    def keys(self, stream: int, offsets: Tensor | int) -> Tensor:
        """Counter keys of ``stream`` at response positions ``base + offsets`` ([n] or
        [m, n]): ``row_key`` of the stream's seed, computed on the device."""
        return _mix(self.seeds[stream] ^ (self.base + offsets))

    def flags(self) -> tuple[bool, bool, bool]:
        return self.any_greedy, self.all_greedy, self.truncated


def processed_logprobs(logits: Tensor, rp: RoundParams) -> Tensor:
    """log of the distribution each row samples from: ``logits`` [n, V] or [n, T, V] →
    log_softmax(truncate(logits / T)) in float32 (greedy rows: log_softmax(logits)), taken as
    ``x - logsumexp(x)``: the plain sampler's and the trainer's form, so that a verified token's
    log-prob is theirs bit for bit (``--true-on-policy``; ``F.log_softmax`` rounds another way)."""
    shape = logits.shape
    flat = logits.float().reshape(shape[0], -1, shape[-1])
    flat = flat / rp.temperature[:, None, None]
    if rp.truncated:
        T = flat.shape[1]
        flat = truncate(flat.reshape(-1, shape[-1]), rp.top_k.repeat_interleave(T),
                        rp.top_p.repeat_interleave(T)).reshape(flat.shape)
    return (flat - torch.logsumexp(flat, dim=-1, keepdim=True)).reshape(shape)


def uniforms(rp: RoundParams, keys: Tensor, V: int, generator: torch.Generator | None) -> Tensor:
    """u [..., V] in (0, 1) for keys [...] (rows last): counter-based on seeded rows, from
    ``generator`` on the others."""
    u = hashed_uniform(keys.reshape(-1), V).view(*keys.shape, V)
    if not rp.all_seeded:
        fresh = torch.rand(u.shape, device=u.device, generator=generator)
        u = torch.where(rp.seeded[..., :, None], u, fresh)
    return u


def gumbel(u: Tensor) -> Tensor:
    return -torch.log(-torch.log(u))


def draft_noise(rp: RoundParams, k: int, V: int, mode: str, generator: torch.Generator | None) -> Tensor | None:
    """The Gumbel noise of the round's k draft draws, [k, n, V], in one batched draw (the
    plain stream in ``coupled`` mode — the policy's own noise — the draft stream otherwise;
    zero on greedy rows); None when every row is greedy."""
    if rp.all_greedy:
        return None
    offsets = torch.arange(k, device=rp.base.device)[:, None]
    g = gumbel(uniforms(rp, rp.keys(PLAIN if mode == "coupled" else DRAFT, offsets), V, generator))
    if rp.any_greedy:
        g = g.masked_fill(rp.greedy[None, :, None], 0.0)
    return g


def draft_pick(logq: Tensor, noise: Tensor | None) -> Tensor:
    """The draft's token from its processed log-probs ``logq`` [n, V] and that step's noise
    (Gumbel-max: a sample of q; the argmax on greedy rows, whose noise is zero)."""
    return logq.argmax(dim=-1) if noise is None else (logq + noise).argmax(dim=-1)


@dataclass
class Verdict:
    tokens: Tensor  # [n, k + 1]: d_1..d_a, then the correction / bonus at index a
    logprobs: Tensor  # [n, k + 1]: the policy's processed log-prob of each token
    accepted: Tensor  # [n] long: a, the number of draft tokens accepted
    finite: Tensor  # [n] bool: the policy's logits were finite at every used position


def verify(logits: Tensor, draft: Tensor, logq: Tensor, rp: RoundParams, mode: str, *,
           noise: Tensor | None = None, generator: torch.Generator | None = None) -> Verdict:
    """Accept or correct ``draft`` [n, k] (drawn from processed ``logq`` [n, k, V]) against
    the policy's raw ``logits`` [n, k + 1, V]. ``noise``: the draft's Gumbel noise [k, n, V]
    (``draft_noise``), which ``coupled`` mode reuses as the policy's."""
    if mode not in MODES:
        raise ValueError(f"speculative sampling mode {mode!r} not in {MODES}")
    n, T, V = logits.shape
    k = T - 1
    dev = logits.device
    logp = processed_logprobs(logits, rp)
    rows = torch.arange(n, device=dev)
    rejecting = mode == "rejection" and not rp.all_greedy  # some row uses rejection sampling
    # Tokens of the argmax family (greedy rows; every sampled row in coupled mode).
    target = None
    if mode == "coupled" or rp.any_greedy:
        g = torch.zeros_like(logp)
        if mode == "coupled" and not rp.all_greedy:
            if noise is None:
                noise = draft_noise(rp, k, V, mode, generator)
            g[:, :k] = noise.transpose(0, 1)
            g[:, k] = gumbel(uniforms(rp, rp.keys(PLAIN, k), V, generator))
            g.masked_fill_(rp.greedy[:, None, None], 0.0)
        target = (logp + g).argmax(dim=-1)  # [n, T]
        accept = draft == target[:, :k]
    if rejecting:
        lp_d = logp[:, :k].gather(-1, draft[..., None])[..., 0]
        lq_d = logq.gather(-1, draft[..., None])[..., 0]
        offsets = torch.arange(k, device=dev)[:, None]
        u = uniforms(rp, rp.keys(ACCEPT, offsets), 1, generator)[..., 0].transpose(0, 1)  # [n, k]
        test = torch.log(u) < lp_d - lq_d
        accept = test if target is None else torch.where(rp.greedy[:, None], accept, test)
    a = accept.long().cumprod(dim=1).sum(dim=1)  # leading accepted drafts
    if rejecting:
        fix = _correction(logp, logq, a, rp, generator)
        if target is not None:
            fix = torch.where(rp.greedy, target[rows, a], fix)
    else:
        fix = target[rows, a]
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
    # base + a (a stays on the device: nothing is read back mid-round).
    keys = torch.where(bonus, rp.keys(PLAIN, k), rp.keys(RESIDUAL, a))
    return (torch.log(residual) + gumbel(uniforms(rp, keys, V, generator))).argmax(dim=-1)
