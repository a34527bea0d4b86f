"""Advantage estimators: pure tensor functions of rewards (and values for GAE).

``compute_advantages(name, rewards, group_index, ...)`` is the entry the trainer calls; each
estimator is also a small public function. Shapes:

- ``rewards``: [N] float, one scalar reward per sequence;
- ``group_index``: [N] int, which prompt group each sequence belongs to (any integers; equal
  values = same group);
- ``loss_mask``: [N, T] 0/1 over response tokens (needed by the token-level estimators);
- result: [N] per sequence for ``grpo``, ``dr_grpo``, ``rloo`` and ``gspo`` (the trainer
  broadcasts it over the sequence's loss tokens); [N, T] per token, zero where
  ``loss_mask`` is 0, for ``reinforce_plus_plus`` and ``ppo``.

Group statistics follow slime by default: the GRPO std is the unbiased (Bessel) std of the
group plus eps = 1e-6 (``--grpo-std-eps``; TRL uses 1e-4); ``--grpo-std-level batch`` takes
the std over the whole batch instead (TRL's ``scale_rewards="batch"``), and
``--no-grpo-std-unbiased`` the population std. A group of one sequence has std 0 and
advantage 0. A group whose rewards are all equal gets advantage exactly 0 (no NaN).
"""

from __future__ import annotations

import torch
from torch import Tensor

from miles.algorithms.masked import as_bool, masked_whiten, zero_masked

GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "gspo")
TOKEN_ESTIMATORS = ("reinforce_plus_plus", "ppo")
STD_EPS = 1e-6


def _group_stats(
    rewards: Tensor, group_index: Tensor, *, unbiased: bool = True
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Per-sequence (group sum, count, mean, std, whether all rewards are equal)."""
    _, inverse = torch.unique(group_index, return_inverse=True)
    num_groups = int(inverse.max().item()) + 1 if inverse.numel() else 0
    r = rewards.to(torch.float64)  # group moments in double: exact zeros for equal rewards
    sums = torch.zeros(num_groups, dtype=r.dtype, device=r.device).index_add_(0, inverse, r)
    counts = torch.zeros(num_groups, dtype=r.dtype, device=r.device).index_add_(
        0, inverse, torch.ones_like(r)
    )
    mean = sums / counts
    sq = torch.zeros_like(sums).index_add_(0, inverse, (r - mean[inverse]) ** 2)
    dof = (counts - 1).clamp(min=1) if unbiased else counts
    std = torch.where(counts > 1, (sq / dof).sqrt(), torch.zeros_like(sq))
    # Floating-point means of equal rewards need not equal the rewards (0.1·3/3 != 0.1), and
    # GRPO divides by std + eps: force exact zeros for constant groups instead.
    lo = torch.full_like(sums, float("inf")).scatter_reduce(0, inverse, r, "amin")
    hi = torch.full_like(sums, float("-inf")).scatter_reduce(0, inverse, r, "amax")
    constant = lo == hi
    return sums[inverse], counts[inverse], mean[inverse], std[inverse], constant[inverse]


def grpo_advantages(
    rewards: Tensor, group_index: Tensor, *, eps: float = STD_EPS, level: str = "group", unbiased: bool = True
) -> Tensor:
    """GRPO: (r - mean_group) / (std + eps), std of the group or (``level="batch"``) of
    the whole batch, with Bessel's correction unless ``unbiased`` is False. [N]"""
    _, _, mean, std, constant = _group_stats(rewards, group_index, unbiased=unbiased)
    if level == "batch":
        r = rewards.to(torch.float64)
        n = r.numel()
        batch_std = r.std(correction=1 if unbiased else 0) if n > 1 else r.new_zeros(())
        std = batch_std.expand_as(r)
    elif level != "group":
        raise ValueError(f"std level must be 'group' or 'batch', got {level!r}")
    adv = (rewards.to(torch.float64) - mean) / (std + eps)
    return torch.where(constant, torch.zeros_like(adv), adv).to(rewards.dtype)


def dr_grpo_advantages(rewards: Tensor, group_index: Tensor) -> Tensor:
    """Dr. GRPO: r - mean_group, without the std normalization. [N]"""
    _, _, mean, _, constant = _group_stats(rewards, group_index)
    adv = rewards.to(torch.float64) - mean
    return torch.where(constant, torch.zeros_like(adv), adv).to(rewards.dtype)


def rloo_advantages(rewards: Tensor, group_index: Tensor) -> Tensor:
    """RLOO: r_i - mean of the *other* members of the group. A lone sequence gets 0. [N]"""
    sums, counts, _, _, constant = _group_stats(rewards, group_index)
    r = rewards.to(torch.float64)
    baseline = (sums - r) / (counts - 1).clamp(min=1)
    adv = torch.where((counts > 1) & ~constant, r - baseline, torch.zeros_like(r))
    return adv.to(rewards.dtype)


def token_rewards(
    rewards: Tensor, loss_mask: Tensor, *, kl: Tensor | None = None, kl_coef: float = 0.0
) -> Tensor:
    """[N, T]: the scalar reward on each sequence's last loss token, minus kl_coef·kl on
    every loss token (REINFORCE++ / PPO reward shaping). Sequences without loss tokens get 0."""
    mask = as_bool(loss_mask)
    n, t = mask.shape
    out = torch.zeros(n, t, dtype=rewards.dtype, device=rewards.device)
    if kl is not None and kl_coef != 0.0:
        out = out - kl_coef * zero_masked(kl.to(rewards.dtype), mask)
    positions = torch.arange(t, device=mask.device).expand(n, t)
    last = torch.where(mask, positions, torch.full_like(positions, -1)).max(dim=1).values
    has = last >= 0
    rows = torch.arange(n, device=mask.device)[has]
    out[rows, last[has]] += rewards[has]
    return out


def discounted_returns(rewards: Tensor, gamma: float) -> Tensor:
    """G_t = sum_{s >= t} gamma^(s-t) r_s along the last dim."""
    if gamma == 1.0:
        return rewards.flip(-1).cumsum(-1).flip(-1)
    out = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[..., 0])
    for t in range(rewards.shape[-1] - 1, -1, -1):
        running = rewards[..., t] + gamma * running
        out[..., t] = running
    return out


def reinforce_plus_plus_advantages(
    rewards: Tensor,
    loss_mask: Tensor,
    *,
    kl: Tensor | None = None,
    kl_coef: float = 0.0,
    gamma: float = 1.0,
    eps: float = STD_EPS,
) -> Tensor:
    """REINFORCE++: discounted returns of the (KL-shaped) token rewards, whitened over every
    loss token of the batch (global batch normalization). [N, T]"""
    shaped = token_rewards(rewards, loss_mask, kl=kl, kl_coef=kl_coef)
    returns = discounted_returns(shaped, gamma)
    return masked_whiten(returns, loss_mask, eps)


def gae(
    token_level_rewards: Tensor, values: Tensor, loss_mask: Tensor, *, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation over the loss tokens of each row.

    Masked positions (prompt padding, environment-written tokens) are skipped: the "next"
    state of a loss token is the next loss token of the same row, and the value after the
    last one is 0. Returns (advantages, returns), both [N, T] and zero where masked.
    """
    mask = as_bool(loss_mask)
    r = zero_masked(token_level_rewards, mask)
    v = zero_masked(values.to(r.dtype), mask)
    adv = torch.zeros_like(r)
    next_value = torch.zeros_like(r[:, 0])
    last_gae = torch.zeros_like(r[:, 0])
    for t in range(r.shape[1] - 1, -1, -1):
        m = mask[:, t]
        delta = r[:, t] + gamma * next_value - v[:, t]
        cur = delta + gamma * lam * last_gae
        adv[:, t] = torch.where(m, cur, torch.zeros_like(cur))
        last_gae = torch.where(m, cur, last_gae)
        next_value = torch.where(m, v[:, t], next_value)
    return adv, zero_masked(adv + v, mask)


def ppo_advantages(
    rewards: Tensor,
    values: Tensor,
    loss_mask: Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
    kl: Tensor | None = None,
    kl_coef: float = 0.0,
    whiten: bool = True,
    eps: float = STD_EPS,
) -> Tensor:
    """PPO's GAE advantages from scalar rewards and critic values [N, T] (whitened over the
    batch's loss tokens by default, as verl/OpenRLHF do). [N, T]"""
    shaped = token_rewards(rewards, loss_mask, kl=kl, kl_coef=kl_coef)
    adv, _ = gae(shaped, values, loss_mask, gamma=gamma, lam=lam)
    return masked_whiten(adv, loss_mask, eps) if whiten else adv


def compute_advantages(
    name: str,
    rewards: Tensor,
    group_index: Tensor,
    *,
    loss_mask: Tensor | None = None,
    values: Tensor | None = None,
    kl: Tensor | None = None,
    kl_coef: float = 0.0,
    gamma: float = 1.0,
    lam: float = 1.0,
    std_eps: float = STD_EPS,
    std_level: str = "group",
    std_unbiased: bool = True,
) -> Tensor:
    """Advantages for estimator ``name`` (an ``AlgorithmConfig.advantage_estimator`` value).
    ``std_*`` shape GRPO's / GSPO's normalisation (see ``grpo_advantages``).

    [N] for grpo / dr_grpo / rloo / gspo; [N, T] for reinforce_plus_plus (needs
    ``loss_mask``; ``kl`` [N, T] with ``kl_coef`` > 0 folds a KL penalty into the reward)
    and ppo (needs ``loss_mask`` and critic ``values`` [N, T]).
    """
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be [N], got shape {tuple(rewards.shape)}")
    if group_index.shape != rewards.shape:
        raise ValueError(
            f"group_index shape {tuple(group_index.shape)} != rewards shape {tuple(rewards.shape)}"
        )
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards contain NaN or Inf")
    if not rewards.is_floating_point():
        rewards = rewards.float()
    if name in ("grpo", "gspo"):
        return grpo_advantages(rewards, group_index, eps=std_eps, level=std_level, unbiased=std_unbiased)
    if name == "dr_grpo":
        return dr_grpo_advantages(rewards, group_index)
    if name == "rloo":
        return rloo_advantages(rewards, group_index)
    if name not in TOKEN_ESTIMATORS:
        raise ValueError(
            f"unknown advantage estimator {name!r}; expected one of {list(GROUP_ESTIMATORS + TOKEN_ESTIMATORS)}"
        )
    if loss_mask is None or loss_mask.ndim != 2 or loss_mask.shape[0] != rewards.shape[0]:
        raise ValueError(f"{name} needs loss_mask of shape [N, T] with N = {rewards.shape[0]}")
    if name == "reinforce_plus_plus":
        return reinforce_plus_plus_advantages(rewards, loss_mask, kl=kl, kl_coef=kl_coef, gamma=gamma)
    if values is None or values.shape != loss_mask.shape:
        raise ValueError("ppo needs critic values of the same [N, T] shape as loss_mask")
    return ppo_advantages(rewards, values, loss_mask, gamma=gamma, lam=lam, kl=kl, kl_coef=kl_coef)
