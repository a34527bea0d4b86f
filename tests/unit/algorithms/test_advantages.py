"""Advantage estimators against hand-computed values, plus their edge cases."""

import math

import pytest
import torch

from miles.algorithms import compute_advantages
from miles.algorithms.advantages import discounted_returns, gae, token_rewards

T = torch.tensor


def test_grpo_normalizes_within_each_group() -> None:
    rewards = T([1.0, 5.0, 0.0, 5.0, 0.0, 1.0, 1.0, 2.0])
    groups = T([3, 9, 3, 9, 3, 3, 9, 9])  # interleaved, arbitrary ids
    adv = compute_advantages("grpo", rewards, groups)
    # group 3: [1, 0, 0, 1] → mean .5, unbiased std sqrt(1/3)
    s3 = math.sqrt(1 / 3) + 1e-6
    # group 9: [5, 5, 1, 2] → mean 3.25, deviations [1.75, 1.75, -2.25, -1.25]
    s9 = math.sqrt((1.75**2 * 2 + 2.25**2 + 1.25**2) / 3) + 1e-6
    expected = [0.5 / s3, 1.75 / s9, -0.5 / s3, 1.75 / s9, -0.5 / s3, 0.5 / s3, -2.25 / s9, -1.25 / s9]
    torch.testing.assert_close(adv, T(expected))
    torch.testing.assert_close(compute_advantages("gspo", rewards, groups), adv)


def test_equal_rewards_and_lone_members_give_exact_zero() -> None:
    rewards = T([0.1, 0.1, 0.1, 0.7, 3.0])
    groups = T([0, 0, 0, 1, 2])
    for name in ("grpo", "dr_grpo", "rloo", "gspo"):
        adv = compute_advantages(name, rewards, groups)
        assert torch.isfinite(adv).all()
        assert adv.tolist()[:3] == [0.0, 0.0, 0.0], name  # exact, not 1e-11 / eps
        assert adv[3].item() == 0.0 and adv[4].item() == 0.0  # groups of one


def test_dr_grpo_and_rloo() -> None:
    rewards = T([1.0, 0.0, 0.0, 2.0])
    groups = T([0, 0, 0, 1])
    torch.testing.assert_close(compute_advantages("dr_grpo", rewards, groups), T([2 / 3, -1 / 3, -1 / 3, 0.0]))
    # RLOO: 1 - mean(0, 0) = 1; 0 - mean(1, 0) = -0.5
    torch.testing.assert_close(compute_advantages("rloo", rewards, groups), T([1.0, -0.5, -0.5, 0.0]))


def test_token_rewards_and_discounting() -> None:
    mask = T([[1, 1, 0, 1, 0], [0, 0, 0, 0, 0], [1, 0, 0, 0, 0]])
    kl = torch.full((3, 5), 0.5)
    tr = token_rewards(T([2.0, 7.0, -1.0]), mask, kl=kl, kl_coef=0.1)
    expected = T([[-0.05, -0.05, 0.0, 1.95, 0.0], [0.0] * 5, [-1.05, 0, 0, 0, 0]])
    torch.testing.assert_close(tr, expected)
    g = discounted_returns(T([[1.0, 2.0, 4.0]]), 0.5)
    torch.testing.assert_close(g, T([[1 + 1 + 1.0, 2 + 2.0, 4.0]]))
    torch.testing.assert_close(discounted_returns(T([[1.0, 2.0, 4.0]]), 1.0), T([[7.0, 6.0, 4.0]]))


def test_reinforce_plus_plus_whitens_returns_over_the_batch() -> None:
    rewards = T([1.0, 0.0])
    mask = T([[1, 1, 0], [1, 0, 0]])  # second row is a one-token sequence
    adv = compute_advantages("reinforce_plus_plus", rewards, T([0, 1]), loss_mask=mask)
    # returns on loss tokens: [1, 1] and [0]; mean 2/3, population std sqrt(2/9)
    std = math.sqrt(2 / 9) + 1e-6
    expected = T([[(1 / 3) / std, (1 / 3) / std, 0.0], [-(2 / 3) / std, 0.0, 0.0]])
    torch.testing.assert_close(adv, expected)
    assert adv.shape == mask.shape


def test_gae_skips_masked_tokens() -> None:
    # row: tokens a, (env), b with reward 1 at b; values [0.5, 9, 0.2]; gamma .9, lam .8
    rewards = token_rewards(T([1.0]), T([[1, 0, 1]]))
    values = T([[0.5, 9.0, 0.2]])
    adv, ret = gae(rewards, values, T([[1, 0, 1]]), gamma=0.9, lam=0.8)
    d_b = 1.0 + 0.9 * 0.0 - 0.2  # last loss token: next value 0
    d_a = 0.0 + 0.9 * 0.2 - 0.5  # next loss token is b, the env token is skipped
    torch.testing.assert_close(adv, T([[d_a + 0.9 * 0.8 * d_b, 0.0, d_b]]))
    torch.testing.assert_close(ret, adv + T([[0.5, 0.0, 0.2]]))


def test_ppo_estimator_whitens_gae() -> None:
    mask = T([[1, 1], [1, 0]])
    values = T([[0.1, 0.2], [0.3, 0.0]])
    adv = compute_advantages("ppo", T([1.0, 0.0]), T([0, 1]), loss_mask=mask, values=values, gamma=1.0, lam=1.0)
    raw, _ = gae(token_rewards(T([1.0, 0.0]), mask), values, mask, gamma=1.0, lam=1.0)
    flat = raw[mask.bool()]
    expected = (flat - flat.mean()) / (flat.std(unbiased=False) + 1e-6)
    torch.testing.assert_close(adv[mask.bool()], expected)
    assert adv[1, 1].item() == 0.0


@pytest.mark.parametrize(
    ("name", "kwargs", "match"),
    [
        ("grpo_x", {}, "unknown advantage estimator"),
        ("ppo", {"loss_mask": torch.ones(2, 3)}, "critic values"),
        ("reinforce_plus_plus", {}, "loss_mask"),
    ],
)
def test_bad_calls_are_rejected(name: str, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        compute_advantages(name, T([1.0, 0.0]), T([0, 0]), **kwargs)


def test_non_finite_rewards_rejected() -> None:
    with pytest.raises(ValueError, match="NaN or Inf"):
        compute_advantages("grpo", T([1.0, float("nan")]), T([0, 0]))
    with pytest.raises(ValueError, match="group_index shape"):
        compute_advantages("grpo", T([1.0, 0.0]), T([0]))
