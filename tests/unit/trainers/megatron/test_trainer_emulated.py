"""MegatronTrainer end to end on the CPU, against the embedded trainer.

The trainer runs megatron-core's real DDP, optimizer (AdamW, fp32) and micro-batch schedule
in spawned processes where ``cuda_on_cpu.install(full=True)`` redirects megatron's CUDA
placements to the CPU. In float32 both trainers start from the same weights and must agree
step for step (log-probs, loss, grad norm, every metric): single process (dense; MoE with
rollout routing replay, a reference-model KL and activation recomputation), and two ranks as
DP=2 (also with the distributed optimizer), TP=2, EP=2 (+replay) and PP=2 (tied embeddings).
Also: checkpoint state round trip, export, bad input, non-finite skipping. GPU numerics
(bf16, NCCL) are in tests/gpu/test_megatron_gpu.py.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install miles[megatron])")

from tests.unit.trainers.megatron.cuda_on_cpu import run_ranks  # noqa: E402

pytestmark = pytest.mark.slow
TOL = 1e-4


def _pair(mkw: dict, *, moe: bool = False, replay: bool = False, tied: bool = False, kl_coef: float = 0.0,
          **tkw: Any) -> tuple[Any, Any, Any]:
    import torch

    from miles.algorithms import AlgorithmConfig
    from miles.models import CausalLM, tiny_config
    from miles.trainers import EmbeddedTrainer, TrainerConfig
    from miles.trainers.megatron.config import MegatronConfig
    from miles.trainers.megatron.trainer import MegatronTrainer

    torch.manual_seed(0)
    cfg = tiny_config(moe=moe, initializer_range=0.1, tie_word_embeddings=tied)
    ref = CausalLM(cfg)
    kw = dict(lr=1e-3, dtype="float32", micro_batch_size=3, weight_decay=0.1, num_steps_per_rollout=2,
              use_rollout_routing_replay=replay, **tkw)
    algo = AlgorithmConfig(use_tis=True, kl_coef=kl_coef)
    mt = MegatronTrainer(cfg, config=TrainerConfig(device="cuda", **kw), algo=algo,
                         megatron=MegatronConfig(**mkw), weights=ref.state_dict())
    et = EmbeddedTrainer(copy.deepcopy(ref), config=TrainerConfig(device="cpu", fsdp=False, **kw), algo=algo,
                         ref_model=copy.deepcopy(ref) if kl_coef > 0 else None)
    return cfg, mt, et


def _groups(cfg: Any, replay: bool) -> list:
    import torch

    from tests.unit.trainers.conftest import random_groups

    groups = random_groups()
    if replay:
        g = torch.Generator().manual_seed(1)
        for t in (t for grp in groups for t in grp):
            t.routed_experts = [[torch.randperm(cfg.num_experts, generator=g)[: cfg.num_experts_per_tok].tolist()
                                 for _ in cfg.moe_layers] for _ in t.response_tokens]
    return groups


def _compare(mt: Any, et: Any, groups: list, steps: int = 2) -> dict[str, float]:
    from tests.unit.trainers.conftest import set_behaviour

    flat = [t for g in groups for t in g]
    worst = {"logp": 0.0, "loss": 0.0, "grad_norm": 0.0, "metrics": 0.0}
    for _ in range(steps):
        set_behaviour(et, groups, shift=-0.05)
        a, b = mt.compute_logprobs(flat), et.compute_logprobs(flat)
        worst["logp"] = max(worst["logp"], max(abs(x - y) for u, v in zip(a, b) for x, y in zip(u, v)))
        m1, m2 = mt.train_step(groups), et.train_step(groups)
        assert set(m1) == set(m2), set(m1) ^ set(m2)
        for k in m2:
            if not k.endswith(("time_s", "tokens_per_s")):
                worst["metrics"] = max(worst["metrics"], abs(m1[k] - m2[k]) / max(1.0, abs(m2[k])))
        worst["loss"] = max(worst["loss"], abs(m1["train/loss"] - m2["train/loss"]))
        worst["grad_norm"] = max(worst["grad_norm"], abs(m1["train/grad_norm"] - m2["train/grad_norm"]))
    return worst


def _single(rank: int) -> dict[str, Any]:
    import math

    import torch

    from tests.unit.trainers.conftest import make_traj, set_behaviour
    from tests.unit.trainers.megatron.cuda_on_cpu import install
    from miles.types import TrajectoryError

    install(full=True)
    out: dict[str, Any] = {}
    cfg, mt, et = _pair({"moe_token_dispatcher_type": "allgather"})
    groups = _groups(cfg, False)
    out["dense"] = _compare(mt, et, groups)
    # checkpoint state: restore, then the next step repeats exactly
    set_behaviour(et, groups, shift=-0.05)
    state = copy.deepcopy(mt.state_dict())
    first = mt.train_step(groups)
    mt.load_state_dict(state)
    again = mt.train_step(groups)
    out["resume"] = max(abs(first[k] - again[k]) for k in ("train/loss", "train/grad_norm", "train/version"))
    # export: HF names and the model's weights
    exported = dict(kv for bucket in mt.export_weights(1 << 14) for kv in bucket)
    out["export"] = sorted(exported) == sorted(n for n, _ in et.model.named_parameters()) and all(
        t.dtype == torch.float32 for t in exported.values())
    # bad input changes nothing
    version = mt.version
    try:
        mt.train_step([[make_traj("bad", 0, [5], [cfg.vocab_size + 3], 1.0)]])
        out["bad_input"] = "accepted"
    except TrajectoryError:
        out["bad_input"] = "refused" if mt.version == version else "changed state"
    # a non-finite forward skips the optimizer steps (both mini-batches) and updates nothing
    steps_before = mt.optimizer_steps
    with torch.no_grad():
        mt.gpt.decoder.final_layernorm.weight.fill_(math.nan)
    m = mt.train_step(groups)
    out["nonfinite"] = (m["train/skipped_steps"], mt.optimizer_steps - steps_before, mt.version == version + 1)
    # MoE with rollout routing replay, a KL term against a reference model, recomputation
    cfg, mt, et = _pair({"moe_token_dispatcher_type": "allgather"}, moe=True, replay=True, kl_coef=0.1,
                        gradient_checkpointing=True)
    out["moe_replay"] = _compare(mt, et, _groups(cfg, True))
    return out


def test_single_process_matches_the_embedded_trainer() -> None:
    (out,) = run_ranks(_single, 1, timeout=400)
    for case in ("dense", "moe_replay"):
        assert out[case]["logp"] < TOL and out[case]["loss"] < TOL and out[case]["grad_norm"] < TOL, out[case]
        assert out[case]["metrics"] < 1e-3, out[case]
    assert out["resume"] < 1e-6
    assert out["export"] is True
    assert out["bad_input"] == "refused"
    assert out["nonfinite"] == (2.0, 0, True)


LAYOUTS = [  # (name, MegatronConfig kwargs, moe + replay, tied)
    ("dp2", {"moe_token_dispatcher_type": "allgather"}, False, False),
    ("dp2_distributed_optimizer", {"use_distributed_optimizer": True}, False, False),
    ("tp2", {"tensor_model_parallel_size": 2}, False, False),
    ("ep2_replay", {"expert_model_parallel_size": 2}, True, False),
    ("pp2_tied", {"pipeline_model_parallel_size": 2}, False, True),
]


def _two_ranks(rank: int) -> dict[str, dict[str, float]]:
    from megatron.core import parallel_state as ps

    from tests.unit.trainers.megatron.cuda_on_cpu import install

    install(full=True)
    out = {}
    for name, mkw, moe, tied in LAYOUTS:
        cfg, mt, et = _pair(mkw, moe=moe, replay=moe, tied=tied)
        out[name] = _compare(mt, et, _groups(cfg, moe))
        ps.destroy_model_parallel()
    return out


def test_two_ranks_match_the_embedded_trainer() -> None:
    results = run_ranks(_two_ranks, 2, timeout=500)
    for rank, per_layout in enumerate(results):
        for name, w in per_layout.items():
            assert w["logp"] < TOL and w["loss"] < TOL and w["grad_norm"] < TOL, (rank, name, w)
            assert w["metrics"] < 1e-3, (rank, name, w)


def _engine_round_trip(rank: int) -> dict[str, Any]:
    """Rollouts from the embedded engine (CPU) → Megatron recomputes their log-probs → train →
    export → engine update → the engine samples with the new version, and they agree again."""
    import asyncio

    from miles.engines import EmbeddedEngine, EngineConfig
    from miles.types import GenerateRequest, SamplingParams, Trajectory
    from tests.unit.trainers.megatron.cuda_on_cpu import install

    install(full=True)
    out: dict[str, Any] = {}
    for moe in (False, True):
        cfg, mt, et = _pair({"moe_token_dispatcher_type": "allgather"}, moe=moe, replay=moe,
                            rollout_temperature=0.8)
        engine = EmbeddedEngine(copy.deepcopy(et.model).eval(),
                                config=EngineConfig(max_batch_size=8, max_seq_len=128, device="cpu", dtype="float32"))
        prompts = [[5, 6, 7, 8], [5, 6, 7, 8], [9, 10], [9, 10]]

        async def rollout() -> list[Trajectory]:
            sp = SamplingParams(max_new_tokens=12, temperature=0.8, ignore_eos=True, seed=3)
            outs = await asyncio.gather(*(engine.generate(GenerateRequest(
                rid=f"r{i}", input_ids=p, sampling=sp, return_routed_experts=moe)) for i, p in enumerate(prompts)))
            trajs = []
            for i, (p, o) in enumerate(zip(prompts, outs)):
                t = Trajectory(id=f"t{i}", prompt_id=f"p{i // 2}", group_id=f"g{i // 2}", prompt_tokens=p)
                t.append(o.output_ids, o.logprobs, o.versions)
                t.routed_experts, t.reward = o.routed_experts, float(i % 2)
                trajs.append(t)
            return trajs

        def worst(trajs: list[Trajectory]) -> float:
            got = mt.compute_logprobs(trajs)
            return max(abs(a - b) for g, t in zip(got, trajs) for a, b in zip(g, t.logprobs))

        async def go() -> tuple[float, float, set[int]]:
            trajs = await rollout()
            before = worst(trajs)
            mt.train_step([trajs[:2], trajs[2:]])
            for bucket in mt.export_weights(8_000):
                await engine.update_weights(bucket, mt.version)
            fresh = await rollout()
            await engine.close()
            return before, worst(fresh), {v for t in fresh for v in t.versions}

        before, after, versions = asyncio.run(go())
        out["moe" if moe else "dense"] = (before, after, versions == {mt.version})
    return out


def test_export_updates_the_embedded_engine() -> None:
    (out,) = run_ranks(_engine_round_trip, 1, timeout=400)
    for name, (before, after, versions_ok) in out.items():
        assert before < 1e-5 and after < 1e-5 and versions_ok, (name, before, after)
