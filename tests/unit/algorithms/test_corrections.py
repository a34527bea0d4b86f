"""importance_weights (TIS / MIS / IcePop, levels, veto, stats) and the log-linear
proximal approximation, against hand-computed values."""

import math

import pytest
import torch

from miles.algorithms import importance_weights, importance_weights_with_stats, loglinear_prox_logp

T = torch.tensor
LN = math.log


def _pair(ratios: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """logp_train, logp_rollout whose per-token ratios are ``ratios``."""
    rollout = torch.full((len(ratios), len(ratios[0])), -1.0)
    return rollout + torch.log(T(ratios)), rollout


def test_tis_token_truncates_and_keeps_mask() -> None:
    lt, lr = _pair([[1.0, 3.0, 0.5, 0.1]])
    mask = torch.ones(1, 4, dtype=torch.long)
    w, m = importance_weights(lt, lr, mask, mode="tis", high=2.0)
    torch.testing.assert_close(w, T([[1.0, 2.0, 0.5, 0.1]]))
    assert m.tolist() == [[1, 1, 1, 1]] and m.dtype == mask.dtype
    w, _ = importance_weights(lt, lr, mask, mode="tis", low=0.2, high=2.0)
    torch.testing.assert_close(w, T([[1.0, 2.0, 0.5, 0.2]]))


def test_mask_mode_default_low_is_one_over_high_and_icepop() -> None:
    lt, lr = _pair([[1.0, 3.0, 0.5, 0.1, 4.0]])
    mask = torch.ones(1, 5)
    w, m = importance_weights(lt, lr, mask, mode="mask", high=2.0)  # low = 0.5
    torch.testing.assert_close(w, T([[1.0, 0.0, 0.5, 0.0, 0.0]]))
    assert m.tolist() == [[1.0, 0.0, 1.0, 0.0, 0.0]]
    w, m = importance_weights(lt, lr, mask, mode="mask", low=0.5, high=5.0)  # IcePop
    torch.testing.assert_close(w, T([[1.0, 3.0, 0.5, 0.0, 4.0]]))
    assert m.tolist() == [[1.0, 1.0, 1.0, 0.0, 1.0]]


def test_sequence_and_geometric_levels_use_only_loss_tokens() -> None:
    lt, lr = _pair([[2.0, 3.0, 100.0], [0.5, 1.0, 1.0]])
    lt[0, 2] = float("nan")  # masked-out: must never contribute
    mask = T([[1, 1, 0], [1, 1, 1]])
    w, _ = importance_weights(lt, lr, mask, mode="tis", level="sequence", high=10.0)
    torch.testing.assert_close(w, T([[6.0, 6.0, 0.0], [0.5, 0.5, 0.5]]))
    w, _ = importance_weights(lt, lr, mask, mode="tis", level="geometric", high=10.0)
    g2 = 0.5 ** (1 / 3)
    torch.testing.assert_close(w, T([[math.sqrt(6.0), math.sqrt(6.0), 0.0], [g2, g2, g2]]))
    w, m = importance_weights(lt, lr, mask, mode="mask", level="sequence", high=5.0)
    torch.testing.assert_close(w, T([[0.0, 0.0, 0.0], [0.5, 0.5, 0.5]]))
    assert m.tolist() == [[0, 0, 0], [1, 1, 1]]


def test_veto_masks_the_whole_sequence() -> None:
    lt, lr = _pair([[1.0, 1e-5, 1.0], [1.0, 1.0, 1e-6]])
    mask = T([[1, 1, 1], [1, 1, 0]])  # row 1's tiny ratio is on a masked token: no veto
    w, m = importance_weights(lt, lr, mask, mode="tis", high=2.0, veto=1e-4)
    assert m.tolist() == [[0, 0, 0], [1, 1, 0]]
    torch.testing.assert_close(w, T([[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]]))
    stats: dict = {}
    importance_weights(lt, lr, mask, mode="tis", high=2.0, veto=1e-4, stats=stats)
    assert float(stats["veto_frac"]) == 0.5


def test_log_ratios_are_clamped_before_exp() -> None:
    lt = T([[100.0, -100.0], [30.0, 30.0]])
    lr = torch.zeros(2, 2)
    mask = torch.ones(2, 2)
    w, _ = importance_weights(lt, lr, mask, mode="tis", high=float("inf"))
    torch.testing.assert_close(w[0], T([math.exp(20.0), math.exp(-20.0)]))
    w, _ = importance_weights(lt, lr, mask, mode="tis", level="sequence", high=float("inf"))
    torch.testing.assert_close(w[1], torch.full((2,), math.exp(20.0)))  # 20 + 20 clamped to 20
    assert torch.isfinite(w).all()


def test_stats_hand_computed() -> None:
    lt, lr = _pair([[1.0, 4.0, 0.25, 9.0]])
    mask = T([[1, 1, 1, 0]])
    w, m, stats = importance_weights_with_stats(lt, lr, mask, mode="tis", high=2.0)
    ratios = [1.0, 4.0, 0.25]
    weights = [1.0, 2.0, 0.25]
    assert float(stats["ratio_mean"]) == pytest.approx(sum(ratios) / 3)
    assert float(stats["ratio_max"]) == pytest.approx(4.0)
    assert float(stats["clip_frac"]) == pytest.approx(1 / 3)
    assert float(stats["mask_frac"]) == 0.0
    ess = sum(weights) ** 2 / (3 * sum(x * x for x in weights))
    assert float(stats["ess"]) == pytest.approx(ess)
    logs = [LN(r) for r in ratios]
    assert float(stats["mismatch_kl_k1"]) == pytest.approx(-sum(logs) / 3)
    assert float(stats["mismatch_kl_k3"]) == pytest.approx(sum(r - 1 - x for r, x in zip(ratios, logs)) / 3)
    _, _, mstats = importance_weights_with_stats(lt, lr, mask, mode="mask", high=2.0)
    assert float(mstats["mask_frac"]) == pytest.approx(2 / 3)  # 4.0 > 2 and 0.25 < 0.5
    assert float(mstats["clip_frac"]) == pytest.approx(2 / 3)


def test_all_masked_gives_zero_weights_and_finite_stats() -> None:
    lt = torch.full((2, 3), float("nan"))
    lr = torch.full((2, 3), float("-inf"))
    mask = torch.zeros(2, 3)
    for level in ("token", "sequence", "geometric"):
        for mode in ("tis", "mask"):
            w, m, stats = importance_weights_with_stats(lt, lr, mask, mode=mode, level=level, veto=0.1)
            assert w.eq(0).all() and m.eq(0).all()
            assert all(torch.isfinite(v) for v in stats.values())


def test_one_token_sequences() -> None:
    lt, lr = _pair([[3.0], [0.5]])
    for level in ("token", "sequence", "geometric"):
        w, _ = importance_weights(lt, lr, torch.ones(2, 1), mode="tis", level=level, high=2.0)
        torch.testing.assert_close(w, T([[2.0], [0.5]]))


def test_weights_carry_no_gradient() -> None:
    lt = torch.randn(3, 4, requires_grad=True)
    lr = torch.randn(3, 4)
    for level in ("token", "sequence", "geometric"):
        w, _ = importance_weights(lt, lr, torch.ones(3, 4), mode="tis", level=level)
        assert not w.requires_grad and w.grad_fn is None


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_on_loss_tokens_rejected(bad: float) -> None:
    lt, lr = torch.zeros(2, 3), torch.zeros(2, 3)
    lt[1, 2] = bad
    with pytest.raises(ValueError, match=r"logp_train .*non-finite.*\[1, 2\]"):
        importance_weights(lt, lr, torch.ones(2, 3), mode="tis")
    with pytest.raises(ValueError, match="logp_rollout"):
        importance_weights(lr, lt, torch.ones(2, 3), mode="mask")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mode": "clip"}, "mode"),
        ({"mode": "tis", "level": "seq"}, "level"),
        ({"mode": "tis", "high": 0.0}, "high"),
        ({"mode": "mask", "low": 3.0, "high": 2.0}, "low"),
    ],
)
def test_bad_arguments_rejected(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        importance_weights(torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1, 2), **kwargs)
    with pytest.raises(ValueError, match="shape"):
        importance_weights(torch.zeros(1, 2), torch.zeros(1, 3), torch.ones(1, 2), mode="tis")


def test_loglinear_interpolates_by_version() -> None:
    behav = torch.full((1, 4), -2.0)
    current = torch.full((1, 4), -1.0, requires_grad=True)
    versions = T([[5, 4, 2, 6]])
    prox = loglinear_prox_logp(behav, current, versions, current_version=6)  # v_p = 5
    # α = (5 - v_b) / (6 - v_b): v_b=5 → 0, 4 → 1/2, 2 → 3/4, 6 → 0 (v_θ ≤ v_b)
    torch.testing.assert_close(prox, T([[-2.0, -1.5, -1.25, -2.0]]))
    assert prox.grad_fn is None  # π_θ is detached inside
    # The trainer's convention: v_θ = version + 1, v_p = version (the recompute policy).
    prox = loglinear_prox_logp(behav, current, versions, current_version=6, prox_version=6)
    torch.testing.assert_close(prox, T([[-1.0, -1.0, -1.0, -2.0]]))
    with pytest.raises(ValueError, match="shape"):
        loglinear_prox_logp(behav, current, T([[1, 2]]), current_version=3)
