"""GRPO's normalisation knobs against TRL's formulas written out here: the eps, the std
over the group or the batch, Bessel's correction; TRL's loss_type names for --loss-agg."""

from __future__ import annotations

import pytest
import torch

from miles.algorithms import AlgorithmConfig, AlgorithmConfigError, compute_advantages
from miles.config import default_config

R = torch.tensor([1.0, 0.0, 0.0, 0.5, 0.0, 1.0, 1.0, 1.0], dtype=torch.float64)
G = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])


def _trl(rewards, group_size, *, level, eps, unbiased):
    """TRL GRPOTrainer's advantage (scale_rewards="group" | "batch"), torch.std(correction=·)."""
    grouped = rewards.view(-1, group_size)
    mean = grouped.mean(dim=1).repeat_interleave(group_size)
    c = 1 if unbiased else 0
    std = grouped.std(dim=1, correction=c).repeat_interleave(group_size) if level == "group" else rewards.std(correction=c)
    return (rewards - mean) / (std + eps)


@pytest.mark.parametrize("level", ["group", "batch"])
@pytest.mark.parametrize("unbiased", [True, False])
@pytest.mark.parametrize("eps", [1e-6, 1e-4, 0.5])
def test_matches_trl(level, unbiased, eps) -> None:
    got = compute_advantages("grpo", R, G, std_eps=eps, std_level=level, std_unbiased=unbiased)
    torch.testing.assert_close(got, _trl(R, 4, level=level, eps=eps, unbiased=unbiased))


def test_defaults_are_slime_and_knobs_change_the_result() -> None:
    cfg = AlgorithmConfig()
    assert (cfg.grpo_std_eps, cfg.grpo_std_level, cfg.grpo_std_unbiased) == (1e-6, "group", True)
    base = compute_advantages("grpo", R, G)
    torch.testing.assert_close(base, _trl(R, 4, level="group", eps=1e-6, unbiased=True))
    assert not torch.allclose(base, compute_advantages("grpo", R, G, std_level="batch"))
    assert not torch.allclose(base, compute_advantages("grpo", R, G, std_unbiased=False))
    # a constant group stays exactly 0 at either level
    const = compute_advantages("grpo", torch.tensor([1.0, 1.0, 0.0, 1.0]), torch.tensor([0, 0, 1, 1]), std_level="batch")
    assert const[:2].tolist() == [0.0, 0.0] and const[2] < 0 < const[3]


def test_flags_and_loss_agg_names() -> None:
    cfg = default_config(grpo_std_eps=1e-4, grpo_std_level="batch", grpo_std_unbiased=False, loss_agg="dr_grpo")
    a = cfg.algorithm
    assert (a.grpo_std_eps, a.grpo_std_level, a.grpo_std_unbiased, a.loss_agg) == (1e-4, "batch", False, "seq-mean-token-sum-norm")
    for trl, ours in (("grpo", "seq-mean-token-mean"), ("bnpo", "token-mean"), ("dapo", "token-mean")):
        assert AlgorithmConfig(loss_agg=trl).loss_agg == ours
    with pytest.raises(AlgorithmConfigError, match="grpo_std_eps"):
        AlgorithmConfig(grpo_std_eps=-1.0)
    from miles.config import build_parser

    ns = build_parser().parse_args(["--grpo-std-level", "batch", "--no-grpo-std-unbiased", "--grpo-std-eps", "1e-4"])
    assert (ns.grpo_std_level, ns.grpo_std_unbiased, ns.grpo_std_eps) == ("batch", False, 1e-4)
