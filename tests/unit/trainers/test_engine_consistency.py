"""Engine ↔ trainer: the trainer recomputes the log-probs the embedded engine recorded for
the tokens it sampled (< 1e-5 in float32, dense and MoE with routing replay), and after a
train step, ``export_weights`` → ``engine.update_weights`` keeps them in agreement."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from miles.algorithms import AlgorithmConfig
from miles.engines import EmbeddedEngine, EngineConfig
from miles.trainers import EmbeddedTrainer, TrainerConfig
from miles.types import GenerateRequest, SamplingParams, Trajectory
from tests.unit.trainers.conftest import make_model

TOL = 1e-5
MOE = dict(model_type="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)


async def _rollout(engine: EmbeddedEngine, prompts: list[list[int]], temperature: float, moe: bool) -> list[Trajectory]:
    sp = SamplingParams(max_new_tokens=12, temperature=temperature, ignore_eos=True)
    outs = await asyncio.gather(*(
        engine.generate(GenerateRequest(rid=f"r{i}", input_ids=p, sampling=sp, return_routed_experts=moe))
        for i, p in enumerate(prompts)))
    trajs = []
    for i, (p, out) in enumerate(zip(prompts, outs)):
        t = Trajectory(id=f"t{i}", prompt_id=f"p{i // 2}", group_id=f"g{i // 2}", prompt_tokens=p)
        t.append(out.output_ids, out.logprobs, out.versions)
        t.routed_experts = out.routed_experts
        t.reward = float(i % 2)
        trajs.append(t)
    return trajs


def _worst(trainer: EmbeddedTrainer, trajs: list[Trajectory]) -> float:
    got = trainer.compute_logprobs(trajs)
    return max((torch.tensor(a) - torch.tensor(t.logprobs)).abs().max().item() for a, t in zip(got, trajs))


@pytest.mark.parametrize("moe", [False, True])
def test_trainer_reproduces_engine_logprobs_and_follows_weight_updates(moe: bool) -> None:
    model = make_model(**(MOE if moe else {}))
    engine = EmbeddedEngine(copy.deepcopy(model).eval(), config=EngineConfig(max_batch_size=8, max_seq_len=128))
    trainer = EmbeddedTrainer(model, config=TrainerConfig(lr=1e-2, rollout_temperature=0.8,
                                                          use_rollout_routing_replay=moe),
                              algo=AlgorithmConfig(use_tis=True))
    prompts = [[5, 6, 7, 8], [5, 6, 7, 8], [9, 10], [9, 10]]

    async def go() -> tuple[float, float, dict]:
        trajs = await _rollout(engine, prompts, 0.8, moe)
        before = _worst(trainer, trajs)
        metrics = trainer.train_step([trajs[:2], trajs[2:]])
        for bucket in trainer.export_weights(8_000):
            await engine.update_weights(bucket, trainer.version)
        fresh = await _rollout(engine, prompts, 0.8, moe)
        assert all(v == trainer.version for t in fresh for v in t.versions)
        after = _worst(trainer, fresh)
        await engine.close()
        return before, after, metrics

    before, after, metrics = asyncio.run(go())
    assert before < TOL and after < TOL
    assert metrics["train/mismatch_kl_k1"] == pytest.approx(0.0, abs=1e-5)
