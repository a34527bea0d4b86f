"""Policy losses and compute_loss against hand-computed values; gradient checks."""

import math

import pytest
import torch

from miles.algorithms import (
    AlgorithmConfig,
    LossDenominators,
    PolicyBatch,
    agg_loss,
    compute_loss,
    kl_estimate,
    ppo_clip_loss,
    sequence_log_ratio,
)

T = torch.tensor
LN = math.log


def test_ppo_clip_asymmetric_and_dual_clip() -> None:
    log_ratio = torch.log(T([0.5, 1.5, 0.5, 1.5, 5.0]))
    adv = T([1.0, 1.0, -1.0, -1.0, -1.0])
    loss, clipped = ppo_clip_loss(log_ratio, adv, eps_clip=0.2, eps_clip_high=0.28)
    torch.testing.assert_close(loss, T([-0.5, -1.28, 0.8, 1.5, 5.0]))
    assert clipped.tolist() == [False, True, True, False, False]
    loss, clipped = ppo_clip_loss(log_ratio, adv, eps_clip=0.2, eps_clip_high=0.28, dual_clip_c=3.0)
    torch.testing.assert_close(loss, T([-0.5, -1.28, 0.8, 1.5, 3.0]))
    assert clipped.tolist() == [False, True, True, False, True]


def test_kl_estimators() -> None:
    logp, ref = T([-1.0]), T([-1.5])
    d = 0.5
    assert kl_estimate(logp, ref, "k1").item() == pytest.approx(d)
    assert kl_estimate(logp, ref, "k2").item() == pytest.approx(d * d / 2)
    assert kl_estimate(logp, ref, "k3").item() == pytest.approx(math.exp(-d) - 1 + d)
    with pytest.raises(ValueError, match="k4"):
        kl_estimate(logp, ref, "k4")


def test_aggregations() -> None:
    v = T([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [9.0, 9.0, 9.0]])
    mask = T([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    assert agg_loss(v, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert agg_loss(v, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert agg_loss(v, mask, "seq-mean-token-sum-norm").item() == pytest.approx(10 / (3 * 2))
    assert agg_loss(v, mask, "seq-mean-token-sum-norm", max_tokens=10).item() == pytest.approx(10 / 20)
    # norm_mask: dropped tokens still count in the denominators
    eff = T([[1, 0, 1], [1, 0, 0], [0, 0, 0]])
    assert agg_loss(v, eff, "token-mean", norm_mask=mask).item() == pytest.approx(8 / 4)
    assert agg_loss(v, eff, "seq-mean-token-mean", norm_mask=mask).item() == pytest.approx((4 / 3 + 4) / 2)
    with pytest.raises(ValueError, match="aggregation"):
        agg_loss(v, mask, "sum")


def test_sequence_log_ratio_is_the_masked_mean() -> None:
    lr = T([[0.3, 0.6, 100.0], [0.9, 0.0, 0.0]])
    out = sequence_log_ratio(lr, T([[1, 1, 0], [1, 0, 0]]))
    torch.testing.assert_close(out, T([[0.45] * 3, [0.9] * 3]))


def _batch(**kw) -> PolicyBatch:
    logp = torch.log(T([[0.5, 0.25, 0.5], [0.2, 0.4, 0.1]])).requires_grad_()
    base = dict(
        logp=logp,
        logp_rollout=torch.log(T([[0.5, 0.5, 0.5], [0.4, 0.4, 0.4]])),
        logp_prox=logp.detach().clone(),
        advantages=T([1.0, -2.0]),
        loss_mask=T([[1, 1, 0], [1, 1, 1]]),
    )
    base.update(kw)
    return PolicyBatch(**base)


def test_on_prox_policy_loss_is_minus_mean_advantage() -> None:
    cfg = AlgorithmConfig(loss_agg="token-mean")
    loss, metrics = compute_loss(_batch(), cfg)
    assert loss.item() == pytest.approx(-(1 + 1 - 2 - 2 - 2) / 5)
    assert metrics["train/clip_frac"].item() == 0.0
    # the mismatch π_prox vs π_behav is reported even without a correction
    k1 = -(0 + LN(0.25 / 0.5) + LN(0.2 / 0.4) + 0 + LN(0.1 / 0.4)) / 5
    assert metrics["train/mismatch_kl_k1"].item() == pytest.approx(k1)
    assert metrics["train/tis_ratio_max"].item() == pytest.approx(1.0)
    assert metrics["train/loss"].item() == loss.item()


def test_tis_and_decoupled_weights() -> None:
    # token ratios π_prox/π_behav: row0 [1, .5, -], row1 [.5, 1, .25]
    b = _batch()
    loss, _ = compute_loss(b, AlgorithmConfig(loss_agg="token-mean", use_decoupled_loss=True))
    assert loss.item() == pytest.approx(-(1 * 1 + 0.5 * 1 - 2 * (0.5 + 1 + 0.25)) / 5)
    cfg = AlgorithmConfig(loss_agg="token-mean", use_tis=True, tis_clip=2.0, tis_clip_low=0.4)
    loss, m = compute_loss(b, cfg)
    assert loss.item() == pytest.approx(-(1 + 0.5 - 2 * (0.5 + 1 + 0.4)) / 5)
    assert m["train/tis_clip_frac"].item() == pytest.approx(1 / 5)
    # MIS: ratios outside [1/2.5, 2.5] are dropped but still count in the token mean
    cfg = AlgorithmConfig(loss_agg="token-mean", use_tis=True, tis_mode="mask", tis_clip=2.5)
    loss, m = compute_loss(b, cfg)
    assert loss.item() == pytest.approx(-(1 + 0.5 - 2 * (0.5 + 1)) / 5)
    assert m["train/tis_mask_frac"].item() == pytest.approx(1 / 5)


def test_ratio_clip_uses_the_proximal_policy() -> None:
    b = _batch(logp_prox=torch.log(T([[0.25, 0.25, 0.5], [0.4, 0.4, 0.1]])))
    loss, m = compute_loss(b, AlgorithmConfig(loss_agg="token-mean", eps_clip=0.2))
    # ratios π_θ/π_prox: row0 [2, 1], row1 [.5, 1, 1]; A=+1 → clip 2 to 1.2; A=-2 → .5 to .8
    assert loss.item() == pytest.approx(-(1.2 + 1 - 2 * (0.8 + 1 + 1)) / 5)
    assert m["train/clip_frac"].item() == pytest.approx(2 / 5)


def test_gspo_uses_the_sequence_ratio() -> None:
    b = _batch(logp_prox=torch.log(T([[0.25, 0.25, 0.5], [0.2, 0.4, 0.1]])))
    cfg = AlgorithmConfig(advantage_estimator="gspo", loss_agg="seq-mean-token-mean", eps_clip=0.5)
    loss, _ = compute_loss(b, cfg)
    s0 = math.sqrt(2.0)  # geometric mean of [2, 1]
    assert loss.item() == pytest.approx((-min(s0, 1.5) + 2 * 1.0) / 2)


def test_loglinear_needs_versions_and_uses_them() -> None:
    cfg = AlgorithmConfig(loss_agg="token-mean", prox_logp="loglinear", use_decoupled_loss=True)
    with pytest.raises(ValueError, match="loglinear"):
        compute_loss(_batch(logp_prox=None), cfg)
    versions = T([[3, 3, 3], [2, 2, 2]])
    # trainer at version 3: row0 tokens from v3 → π_prox = π_behav (α = 0);
    # row1 from v2 → α = (3-2)/(4-2) = 1/2: log π_prox = (log π_behav + log π_θ)/2
    loss, _ = compute_loss(_batch(logp_prox=None, versions=versions), cfg, trainer_version=3)
    r0 = [0.5 / 0.5, 0.25 / 0.5]  # π_θ/π_prox (weight π_prox/π_behav = 1)
    prox1 = [math.sqrt(p * q) for p, q in zip([0.2, 0.4, 0.1], [0.4, 0.4, 0.4])]
    u1 = [p / q for p, q in zip([0.2, 0.4, 0.1], prox1)]
    w1 = [q / 0.4 for q in prox1]
    assert all(u <= 1.0 for u in u1)
    pg1 = [2 * max(u, 0.8) * w for u, w in zip(u1, w1)]  # A = -2: max(-A u, -A clip(u))
    pg0 = [-r if r <= 1.2 else -1.2 for r in r0]  # A = +1, none clipped low: max(-r, -clip(r))
    pg0[1] = max(-r0[1], -0.8)
    expected = (sum(pg0) + sum(pg1)) / 5
    assert loss.item() == pytest.approx(expected)


def test_recompute_requires_prox() -> None:
    with pytest.raises(ValueError, match="logp_prox"):
        compute_loss(_batch(logp_prox=None), AlgorithmConfig())


def test_entropy_and_kl_terms() -> None:
    ent = T([[1.0, 2.0, 5.0], [0.5, 0.5, 0.5]], requires_grad=True)
    ref = torch.log(T([[0.5, 0.5, 0.5], [0.2, 0.2, 0.2]]))
    b = _batch(entropy=ent, logp_ref=ref)
    base, _ = compute_loss(_batch(), AlgorithmConfig(loss_agg="token-mean"))
    cfg = AlgorithmConfig(loss_agg="token-mean", entropy_coef=0.1, kl_coef=0.5, kl_type="k1")
    loss, m = compute_loss(b, cfg)
    h = (1 + 2 + 0.5 * 3) / 5
    kl = (0 + LN(0.5) + 0 + LN(2) + LN(0.5)) / 5
    assert loss.item() == pytest.approx(base.item() - 0.1 * h + 0.5 * kl)
    assert m["train/entropy"].item() == pytest.approx(h)
    assert m["train/kl"].item() == pytest.approx(kl)
    loss.backward()
    assert ent.grad[0, 2].item() == 0.0 and ent.grad[0, 0].item() == pytest.approx(-0.1 / 5)
    with pytest.raises(ValueError, match="logp_ref"):
        compute_loss(_batch(), AlgorithmConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="entropy"):
        compute_loss(_batch(), AlgorithmConfig(entropy_coef=0.1))


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batches_sum_to_the_batch_loss(agg: str) -> None:
    torch.manual_seed(0)
    logp = -torch.rand(4, 5) * 2
    b = PolicyBatch(
        logp=logp, logp_rollout=logp - 0.1 * torch.randn(4, 5), logp_prox=logp + 0.05,
        advantages=torch.randn(4), loss_mask=(torch.rand(4, 5) > 0.3).long(),
    )
    cfg = AlgorithmConfig(loss_agg=agg, use_tis=True)
    whole, _ = compute_loss(b, cfg)
    den = LossDenominators.of(b.loss_mask)
    parts = 0.0
    for rows in (slice(0, 1), slice(1, 4)):
        part = PolicyBatch(**{k: getattr(b, k)[rows] if getattr(b, k) is not None else None
                              for k in b.__dataclass_fields__})
        parts += compute_loss(part, cfg, denominators=den)[0].item()
    assert parts == pytest.approx(whole.item(), rel=1e-6)


@pytest.mark.parametrize("cfg", [
    AlgorithmConfig(),
    AlgorithmConfig(use_tis=True, tis_level="sequence"),
    AlgorithmConfig(use_decoupled_loss=True, advantage_estimator="gspo"),
    AlgorithmConfig(use_tis=True, tis_mode="mask", loss_agg="token-mean", dual_clip_c=3.0),
])
def test_all_masked_gives_zero_loss_and_zero_grad(cfg: AlgorithmConfig) -> None:
    logp = torch.full((2, 3), float("nan"), requires_grad=True)
    b = PolicyBatch(logp=logp, logp_rollout=torch.zeros(2, 3), logp_prox=torch.zeros(2, 3),
                    advantages=T([1.0, -1.0]), loss_mask=torch.zeros(2, 3), logp_ref=torch.zeros(2, 3))
    loss, metrics = compute_loss(b, cfg)
    assert loss.item() == 0.0
    loss.backward()
    assert logp.grad.eq(0).all()
    assert all(torch.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("cfg", [
    AlgorithmConfig(use_tis=True, kl_coef=0.1, kl_type="k3"),
    AlgorithmConfig(use_decoupled_loss=True, advantage_estimator="gspo", loss_agg="token-mean"),
    AlgorithmConfig(use_tis=True, tis_level="geometric", loss_agg="seq-mean-token-sum-norm"),
])
def test_masked_tokens_get_exactly_zero_gradient(cfg: AlgorithmConfig) -> None:
    torch.manual_seed(1)
    raw = -torch.rand(3, 4)
    mask = T([[1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 1, 1]])
    raw[mask == 0] = float("-inf")  # padding log-probs may be garbage
    logp = raw.clone().requires_grad_()
    b = PolicyBatch(logp=logp, logp_rollout=raw.detach() - 0.1, logp_prox=raw.detach() + 0.05,
                    advantages=T([1.0, -0.5, 2.0]), loss_mask=mask, logp_ref=raw.detach() * 1.1)
    loss, _ = compute_loss(b, cfg)
    loss.backward()
    assert torch.isfinite(logp.grad).all()
    assert logp.grad[mask == 0].eq(0).all()
    assert logp.grad[mask == 1].ne(0).any()


def test_one_token_sequences() -> None:
    logp = torch.log(T([[0.5], [0.25]])).requires_grad_()
    b = PolicyBatch(logp=logp, logp_rollout=logp.detach(), logp_prox=logp.detach(),
                    advantages=T([1.0, -1.0]), loss_mask=torch.ones(2, 1))
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        loss, _ = compute_loss(b, AlgorithmConfig(loss_agg=agg, advantage_estimator="gspo"))
        assert loss.item() == pytest.approx(0.0)


def test_non_finite_inputs_on_loss_tokens_rejected() -> None:
    for field in ("logp", "logp_rollout", "logp_prox"):
        b = _batch()
        t = getattr(b, field).detach().clone()
        t[1, 1] = float("nan")
        setattr(b, field, t)
        with pytest.raises(ValueError, match="non-finite"):
            compute_loss(b, AlgorithmConfig())
    with pytest.raises(ValueError, match="advantages"):
        compute_loss(_batch(advantages=torch.ones(3)), AlgorithmConfig())


def test_deferred_finite_checks_leave_the_check_to_the_caller() -> None:
    # the embedded trainer checks finiteness once per step on the device; inside the
    # context a non-finite input gives a non-finite loss instead of a ValueError (a device
    # read per call), and the checks are back on after it
    from miles.algorithms.masked import deferred_finite_checks

    b = _batch()
    t = b.logp_rollout.detach().clone()
    t[1, 1] = float("nan")
    b.logp_rollout = t
    config = AlgorithmConfig(use_tis=True)
    with deferred_finite_checks():
        loss, _ = compute_loss(b, config)
    assert not torch.isfinite(loss)
    with pytest.raises(ValueError, match="non-finite"):
        compute_loss(b, config)


def test_gradient_is_weight_times_policy_gradient() -> None:
    # prox = π_θ (first step on the batch): d loss / d logp_t = -A_t w_t / N exactly, i.e. no
    # gradient flows through the TIS weights w_t = clamp(π_θ/π_behav, 0, 2).
    logp = torch.log(T([[0.5, 0.25, 0.9]])).requires_grad_()
    behav = torch.log(T([[0.2, 0.5, 0.3]]))
    b = PolicyBatch(logp=logp, logp_rollout=behav, logp_prox=logp.detach(),
                    advantages=T([[1.0, -1.0, 2.0]]), loss_mask=torch.ones(1, 3))
    loss, _ = compute_loss(b, AlgorithmConfig(loss_agg="token-mean", use_tis=True, tis_clip=2.0))
    loss.backward()
    w = [2.0, 0.5, 2.0]
    torch.testing.assert_close(logp.grad, T([[-1.0 * w[0] / 3, 1.0 * w[1] / 3, -2.0 * w[2] / 3]]))
