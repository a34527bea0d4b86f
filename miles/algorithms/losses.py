"""Policy losses: PPO clip (asymmetric, dual-clip), GSPO's sequence ratio, decoupled PPO,
KL and entropy terms, loss aggregation — and ``compute_loss``, the one entry the trainer
calls per micro-batch.

All tensors are [batch, tokens] over response positions with a 0/1 ``loss_mask``
(advantages may be [batch], broadcast over the sequence). The loss the trainer minimises:

    Δ_t   = log π_θ − log π_prox          (GSPO: the sequence's mean Δ over loss tokens)
    r_t   = exp(clamp(Δ_t, ±20))
    pg_t  = max(−A_t r_t, −A_t clip(r_t, 1 − eps_clip, 1 + eps_clip_high))
            and, with dual_clip_c and A_t < 0, min(pg_t, −c·A_t)
    loss  = agg(w_t · pg_t) − entropy_coef · agg(H_t) + kl_coef · agg(KL_t(π_θ‖π_ref))

w_t is the behaviour correction (detached): ``importance_weights(π_prox, π_behav)`` with
``use_tis`` (its mask also drops tokens), the raw π_prox/π_behav with ``use_decoupled_loss``
(AReaL), else 1. π_prox is given (``prox_logp="recompute"``: log-probs of the pre-update
weights) or approximated from per-token versions (``"loglinear"``).

Aggregation divides by the *input* loss mask's counts — tokens dropped by MIS still count
in the denominator, so masking removes their gradient instead of up-weighting the rest —
and, for micro-batching, by the counts of the whole mini-batch (``LossDenominators``), so
the micro-batch losses add up to the mini-batch loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from miles.algorithms.config import AlgorithmConfig
from miles.algorithms.corrections import LOG_RATIO_CLAMP, importance_weights, loglinear_prox_logp
from miles.algorithms.masked import as_bool, finite_checks, masked_mean, zero_masked


# ---- building blocks ------------------------------------------------------------------


def ppo_clip_loss(
    log_ratio: Tensor,
    advantages: Tensor,
    *,
    eps_clip: float,
    eps_clip_high: float | None = None,
    dual_clip_c: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Per-token PPO clipped surrogate (to minimise) and where the clip was active."""
    high = eps_clip if eps_clip_high is None else eps_clip_high
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - eps_clip, 1.0 + high)
    loss = torch.maximum(unclipped, clipped)
    clip_active = clipped > unclipped
    if dual_clip_c is not None:
        dual = -advantages * dual_clip_c
        loss = torch.where(advantages < 0, torch.minimum(loss, dual), loss)
        clip_active = clip_active | ((advantages < 0) & (dual < torch.maximum(unclipped, clipped)))
    return loss, clip_active


def sequence_log_ratio(log_ratio: Tensor, loss_mask: Tensor) -> Tensor:
    """GSPO: each sequence's mean log-ratio over its loss tokens, broadcast to its tokens
    (the log of the length-normalized sequence ratio; gradient flows to every token)."""
    return masked_mean(log_ratio, loss_mask, dim=1)[:, None].expand_as(log_ratio)


def kl_estimate(logp: Tensor, logp_ref: Tensor, kind: str) -> Tensor:
    """Per-token estimate of KL(π‖π_ref) from samples of π (Schulman's k1, k2, k3)."""
    log_ratio = logp - logp_ref
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio**2
    if kind == "k3":
        neg = (-log_ratio).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        return torch.exp(neg) - 1.0 - neg
    raise ValueError(f"unknown KL estimator {kind!r}; expected 'k1', 'k2' or 'k3'")


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) over the last dim, in float32."""
    logits = logits.float()
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(-1)


class LossDenominators(NamedTuple):
    """Counts of a whole (mini-)batch, so micro-batch losses sum to the batch loss."""

    num_tokens: float  # loss tokens
    num_seqs: float  # sequences with at least one loss token
    max_tokens: int  # padded response length (seq-mean-token-sum-norm fallback)

    @classmethod
    def of(cls, loss_mask: Tensor) -> LossDenominators:
        m = as_bool(loss_mask)
        return cls(float(m.sum()), float(m.any(dim=1).sum()), int(m.shape[1]))


def agg_loss(
    values: Tensor,
    mask: Tensor,
    mode: str,
    *,
    norm_mask: Tensor | None = None,
    denominators: LossDenominators | None = None,
    max_tokens: int | None = None,
) -> Tensor:
    """Aggregate per-token ``values`` over ``mask`` into a scalar.

    "token-mean": Σ v / tokens; "seq-mean-token-mean": mean over sequences of each
    sequence's token mean; "seq-mean-token-sum-norm" (Dr. GRPO): Σ v / (max_tokens · seqs).
    Counts come from ``norm_mask`` (default ``mask``) or ``denominators``.
    """
    m = as_bool(mask)
    nm = m if norm_mask is None else as_bool(norm_mask)
    den = denominators or LossDenominators.of(nm)
    v = zero_masked(values, m)
    if mode == "token-mean":
        return v.sum() / max(den.num_tokens, 1.0)
    if mode == "seq-mean-token-mean":
        per_seq = v.sum(dim=1) / nm.sum(dim=1).clamp(min=1).to(v.dtype)
        return per_seq.sum() / max(den.num_seqs, 1.0)
    if mode == "seq-mean-token-sum-norm":
        norm = max_tokens or den.max_tokens
        return v.sum() / (max(norm, 1) * max(den.num_seqs, 1.0))
    raise ValueError(f"unknown loss aggregation {mode!r}")


# ---- the trainer's entry ----------------------------------------------------------------


@dataclass
class PolicyBatch:
    """One micro-batch of per-token tensors, [batch, tokens] over response positions."""

    logp: Tensor  # log π_θ of the sampled tokens (carries the gradient)
    logp_rollout: Tensor  # behaviour log-probs recorded by the rollout engine
    advantages: Tensor  # [batch] or [batch, tokens]
    loss_mask: Tensor  # 1 = the token carries loss
    logp_prox: Tensor | None = None  # π_prox ("recompute"); ignored by "loglinear"
    versions: Tensor | None = None  # int policy version per token ("loglinear")
    logp_ref: Tensor | None = None  # reference policy (KL term / metric)
    entropy: Tensor | None = None  # per-token entropy (carries gradient for the bonus)


def _validate(batch: PolicyBatch, m: Tensor) -> None:
    shape = batch.logp.shape
    if batch.logp.ndim != 2:
        raise ValueError(f"logp must be [batch, tokens], got shape {tuple(shape)}")
    named = {
        "logp_rollout": batch.logp_rollout,
        "loss_mask": batch.loss_mask,
        "logp_prox": batch.logp_prox,
        "versions": batch.versions,
        "logp_ref": batch.logp_ref,
        "entropy": batch.entropy,
    }
    for name, t in named.items():
        if t is not None and t.shape != shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} != logp shape {tuple(shape)}")
    adv = batch.advantages
    if adv.shape not in (shape, shape[:1]):
        raise ValueError(f"advantages must be [batch] or [batch, tokens], got {tuple(adv.shape)}")
    if not finite_checks():
        return
    finite = torch.isfinite(batch.logp) & torch.isfinite(batch.logp_rollout)
    for t in (batch.logp_prox, batch.logp_ref, adv if adv.ndim == 2 else None):
        if t is not None:
            finite = finite & torch.isfinite(t)
    if adv.ndim == 1:
        finite = finite & torch.isfinite(adv)[:, None]
    bad = m & ~finite
    if bool(bad.any()):
        names = [n for n, t in (("logp", batch.logp), ("logp_rollout", batch.logp_rollout),
                                ("logp_prox", batch.logp_prox), ("logp_ref", batch.logp_ref),
                                ("advantages", adv))
                 if t is not None and bool((~torch.isfinite(t)).any())]
        raise ValueError(f"non-finite values on loss-carrying tokens in {names}")


def _proximal(batch: PolicyBatch, cfg: AlgorithmConfig, m: Tensor, trainer_version: int | None) -> Tensor:
    if cfg.prox_logp == "loglinear":
        if batch.versions is None or trainer_version is None:
            raise ValueError("prox_logp='loglinear' needs batch.versions and trainer_version")
        prox = loglinear_prox_logp(
            batch.logp_rollout, batch.logp, batch.versions,
            current_version=trainer_version + 1, prox_version=trainer_version,
        )
        return zero_masked(prox, m)
    if batch.logp_prox is None:
        raise ValueError(
            "prox_logp='recompute' needs batch.logp_prox: the log-probs under the pre-update "
            "weights (logp.detach() when this is the batch's first optimizer step)"
        )
    return zero_masked(batch.logp_prox.detach(), m)


def _behaviour_weights(
    prox: Tensor, logp_rollout: Tensor, m: Tensor, config: AlgorithmConfig, stats: dict[str, Tensor]
) -> tuple[Tensor, Tensor]:
    """(w, effective mask): TIS/MIS weights with ``use_tis``, the raw π_prox/π_behav with
    ``use_decoupled_loss``, else 1. The importance stats are computed (and reported) always."""
    is_w, is_mask = importance_weights(
        prox, logp_rollout, m, mode=config.importance_mode, level=config.tis_level,
        low=config.tis_clip_low, high=config.tis_clip, veto=config.tis_veto, stats=stats,
    )
    if config.use_tis:
        return is_w, as_bool(is_mask)
    if config.use_decoupled_loss:
        raw = torch.exp((prox - logp_rollout).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        return zero_masked(raw, m), m
    return m.to(prox.dtype), m


def compute_loss(
    batch: PolicyBatch,
    config: AlgorithmConfig,
    *,
    trainer_version: int | None = None,
    denominators: LossDenominators | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The policy loss of one micro-batch and its metrics (0-dim detached tensors named
    ``train/...``). ``trainer_version`` is the trainer's version before this update (for the
    log-linear proximal policy); ``denominators`` default to this micro-batch's counts."""
    m = as_bool(batch.loss_mask)
    _validate(batch, m)
    logp = zero_masked(batch.logp, m)
    logp_rollout = zero_masked(batch.logp_rollout.detach(), m)
    prox = _proximal(batch, config, m, trainer_version)

    is_stats: dict[str, Tensor] = {}
    weights, eff_mask = _behaviour_weights(prox, logp_rollout, m, config, is_stats)

    log_ratio = logp - prox
    if config.sequence_ratio:
        log_ratio = sequence_log_ratio(log_ratio, m)
    adv = batch.advantages.to(logp.dtype)
    adv = zero_masked(adv[:, None].expand_as(logp) if adv.ndim == 1 else adv, m)
    pg_tok, clip_active = ppo_clip_loss(
        log_ratio, adv, eps_clip=config.eps_clip, eps_clip_high=config.clip_high,
        dual_clip_c=config.dual_clip_c,
    )
    agg = dict(norm_mask=m, denominators=denominators, max_tokens=config.loss_agg_max_tokens)
    pg_loss = agg_loss(pg_tok * weights, eff_mask, config.loss_agg, **agg)
    loss = pg_loss

    metrics: dict[str, Tensor] = {}
    if batch.entropy is not None:
        entropy = zero_masked(batch.entropy, m)
        if config.entropy_coef > 0:
            loss = loss - config.entropy_coef * agg_loss(entropy, eff_mask, config.loss_agg, **agg)
        metrics["train/entropy"] = masked_mean(entropy.detach(), m)
    elif config.entropy_coef > 0:
        raise ValueError("entropy_coef > 0 needs batch.entropy")
    if batch.logp_ref is not None:
        kl = kl_estimate(logp, zero_masked(batch.logp_ref.detach(), m), config.kl_type)
        if config.kl_coef > 0:
            loss = loss + config.kl_coef * agg_loss(kl, eff_mask, config.loss_agg, **agg)
        metrics["train/kl"] = masked_mean(kl.detach(), m)
    elif config.kl_coef > 0:
        raise ValueError("kl_coef > 0 needs batch.logp_ref (a reference model)")

    with torch.no_grad():
        metrics.update({
            "train/loss": loss.detach(),
            "train/pg_loss": pg_loss.detach(),
            "train/clip_frac": masked_mean(clip_active.to(logp.dtype), eff_mask),
            "train/ppo_kl": masked_mean(prox - logp.detach(), m),
            "train/behav_weight_mean": masked_mean(weights, eff_mask),
            "train/adv_mean": masked_mean(adv, m),
        })
        for key, value in is_stats.items():
            name = key if key.startswith("mismatch") else f"tis_{key}"
            metrics[f"train/{name}"] = value
    return loss, metrics
