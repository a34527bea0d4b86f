"""--true-on-policy composes with the engine's other features (CPU float32, miles.models.invariant):
abort + resume, partial rollouts whose tokens come from several policy versions, and speculative
decoding's verify pass all record log-probs bitwise equal to the trainer's recompute under the
weights that sampled them, and the step's metric compares exactly the tokens it can recompute."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from miles.algorithms import AlgorithmConfig
from miles.engines import EmbeddedEngine, EngineConfig
from miles.models import invariant
from miles.trainers import EmbeddedTrainer, TrainerConfig
from miles.types import GenerateOutput, GenerateRequest, SamplingParams, Trajectory
from tests.unit.trainers.conftest import make_model

MOE = dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
MODE = dict(decode_attention="sdpa", cpu_decode_kernel=False, decode_residual_gemm=False)  # factory.build_engine's
SEEDED = SamplingParams(max_new_tokens=20, temperature=1.0, seed=7, ignore_eos=True)


async def _progress(engine: EmbeddedEngine, rid: str, at_least: int) -> None:
    """Wait (event-paced, generous) until ``rid`` has ``at_least`` tokens."""
    for _ in range(200_000):
        n = engine.progress(rid)
        if n is not None and n >= at_least:
            return
        await asyncio.sleep(0.0005)
    raise AssertionError(f"{rid} never reached {at_least} tokens")


def _traj(tid: str, prompt: list[int], *outs: GenerateOutput) -> Trajectory:
    t = Trajectory(id=tid, prompt_id=tid, group_id="g", prompt_tokens=prompt)
    routed: list | None = [] if outs[0].routed_experts is not None else None
    for out in outs:
        t.append(out.output_ids, out.logprobs, out.versions, kv_versions=out.kv_versions)
        if routed is not None:
            routed.extend(out.routed_experts)
    t.routed_experts = routed
    t.reward = float(len(t.response_tokens) % 2)
    return t


def _trainer(model, moe: bool = False, **cfg) -> EmbeddedTrainer:
    return EmbeddedTrainer(model, config=TrainerConfig(lr=1e-2, use_rollout_routing_replay=moe, **cfg),
                           algo=AlgorithmConfig(use_tis=True))


@pytest.mark.parametrize("moe", [False, True])
def test_abort_and_resume_keep_the_exact_zero(moe: bool) -> None:
    """A row aborted mid-decode (another row sharing its batch) and resumed by re-prefilling its
    prompt and partial output records the uninterrupted run's log-probs bitwise (the tokens are
    seeded), and the trainer's recompute of the joined trajectory equals them bitwise."""
    model = make_model(**(MOE if moe else {}))
    prompt, other = [5, 6, 7, 8, 9], [11, 12]
    with invariant.mode(keys=model.config.max_position_embeddings):
        engine = EmbeddedEngine(copy.deepcopy(model).eval(), config=EngineConfig(max_batch_size=4, max_seq_len=128,
                                                                                  **MODE))

        async def go():
            req = dict(input_ids=prompt, sampling=SEEDED, return_routed_experts=moe)
            full = await engine.generate(GenerateRequest(rid="full", **req))
            noise = asyncio.create_task(engine.generate(GenerateRequest(
                rid="other", input_ids=other, sampling=SamplingParams(max_new_tokens=60, ignore_eos=True))))
            task = asyncio.create_task(engine.generate(GenerateRequest(rid="a", **req)))
            await _progress(engine, "a", 6)
            await engine.abort("a")
            part = await task
            rest = await engine.generate(GenerateRequest(
                rid="a2", input_ids=prompt + part.output_ids, sampling=SEEDED, num_prefix_tokens=len(part.output_ids),
                return_routed_experts=moe))
            await noise
            await engine.close()
            return full, part, rest

        full, part, rest = asyncio.run(go())
        assert part.finish_reason == "abort" and 6 <= len(part.output_ids) < 20
        assert part.output_ids + rest.output_ids == full.output_ids
        assert part.logprobs + rest.logprobs == full.logprobs  # bitwise, not within round-off
        traj = _traj("a", prompt, part, rest)
        tr = _trainer(model, moe, true_on_policy_check="strict")
        assert tr.compute_logprobs([traj])[0] == traj.logprobs
        m = tr.train_step([[traj, _traj("full", prompt, full)]])
    assert m["train/rollout_logprob_abs_diff_max"] == 0.0 and m["train/rollout_logprob_compared_frac"] == 1.0
    assert m["train/tis_ratio_max"] == 1.0


def test_partial_rollout_tokens_match_the_weights_that_sampled_them() -> None:
    """Tokens of one trajectory from two versions: a row aborted under version 0 and resumed
    (re-prefilled) under version 1 has its v0 tokens bitwise equal to a v0 trainer's recompute
    and its v1 tokens to a v1 trainer's. A row that kept its KV cache across the update samples
    its v1 tokens over v0 keys and values, which no trainer recomputes: they differ, and the
    step's metric leaves them out (kv_versions), comparing exactly the recomputable v1 tokens."""
    v0 = make_model()
    v1 = copy.deepcopy(v0)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in v1.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    prompt = [5, 6, 7, 8, 9]
    with invariant.mode(keys=v0.config.max_position_embeddings):
        engine = EmbeddedEngine(copy.deepcopy(v0).eval(), config=EngineConfig(max_batch_size=4, max_seq_len=128,
                                                                               **MODE))

        async def go():
            a = asyncio.create_task(engine.generate(GenerateRequest(rid="a", input_ids=prompt, sampling=SEEDED)))
            kept = asyncio.create_task(engine.generate(GenerateRequest(
                rid="kept", input_ids=[13, 14, 15], sampling=SamplingParams(max_new_tokens=40, seed=3,
                                                                             ignore_eos=True))))
            await _progress(engine, "a", 6)
            await _progress(engine, "kept", 6)
            await engine.abort("a")
            part = await a
            await engine.update_weights(list(v1.state_dict().items()), version=1, keep_kv_cache=True)
            rest = await engine.generate(GenerateRequest(
                rid="a2", input_ids=prompt + part.output_ids, sampling=SEEDED, num_prefix_tokens=len(part.output_ids)))
            out_kept = await kept
            await engine.close()
            return part, rest, out_kept

        part, rest, out_kept = asyncio.run(go())
        assert set(part.versions) == {0} and set(rest.versions) == {1} and set(rest.kv_versions) == {1}
        traj = _traj("a", prompt, part, rest)
        n0 = len(part.output_ids)
        assert _trainer(copy.deepcopy(v0)).compute_logprobs([traj])[0][:n0] == part.logprobs
        assert _trainer(copy.deepcopy(v1)).compute_logprobs([traj])[0][n0:] == rest.logprobs

        kept_traj = _traj("kept", [13, 14, 15], out_kept)
        late = [i for i, (v, kv) in enumerate(zip(out_kept.versions, out_kept.kv_versions)) if v == 1 and kv == 0]
        assert late, "the kept row sampled no token after the update"
        lp = _trainer(copy.deepcopy(v1)).compute_logprobs([kept_traj])[0]
        assert any(lp[i] != out_kept.logprobs[i] for i in late)  # why they are left out

        tr = _trainer(copy.deepcopy(v1), true_on_policy_check="strict")
        tr._version = 1  # the trainer that produced v1
        m = tr.train_step([[traj, kept_traj]])
    n_compared = len(rest.output_ids) + sum(1 for v, kv in zip(out_kept.versions, out_kept.kv_versions) if v == kv == 1)
    assert m["train/rollout_logprob_abs_diff_max"] == 0.0
    assert m["train/rollout_logprob_compared_frac"] == pytest.approx(
        n_compared / (len(traj.response_tokens) + len(kept_traj.response_tokens)))


@pytest.mark.parametrize("moe", [False, True])
def test_speculative_tokens_carry_the_trainers_logprobs(moe: bool) -> None:
    """With speculative decoding (a noisy draft, rejection sampling, k = 3, continuous batching),
    every emitted token's log-prob comes from the verify pass, k + 1 queries a row over the
    cache: bitwise the trainer's full-sequence recompute."""
    from miles.engines.spec import SpeculativeConfig
    from tests.unit.engines.spec_helpers import noisy_copy

    model = make_model(**(MOE if moe else {}))
    draft = noisy_copy(model, 0.05, seed=1)
    prompts = [[5, 6, 7, 8], [9, 10], [9, 10, 11, 12, 13], [17]]
    with invariant.mode(keys=model.config.max_position_embeddings):
        engine = EmbeddedEngine(copy.deepcopy(model).eval(), config=EngineConfig(max_batch_size=4, max_seq_len=128,
                                                                                  **MODE),
                                draft=copy.deepcopy(draft),
                                speculative=SpeculativeConfig(speculative_algorithm="draft", speculative_num_steps=3,
                                                              speculative_adaptive=False))

        async def go():
            outs = await asyncio.gather(*(engine.generate(GenerateRequest(
                rid=f"r{i}", input_ids=p, sampling=SamplingParams(max_new_tokens=12 + 3 * i, seed=i, ignore_eos=True),
                return_routed_experts=moe)) for i, p in enumerate(prompts)))
            stats = engine.spec_stats()
            await engine.close()
            return outs, stats

        outs, stats = asyncio.run(go())
        trajs = [_traj(f"t{i}", p, o) for i, (p, o) in enumerate(zip(prompts, outs))]
        tr = _trainer(model, moe, true_on_policy_check="strict")
        got = tr.compute_logprobs(trajs)
        assert all(a == t.logprobs for a, t in zip(got, trajs))
        m = tr.train_step([trajs[:2], trajs[2:]])
    assert stats, "no verify round ran"
    assert m["train/rollout_logprob_abs_diff_max"] == 0.0 and m["train/tis_ratio_max"] == 1.0
