"""The true-on-policy metric: train/rollout_logprob_abs_diff_max/_mean compare the recorded
behaviour log-probs with the trainer's recompute over the loss tokens of the trained version;
--true-on-policy-check strict stops on any difference."""

from __future__ import annotations

import pytest

from miles.algorithms import AlgorithmConfig
from miles.trainers import EmbeddedTrainer, TrainerConfig
from miles.trainers.metrics import TrueOnPolicyError
from tests.unit.trainers.conftest import make_model, random_groups, set_behaviour


def _trainer(**cfg) -> EmbeddedTrainer:
    return EmbeddedTrainer(make_model(), config=TrainerConfig(lr=1e-2, **cfg), algo=AlgorithmConfig())


def test_own_logprobs_give_an_exact_zero_and_a_ratio_of_one() -> None:
    tr, groups = _trainer(true_on_policy_check="strict"), random_groups()
    set_behaviour(tr, groups)  # the same batch shapes as the step's forward: bitwise equal
    m = tr.train_step(groups)
    assert m["train/rollout_logprob_abs_diff_max"] == 0.0
    assert m["train/rollout_logprob_abs_diff_mean"] == 0.0
    assert m["train/rollout_logprob_compared_frac"] == 1.0
    assert m["train/tis_ratio_max"] == 1.0


def test_one_perturbed_token_is_seen_and_strict_stops() -> None:
    tr, groups = _trainer(), random_groups()
    set_behaviour(tr, groups)
    t = groups[1][2]
    i = t.loss_mask.index(1)
    t.logprobs[i] += 2.0 ** -20
    m = tr.train_step(groups)
    assert m["train/rollout_logprob_abs_diff_max"] == pytest.approx(2.0 ** -20, rel=1e-3)
    assert 0.0 < m["train/rollout_logprob_abs_diff_mean"] < m["train/rollout_logprob_abs_diff_max"]

    strict, groups = _trainer(true_on_policy_check="strict"), random_groups()
    set_behaviour(strict, groups, shift=-1e-3)
    with pytest.raises(TrueOnPolicyError, match="differs from the trainer's recompute"):
        strict.train_step(groups)


def test_stale_tokens_are_left_out_and_later_mini_batches_use_the_recompute() -> None:
    tr = _trainer(num_steps_per_rollout=2, micro_batch_size=3)
    groups = random_groups()
    tr.algo = AlgorithmConfig(prox_logp="recompute")
    set_behaviour(tr, groups)
    for t in groups[1]:  # sampled by an older version: its weights are gone, so not compared
        t.versions = [0] * len(t.versions)
        t.logprobs = [x - 0.5 for x in t.logprobs]
    tr._version = 1
    for g in (groups[0], groups[2]):
        for t in g:
            t.versions = [1] * len(t.versions)
            t.kv_versions = list(t.versions)  # sampled over a cache of version 1 alone
    m = tr.train_step(groups)  # micro-batches of 3 rows: other GEMM shapes than set_behaviour's
    assert 0.0 < m["train/rollout_logprob_compared_frac"] < 1.0
    assert m["train/rollout_logprob_abs_diff_max"] < 1e-5


def _split_k(x, w, b=None):
    ks = x.shape[-1] // 2
    return x[..., :ks] @ w[:, :ks].T + x[..., ks:] @ w[:, ks:].T + (0 if b is None else b)


@pytest.mark.parametrize("moe", [False, True])
def test_batch_invariant_model_gives_zero_across_batch_composition_and_split_k_breaks_it(moe: bool) -> None:
    """Behaviour log-probs scored one trajectory at a time (M = one row's tokens, its own
    padding) and the train step's micro-batches of 3 (other rows, other padded lengths) agree
    bitwise in miles.models.invariant's mode; a split-K GEMM in the trainer breaks it."""
    from miles.models import invariant

    extra = dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32) if moe else {}
    def trainer(**cfg):
        return EmbeddedTrainer(make_model(**extra), config=TrainerConfig(lr=1e-2, micro_batch_size=3, **cfg),
                               algo=AlgorithmConfig(use_tis=True))
    groups = random_groups(num_groups=2, size=3)
    tr = trainer(true_on_policy_check="strict")
    with invariant.mode(keys=64):
        for t in (t for g in groups for t in g):
            (lp,) = tr.compute_logprobs([t])
            t.logprobs = [x if m else 0.0 for x, m in zip(lp, t.loss_mask)]
        m = tr.train_step(groups)
    assert m["train/rollout_logprob_abs_diff_max"] == 0.0
    assert m["train/tis_ratio_max"] == 1.0

    with invariant.mode(keys=64, linear_fn=_split_k):
        m = trainer().train_step(groups)
    assert m["train/rollout_logprob_abs_diff_max"] > 0.0


@pytest.mark.parametrize("moe", [False, True])
def test_engine_logprobs_equal_the_trainers_in_the_invariant_mode(moe: bool) -> None:
    """The embedded engine's recorded log-probs (continuous batching: rows of different
    prompt lengths prefill, decode together and finish) against the trainer's recompute, in
    invariant.mode with the torch decode path (sdpa decode attention, no CPU decode kernel,
    no residual GEMM): bitwise equal; and the train step reports it."""
    import asyncio
    import copy

    from miles.engines import EmbeddedEngine, EngineConfig
    from miles.models import invariant
    from tests.unit.trainers.test_engine_consistency import _rollout

    extra = dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32) if moe else {}
    model = make_model(**extra)
    with invariant.mode(keys=model.config.max_position_embeddings):
        engine = EmbeddedEngine(copy.deepcopy(model).eval(), config=EngineConfig(
            max_batch_size=8, max_seq_len=128, decode_attention="sdpa", cpu_decode_kernel=False,
            decode_residual_gemm=False))
        tr = EmbeddedTrainer(model, config=TrainerConfig(lr=1e-2, use_rollout_routing_replay=moe,
                                                         true_on_policy_check="strict"),
                             algo=AlgorithmConfig(use_tis=True))
        trajs = asyncio.run(_rollout(engine, [[5, 6, 7, 8], [5, 6, 7, 8], [9, 10], [9, 10, 11, 12, 13]], 1.0, moe))
        got = tr.compute_logprobs(trajs)
        assert all(a == t.logprobs for a, t in zip(got, trajs))
        m = tr.train_step([trajs[:2], trajs[2:]])
    assert m["train/rollout_logprob_abs_diff_max"] == 0.0 and m["train/tis_ratio_max"] == 1.0
