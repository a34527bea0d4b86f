"""Environment tokens get exactly zero gradient in the EmbeddedTrainer.

Episodes are produced by EnvRollout on the real engine (several policy versions), then
trained; a spy on the loss keeps the per-token log-prob tensor so its gradient can be read.
"""

from __future__ import annotations

import copy

import torch

import miles.trainers.step as rl_step  # the train step calls compute_loss
from miles.algorithms import AlgorithmConfig
from miles.trainers import EmbeddedTrainer, TrainerConfig
from tests.unit.envs.test_engine_versions import make_model, run_episode


def _train_with_spy(monkeypatch, groups, model, version):
    captured = []
    real = rl_step.compute_loss

    def spy(pb, *args, **kwargs):
        pb.logp.retain_grad()
        captured.append(pb)
        return real(pb, *args, **kwargs)

    monkeypatch.setattr(rl_step, "compute_loss", spy)
    trainer = EmbeddedTrainer(model, config=TrainerConfig(lr=1e-3), algo=AlgorithmConfig(), version=version)
    metrics = trainer.train_step(groups)
    return trainer, captured, metrics


def test_environment_tokens_get_zero_gradient(monkeypatch) -> None:
    models = [make_model(seed) for seed in range(4)]
    episodes = [run_episode(models, tid=f"t{i}", mid_turn_update=False, turn_tokens=6) for i in range(2)]
    for reward, t in zip((1.0, 0.0), episodes):
        t.reward = reward  # distinct rewards: non-zero advantages
    trainer, captured, metrics = _train_with_spy(monkeypatch, [episodes], copy.deepcopy(models[2]), version=2)
    assert captured and metrics["train/skipped_steps"] == 0.0
    env_tokens = sum(len(t.loss_mask) - t.num_loss_tokens for t in episodes)
    assert env_tokens > 0
    seen_env = 0
    for pb in captured:
        grad, mask = pb.logp.grad, pb.loss_mask
        assert grad is not None
        assert grad[mask == 0].eq(0).all()  # exactly zero, env tokens and padding alike
        assert grad[mask == 1].ne(0).any()
        seen_env += int((mask == 0).sum())
    assert seen_env >= env_tokens
    assert metrics["train/tokens"] == sum(t.num_loss_tokens for t in episodes)


def test_environment_token_logprobs_do_not_change_the_update(monkeypatch) -> None:
    models = [make_model(seed) for seed in range(4)]
    episodes = [run_episode(models, tid=f"t{i}", mid_turn_update=False, turn_tokens=6) for i in range(2)]
    episodes[0].reward, episodes[1].reward = 1.0, 0.0

    def weights_after(shift_env: float) -> dict[str, torch.Tensor]:
        group = copy.deepcopy(episodes)
        for t in group:  # behaviour log-probs on env tokens are meaningless: change them
            t.logprobs = [lp if m else shift_env for lp, m in zip(t.logprobs, t.loss_mask)]
        trainer, _, _ = _train_with_spy(monkeypatch, [group], copy.deepcopy(models[2]), version=2)
        return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}

    a, b = weights_after(0.0), weights_after(-7.5)
    assert all(torch.equal(a[k], b[k]) for k in a)
