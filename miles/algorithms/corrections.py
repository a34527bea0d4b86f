"""Rollout corrections: importance weights between the trainer's and the rollout engine's
log-probs (TIS / MIS / IcePop), and the log-linear proximal-policy approximation.

``importance_weights`` is the one entry for truncated (Yao et al., "tis") and masked
("mask": MIS; IcePop at token level with low=0.5, high=5) importance sampling. It returns
exactly ``(weights, loss_mask)``; pass ``stats={}`` to also get its diagnostics, which it
writes into that dict as 0-dim detached tensors (no device sync; ``float(v)`` reads one):

    ratio_mean, ratio_max   raw ratio at the chosen level, over the input's loss tokens
    clip_frac               fraction of loss tokens whose weight differs from the raw ratio
                            (truncated, masked or vetoed)
    mask_frac               fraction of loss tokens removed from the mask
    veto_frac               fraction of sequences (with loss tokens) removed by the veto
    ess                     normalized effective sample size (Σw)² / (n·Σw²) over loss tokens
    mismatch_kl_k1          mean(logp_rollout − logp_train): KL(π_rollout‖π_train), k1
    mismatch_kl_k3          mean(ρ − 1 − log ρ), ρ = π_train/π_rollout: the same KL, k3

The trainer calls it with the proximal log-probs (the policy before this update) as
``logp_train`` and the behaviour log-probs as ``logp_rollout``; see ``losses.compute_loss``.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from miles.algorithms.masked import as_bool, finite_checks, masked_max, masked_mean, masked_sum, zero_masked

LOG_RATIO_CLAMP = 20.0
Mode = Literal["tis", "mask"]
Level = Literal["token", "sequence", "geometric"]


def check_finite(name: str, logp: Tensor, mask: Tensor) -> None:
    """Raise ValueError if ``logp`` has NaN/Inf on a loss-carrying token (skipped inside
    ``deferred_finite_checks``)."""
    if not finite_checks():
        return
    bad = as_bool(mask) & ~torch.isfinite(logp)
    if bool(bad.any()):
        where = bad.nonzero()[0].tolist()
        raise ValueError(
            f"{name} has {int(bad.sum())} non-finite log-prob(s) on loss-carrying tokens "
            f"(first at [batch, token] = {where})"
        )


def _check_args(
    logp_train: Tensor, logp_rollout: Tensor, loss_mask: Tensor, mode: str, level: str, low: float | None, high: float
) -> float:
    if logp_train.shape != logp_rollout.shape or logp_train.shape != loss_mask.shape:
        raise ValueError(
            "logp_train, logp_rollout and loss_mask must share one [batch, tokens] shape, got "
            f"{tuple(logp_train.shape)}, {tuple(logp_rollout.shape)}, {tuple(loss_mask.shape)}"
        )
    if logp_train.ndim != 2:
        raise ValueError(f"expected [batch, tokens] tensors, got {logp_train.ndim} dims")
    if mode not in ("tis", "mask"):
        raise ValueError(f"mode must be 'tis' or 'mask', got {mode!r}")
    if level not in ("token", "sequence", "geometric"):
        raise ValueError(f"level must be 'token', 'sequence' or 'geometric', got {level!r}")
    if not high > 0:
        raise ValueError(f"high must be > 0, got {high!r}")
    lo = (0.0 if mode == "tis" else 1.0 / high) if low is None else float(low)
    if not 0.0 <= lo <= high:
        raise ValueError(f"low must be in [0, high={high}], got {low!r}")
    return lo


def importance_weights(
    logp_train: Tensor,
    logp_rollout: Tensor,
    loss_mask: Tensor,
    *,
    mode: Mode,
    level: Level = "token",
    low: float | None = None,
    high: float = 2.0,
    veto: float | None = None,
    stats: dict[str, Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """Importance weights π_train/π_rollout for every token, [batch, tokens] → (weights, mask).

    level: "token" ρ_t = exp(Δ_t); "sequence" exp(Σ_t Δ_t) and "geometric" exp(mean_t Δ_t)
    over the sequence's loss tokens, broadcast to its tokens (Δ = logp_train − logp_rollout,
    clamped to ±20 per token and again after the sum).
    mode "tis": weights = clamp(ρ, low or 0, high), mask unchanged.
    mode "mask": weights = ρ where low ≤ ρ ≤ high else 0 and mask 0; low defaults to 1/high.
    veto: a sequence with any loss token whose *token* ratio is below ``veto`` gets weight 0
    and mask 0 everywhere (either mode).
    Weights are detached and 0 wherever the returned mask is 0; the mask keeps the input's
    dtype. Non-finite log-probs on loss tokens raise ValueError; elsewhere they are ignored.
    """
    lo = _check_args(logp_train, logp_rollout, loss_mask, mode, level, low, high)
    m = as_bool(loss_mask)
    check_finite("logp_train", logp_train, m)
    check_finite("logp_rollout", logp_rollout, m)
    dtype = torch.promote_types(logp_train.dtype, torch.float32)
    lt = zero_masked(logp_train.detach().to(dtype), m)
    lr = zero_masked(logp_rollout.detach().to(dtype), m)
    tok_log_ratio = (lt - lr).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)

    if level == "token":
        log_ratio = tok_log_ratio
    else:
        reduce = masked_sum if level == "sequence" else masked_mean
        seq = reduce(tok_log_ratio, m, dim=1).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        log_ratio = seq[:, None].expand_as(tok_log_ratio)
    ratio = zero_masked(torch.exp(log_ratio), m)

    keep = m.clone()
    vetoed = torch.zeros(m.shape[0], dtype=torch.bool, device=m.device)
    if veto is not None:
        vetoed = (m & (torch.exp(tok_log_ratio) < veto)).any(dim=1)
        keep &= ~vetoed[:, None]
    if mode == "tis":
        weights = ratio.clamp(min=lo, max=high)
    else:
        keep &= (ratio >= lo) & (ratio <= high)
        weights = ratio
    weights = zero_masked(weights, keep)
    out_mask = keep.to(loss_mask.dtype)

    if stats is not None:
        stats.update(_stats(ratio, weights, tok_log_ratio, m, keep, vetoed))
    return weights, out_mask


def importance_weights_with_stats(
    logp_train: Tensor, logp_rollout: Tensor, loss_mask: Tensor, **kwargs
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """``importance_weights`` plus its stats dict, for callers that prefer a 3-tuple."""
    stats: dict[str, Tensor] = {}
    weights, mask = importance_weights(logp_train, logp_rollout, loss_mask, stats=stats, **kwargs)
    return weights, mask, stats


@torch.no_grad()
def _stats(
    ratio: Tensor, weights: Tensor, tok_log_ratio: Tensor, m: Tensor, keep: Tensor, vetoed: Tensor
) -> dict[str, Tensor]:
    n = m.sum().to(ratio.dtype)
    changed = m & ((weights != ratio) | ~keep)
    w_sum = masked_sum(weights, m)
    w_sq = masked_sum(weights * weights, m)
    ess = torch.where(w_sq > 0, w_sum * w_sum / (n * w_sq).clamp(min=1e-30), torch.zeros_like(w_sq))
    has_loss = m.any(dim=1)
    return {
        "ratio_mean": masked_mean(ratio, m),
        "ratio_max": masked_max(ratio, m),
        "clip_frac": masked_mean(changed.to(ratio.dtype), m),
        "mask_frac": masked_mean((m & ~keep).to(ratio.dtype), m),
        "veto_frac": masked_mean(vetoed.to(ratio.dtype), has_loss),
        "ess": ess,
        "mismatch_kl_k1": masked_mean(-tok_log_ratio, m),
        "mismatch_kl_k3": masked_mean(torch.exp(tok_log_ratio) - 1.0 - tok_log_ratio, m),
    }


def loglinear_prox_logp(
    logp_behav: Tensor,
    logp_current: Tensor,
    versions: Tensor,
    *,
    current_version: int,
    prox_version: int | None = None,
) -> Tensor:
    """Approximate log π_prox without a forward pass (AReaL's "loglinear" method).

    Each token was sampled by policy version v_b = ``versions``; the current policy π_θ has
    version v_θ = ``current_version`` and the proximal policy v_p = ``prox_version``
    (default v_θ − 1, AReaL's convention). Assuming log-probs move linearly in the version
    number between v_b and v_θ:

        α = clamp((v_p − v_b) / (v_θ − v_b), 0, 1)   (α = 0 where v_θ ≤ v_b)
        log π_prox ≈ log π_behav + α · (log π_θ − log π_behav)

    so a token sampled by the proximal policy itself (v_b = v_p) keeps its behaviour
    log-prob, and older tokens move toward the current log-prob. ``logp_current`` is
    detached: π_prox is a constant of the loss. Shapes: [batch, tokens] for all three.

    AReaL passes the pre-update trainer version as v_θ. The embedded trainer passes
    v_θ = version + 1 (the version the update will publish) and v_p = version (the weights
    that "recompute" would evaluate), so both methods name the same proximal policy.
    """
    if not (logp_behav.shape == logp_current.shape == versions.shape):
        raise ValueError(
            "logp_behav, logp_current and versions must share one shape, got "
            f"{tuple(logp_behav.shape)}, {tuple(logp_current.shape)}, {tuple(versions.shape)}"
        )
    v_p = current_version - 1 if prox_version is None else prox_version
    v_b = versions.to(torch.float64)
    span = float(current_version) - v_b
    alpha = torch.where(span > 0, (float(v_p) - v_b) / span.clamp(min=1e-12), torch.zeros_like(v_b))
    alpha = alpha.clamp(0.0, 1.0).to(logp_behav.dtype)
    return logp_behav + alpha * (logp_current.detach().to(logp_behav.dtype) - logp_behav)
