"""EmbeddedTrainer end to end on a tiny model (CPU, float32)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import miles.trainers.step as rl_step  # the train step calls compute_loss
from miles.algorithms import AlgorithmConfig
from miles.models import token_logprobs
from miles.protocols import TrainerBackend
from miles.trainers import EmbeddedTrainer, NonFiniteError, TrainerConfig
from miles.types import TrajectoryError
from tests.unit.trainers.conftest import make_model, make_traj, random_groups, set_behaviour


def _trainer(model=None, algo: AlgorithmConfig | None = None, **cfg) -> EmbeddedTrainer:
    cfg.setdefault("lr", 1e-2)
    return EmbeddedTrainer(model or make_model(), config=TrainerConfig(**cfg), algo=algo or AlgorithmConfig())


def _weights(tr: EmbeddedTrainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in tr.model.state_dict().items()}


def test_satisfies_the_protocol() -> None:
    assert isinstance(_trainer(), TrainerBackend)


def test_training_raises_logprob_of_rewarded_responses() -> None:
    tr = _trainer(algo=AlgorithmConfig(eps_clip_high=0.28))
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    groups = [[make_traj(f"g{i}good", i, p, [40, 41, 42], 1.0), make_traj(f"g{i}bad", i, p, [50, 51], 0.0)]
              for i, p in enumerate(prompts)]
    good = [g[0] for g in groups]
    bad = [g[1] for g in groups]
    before_good = [sum(x) for x in tr.compute_logprobs(good)]
    before_bad = [sum(x) for x in tr.compute_logprobs(bad)]
    for _ in range(5):
        set_behaviour(tr, groups)
        m = tr.train_step(groups)
        assert m["train/skipped_steps"] == 0.0
    after_good = [sum(x) for x in tr.compute_logprobs(good)]
    after_bad = [sum(x) for x in tr.compute_logprobs(bad)]
    assert all(a > b for a, b in zip(after_good, before_good))
    assert all(a < b for a, b in zip(after_bad, before_bad))
    assert tr.version == 5 and m["train/version"] == 5.0 and m["train/optimizer_steps"] == 5.0


def test_metrics_are_path_named_and_finite(groups) -> None:
    tr = _trainer(algo=AlgorithmConfig(use_tis=True))
    set_behaviour(tr, groups, shift=-0.1)
    m = tr.train_step(groups)
    for key in ("train/pg_loss", "train/clip_frac", "train/tis_clip_frac", "train/tis_ratio_mean",
                "train/tis_ratio_max", "train/tis_ess", "train/mismatch_kl_k1", "train/mismatch_kl_k3",
                "train/entropy", "train/grad_norm", "train/lr", "train/tokens", "train/staleness_mean",
                "train/staleness_max"):
        assert key in m, key
    assert all(k.startswith(("train/", "mem/")) for k in m)
    assert all(isinstance(v, float) and v == v for v in m.values())
    # behaviour log-probs 0.1 below the trainer's: ratio e^0.1 everywhere, k1 = -0.1
    assert m["train/tis_ratio_max"] == pytest.approx(torch.e ** 0.1, rel=1e-4)
    assert m["train/mismatch_kl_k1"] == pytest.approx(-0.1, abs=1e-4)
    assert m["train/tokens"] == sum(t.num_loss_tokens for g in groups for t in g)


def test_compute_logprobs_matches_model_forward_with_temperature() -> None:
    tr = _trainer(rollout_temperature=0.7)
    t = make_traj("a", 0, [5, 6, 7], [30, 31, 32, 33])
    (lp,) = tr.compute_logprobs([t])
    ids = torch.tensor([t.prompt_tokens + t.response_tokens])
    with torch.no_grad():
        logits = tr.model(ids).logits[0, 2:-1]
    ref = token_logprobs(logits, torch.tensor(t.response_tokens), 0.7)
    assert torch.allclose(torch.tensor(lp), ref, atol=1e-5)
    assert tr.compute_logprobs([]) == []


def test_masked_tokens_get_zero_gradient_through_the_trainer(groups, monkeypatch) -> None:
    groups[0][0] = make_traj("env", 0, [5, 6], [20, 21, 22, 23, 24], 1.0, env=(1, 2, 4))
    captured = []
    real = rl_step.compute_loss

    def spy(pb, *a, **kw):
        pb.logp.retain_grad()
        captured.append(pb)
        return real(pb, *a, **kw)

    monkeypatch.setattr(rl_step, "compute_loss", spy)
    tr = _trainer()
    set_behaviour(tr, groups, shift=0.05)
    tr.train_step(groups)
    assert captured
    for pb in captured:
        grad = pb.logp.grad
        assert grad[pb.loss_mask == 0].eq(0).all()
        assert grad[pb.loss_mask == 1].ne(0).any()


def test_masked_token_contents_do_not_change_the_update(groups) -> None:
    # The last response token is env-written: its id and behaviour log-prob must not matter.
    def run(last_token: int, last_logprob: float) -> dict[str, torch.Tensor]:
        gs = copy.deepcopy(groups)
        t = make_traj("env", 0, [5, 6], [20, 21, last_token], 1.0, env=(2,))
        gs[0][0] = t
        tr = _trainer()
        set_behaviour(tr, gs)
        t.logprobs[2] = last_logprob
        tr.train_step(gs)
        return _weights(tr)

    a, b = run(22, 0.0), run(99, float("nan"))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_micro_batching_matches_one_batch(groups) -> None:
    # Compare the accumulated gradients (Adam's normalisation would amplify round-off).
    def run(**kw) -> list[torch.Tensor]:
        tr = _trainer(**kw)
        set_behaviour(tr, groups, shift=-0.05)
        grads: list[torch.Tensor] = []
        step = tr.optimizer.step

        def spy(*a, **k):
            grads.extend(p.grad.clone() for p in tr.model.parameters())
            return step(*a, **k)

        tr.optimizer.step = spy
        tr.train_step(groups)
        return grads

    whole = run()
    for kw in ({"micro_batch_size": 1}, {"max_tokens_per_micro_batch": 24}):
        parts = run(**kw)
        assert len(parts) == len(whole)
        for a, b in zip(parts, whole):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("algo", [
    AlgorithmConfig(use_decoupled_loss=True, prox_logp="recompute"),
    AlgorithmConfig(use_decoupled_loss=True, prox_logp="loglinear", use_tis=True, tis_mode="mask"),
    AlgorithmConfig(advantage_estimator="gspo", eps_clip=3e-4, eps_clip_high=4e-4),
    AlgorithmConfig(advantage_estimator="reinforce_plus_plus", loss_agg="token-mean"),
    AlgorithmConfig(advantage_estimator="rloo", entropy_coef=0.01, loss_agg="seq-mean-token-sum-norm"),
])
def test_several_optimizer_steps_per_rollout(groups, algo: AlgorithmConfig) -> None:
    tr = _trainer(algo=algo, num_steps_per_rollout=2, micro_batch_size=3)
    set_behaviour(tr, groups, shift=-0.02)
    for t in groups[1]:  # one group sampled two versions ago → stale tokens
        t.versions = [0] * len(t.versions)
    tr._version = 2
    m = tr.train_step(groups)
    assert m["train/optimizer_steps"] == 2.0 and tr.version == 3
    assert m["train/staleness_max"] == 2.0
    assert all(v == v for v in m.values())


def test_reference_model_kl() -> None:
    ref = make_model(seed=1)
    tr = EmbeddedTrainer(make_model(), config=TrainerConfig(lr=1e-2),
                         algo=AlgorithmConfig(kl_coef=0.1, kl_type="k3"), ref_model=ref)
    groups = random_groups()
    set_behaviour(tr, groups)
    m = tr.train_step(groups)
    assert m["train/kl"] > 0
    with pytest.raises(ValueError, match="reference model"):
        _trainer(algo=AlgorithmConfig(kl_coef=0.1))
    with pytest.raises(ValueError, match="critic"):
        _trainer(algo=AlgorithmConfig(advantage_estimator="ppo"))


def _nan_switch(tr: EmbeddedTrainer) -> dict[str, bool]:
    flag = {"on": False}

    def hook(_module, _inputs, output):
        return output * float("nan") if flag["on"] else output

    tr.model.model.norm.register_forward_hook(hook)
    return flag


def test_nonfinite_steps_are_skipped_counted_and_raise_after_k(groups) -> None:
    tr = _trainer(max_consecutive_nonfinite=3)
    set_behaviour(tr, groups)
    flag = _nan_switch(tr)
    before = _weights(tr)
    flag["on"] = True
    m = tr.train_step(groups)
    assert m["train/skipped_steps"] == 1.0 and m["train/optimizer_steps"] == 0.0
    assert "train/loss" not in m  # a skipped step's (non-finite) losses are not reported
    assert all(torch.equal(before[k], v) for k, v in _weights(tr).items())
    assert tr.version == 1  # the (unchanged) weights are still published as a new version
    flag["on"] = False
    m = tr.train_step(groups)  # a finite step resets the run of failures
    assert m["train/skipped_steps"] == 0.0 and tr.consecutive_nonfinite == 0
    flag["on"] = True
    tr.train_step(groups)
    tr.train_step(groups)
    with pytest.raises(NonFiniteError, match="3 consecutive"):
        tr.train_step(groups)
    assert tr.skipped_steps_total == 4


def test_nonfinite_raises_at_once_when_skipping_is_off(groups) -> None:
    tr = _trainer(skip_nonfinite_steps=False)
    set_behaviour(tr, groups)
    _nan_switch(tr)["on"] = True
    with pytest.raises(NonFiniteError):
        tr.train_step(groups)


def test_state_dict_round_trip_reproduces_the_next_step_bitwise(groups) -> None:
    kw = dict(num_steps_per_rollout=2, weight_decay=0.1, lr_warmup_steps=3, lr_decay_style="cosine",
              lr_decay_steps=10, micro_batch_size=5)
    a = _trainer(algo=AlgorithmConfig(use_tis=True), **kw)
    set_behaviour(a, groups, shift=-0.03)
    a.train_step(groups)
    state = a.state_dict()
    saved = copy.deepcopy(state)
    m_a = a.train_step(groups)

    b = _trainer(model=make_model(seed=7), algo=AlgorithmConfig(use_tis=True), **kw)
    b.load_state_dict(saved)
    assert b.version == 1 and b.optimizer_steps == 2
    m_b = b.train_step(groups)
    wa, wb = _weights(a), _weights(b)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert m_a["train/loss"] == m_b["train/loss"] and m_a["train/lr"] == m_b["train/lr"]
    # every leaf is a CPU tensor or a plain value
    def leaves(x):
        if isinstance(x, dict):
            for v in x.values():
                yield from leaves(v)
        elif isinstance(x, list):
            for v in x:
                yield from leaves(v)
        else:
            yield x
    for leaf in leaves(state):
        assert (isinstance(leaf, torch.Tensor) and leaf.device.type == "cpu") or isinstance(
            leaf, (int, float, bool, str, type(None)))


def test_load_state_dict_rejects_mismatch_and_leaves_state(groups) -> None:
    a = _trainer()
    state = a.state_dict()
    b = _trainer(model=make_model(seed=3))
    before = _weights(b)
    bad = copy.deepcopy(state)
    bad["model"].pop("model.norm.weight")
    with pytest.raises(ValueError, match="model.norm.weight"):
        b.load_state_dict(bad)
    other = _trainer(model=make_model(num_hidden_layers=3))
    with pytest.raises(ValueError, match="unexpected"):
        b.load_state_dict(other.state_dict())
    assert all(torch.equal(before[k], v) for k, v in _weights(b).items())


@pytest.mark.parametrize("tied", [False, True])
def test_export_weights_buckets(tied: bool) -> None:
    tr = _trainer(model=make_model(tie_word_embeddings=tied))
    limit = 40_000
    buckets = list(tr.export_weights(limit))
    names = [n for b in buckets for n, _ in b]
    expected = [k for k in tr.model.state_dict() if not (tied and k == "lm_head.weight")]
    assert names == expected and len(set(names)) == len(names)
    for b in buckets:
        size = sum(t.numel() * t.element_size() for _, t in b)
        assert size <= limit or len(b) == 1
        for _, t in b:
            assert t.is_contiguous() and not t.requires_grad
    sd = tr.model.state_dict()
    assert all(torch.equal(t, sd[n]) for b in buckets for n, t in b)
    half = [t for b in tr.export_weights(10**9, dtype=torch.bfloat16) for _, t in b]
    assert all(t.dtype == torch.bfloat16 for t in half)
    with pytest.raises(ValueError, match="bucket_bytes"):
        next(tr.export_weights(0))


@pytest.mark.parametrize(
    ("mutate", "error", "match"),
    [
        (lambda g: g[0][0].response_tokens.__setitem__(0, 10_000), TrajectoryError, "outside"),
        (lambda g: setattr(g[0][0], "reward", None), TrajectoryError, "no reward"),
        (lambda g: g[0][0].logprobs.__setitem__(0, float("nan")), TrajectoryError, "non-finite"),
        (lambda g: g[1][0].versions.__setitem__(0, 5), TrajectoryError, "newer"),
        (lambda g: setattr(g[0][0], "prompt_tokens", []), TrajectoryError, "empty prompt"),
        (lambda g: g.append([]), ValueError, "non-empty"),
    ],
)
def test_bad_input_is_rejected_and_leaves_state(groups, mutate, error, match) -> None:
    tr = _trainer()
    set_behaviour(tr, groups)
    before = _weights(tr)
    mutate(groups)
    with pytest.raises(error, match=match):
        tr.train_step(groups)
    assert tr.version == 0 and tr.optimizer_steps == 0
    assert all(torch.equal(before[k], v) for k, v in _weights(tr).items())


def test_routing_replay_uses_the_recorded_experts() -> None:
    model = make_model(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                       model_type="qwen3_moe")
    tr = _trainer(model=model, use_rollout_routing_replay=True)
    t = make_traj("m", 0, [5, 6, 7], [30, 31, 32, 33], 1.0)
    ids = torch.tensor([t.prompt_tokens + t.response_tokens])
    with torch.no_grad():
        own = tr.model(ids, return_routing=True).routing[0]  # [T, L_moe, k]
    t.routed_experts = own[2:-1].tolist()  # positions P-1 .. P+R-2 produced the response
    (replayed,) = tr.compute_logprobs([t])
    plain = _trainer(model=copy.deepcopy(model)).compute_logprobs([t])[0]
    assert torch.allclose(torch.tensor(replayed), torch.tensor(plain), atol=1e-5)
    t.routed_experts = [[[(e + 3) % 8 for e in layer] for layer in tok] for tok in t.routed_experts]
    (changed,) = tr.compute_logprobs([t])
    assert not torch.allclose(torch.tensor(changed), torch.tensor(plain), atol=1e-4)
    set_behaviour(tr, [[t]])
    t2 = copy.deepcopy(t)
    t2.id, t2.reward = "m2", 0.0
    assert tr.train_step([[t, t2]])["train/skipped_steps"] == 0.0
    t.routed_experts = None
    with pytest.raises(TrajectoryError, match="routed_experts"):
        tr.train_step([[t, t2]])


def test_sequences_longer_than_the_default_rope_table() -> None:
    """The rotary table starts at 8192 positions and the trainer skips the input check, so a
    longer trajectory gathered past the table's end (on CUDA a device-side assert that lost
    the trainer's process). The trainer's log-probs and a train step cover it, and equal a
    checked forward's."""
    model = make_model(max_position_embeddings=10000)
    tr = EmbeddedTrainer(model, config=TrainerConfig(lr=1e-3), algo=AlgorithmConfig())
    assert model.rotary.length in (0, 8192)
    n = 8300
    traj = make_traj("long", 0, [5, 6, 7], [(13 * j) % 250 + 3 for j in range(n)], reward=1.0)
    logp = torch.tensor(tr.compute_logprobs([traj])[0])
    ids = torch.tensor([traj.prompt_tokens + traj.response_tokens])
    with torch.no_grad():
        ref = torch.log_softmax(model(ids).logits[0, 2:-1].float(), -1)  # a checked forward
    want = ref.gather(-1, torch.tensor(traj.response_tokens)[:, None])[:, 0]
    assert torch.allclose(logp, want, atol=1e-4)
    set_behaviour(tr, [[traj]])
    assert math.isfinite(tr.train_step([[traj]])["train/loss"])


def test_an_optimizer_step_moves_every_parameter_version_even_fused() -> None:
    """torch's fused AdamW (the CUDA trainer's) writes the parameters without moving their
    version counters; the trainer moves them, since caches of derived weights (the quantized
    copies of ``quant.QuantLinear``) key on them. Run here with a fused CPU optimizer."""
    tr = _trainer()
    groups = [g for g in tr.optimizer.param_groups]
    tr.optimizer = torch.optim.AdamW(groups, lr=1e-2, fused=True)
    params = [p for g in tr.optimizer.param_groups for p in g["params"]]
    for p in params:
        p.grad = torch.ones_like(p)
    before = [p._version for p in params]
    taken, _ = tr._optimizer_step(torch.ones((), dtype=torch.bool), 1e-2)
    assert taken and all(p._version > v for p, v in zip(params, before))
