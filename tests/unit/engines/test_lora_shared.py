"""A colocated LoRA engine serving the trainer's frozen base (``miles.engines.shared``): one
copy of the base, the adapters applied unmerged in the fused prefill and decode paths, updates
that carry the adapters alone, and the same logits and log-probs as the merging engine."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from miles.algorithms import AlgorithmConfig
from miles.engines import EmbeddedEngine, EngineConfig
from miles.engines.shared import engine_model, sharing_problem
from miles.engines.weights import WeightError
from miles.models import CausalLM, tiny_config
from miles.trainers import EmbeddedTrainer, TrainerConfig
from miles.types import GenerateRequest, SamplingParams, Trajectory

TOL = 1e-5


def _model(seed: int = 0, **kw) -> CausalLM:
    torch.manual_seed(seed)
    return CausalLM(tiny_config(initializer_range=0.1, **kw))


def _trainer(model: CausalLM, targets=("all-linear",), rank: int = 4) -> EmbeddedTrainer:
    cfg = TrainerConfig(lr=0.1, lora_rank=rank, lora_alpha=2.0 * rank, lora_target_modules=list(targets),
                        compile=False)
    return EmbeddedTrainer(model, config=cfg, algo=AlgorithmConfig())


def _engines(trainer: EmbeddedTrainer, model: CausalLM) -> tuple[EmbeddedEngine, EmbeddedEngine]:
    cfg = EngineConfig(max_batch_size=16, max_seq_len=64)
    shared = EmbeddedEngine.over_shared_base(model.config, trainer.shared_base(), config=cfg)
    merged = EmbeddedEngine(model, config=cfg)  # its own copy (the model as it was before training)
    return shared, merged


async def _generate(engine: EmbeddedEngine, step: int) -> list:
    prompts = [[5, 6, 7], [9, 10], [11, 12, 13, 14]]
    reqs = [GenerateRequest(rid=f"s{step}g{g}m{m}", input_ids=p,
                            sampling=SamplingParams(max_new_tokens=6, temperature=1.0, ignore_eos=True,
                                                    seed=100 * step + 10 * g + m))
            for g, p in enumerate(prompts) for m in range(4)]
    return list(await asyncio.gather(*(engine.generate(r) for r in reqs)))


def _groups(outs: list, step: int) -> list[list[Trajectory]]:
    groups: dict[int, list[Trajectory]] = {}
    for i, out in enumerate(outs):
        g = i // 4
        t = Trajectory(id=f"s{step}i{i}", prompt_id=f"p{g}", group_id=f"s{step}g{g}", prompt_tokens=[5 + g])
        t.append(out.output_ids, out.logprobs, out.versions)
        t.reward = sum(tok < 100 for tok in out.output_ids) / len(out.output_ids)
        groups.setdefault(g, []).append(t)
    return list(groups.values())


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


@pytest.mark.parametrize("targets", [("all-linear",), ("q_proj", "v_proj", "down_proj")])
def test_unmerged_engine_over_the_trainers_base_matches_the_merged_engine(targets) -> None:
    model = _model()
    trainer = _trainer(copy.deepcopy(model), targets)
    shared, merged = _engines(trainer, model)
    base = trainer.shared_base()
    frozen = {k: v.clone() for k, v in base.items()}
    # one copy: every engine parameter is the trainer's tensor, the fused q/k/v and gate/up views of it
    eparams = shared.model.state_dict(keep_vars=True)
    assert shared.shared == frozenset(eparams) and shared.stats()["engine/lora_shared_base"] == 1.0
    assert merged.stats()["engine/lora_shared_base"] == 0.0
    for name, t in eparams.items():
        assert t.data_ptr() == base[name].data_ptr(), name
    for layer, tl in zip(shared.model.model.layers, trainer.model.model.layers):
        assert _storage(layer.self_attn.qkv[0]) == _storage(tl.self_attn.q_proj.weight)
        assert layer.self_attn.qkv[0].data_ptr() == tl.self_attn.q_proj.weight.data_ptr()
        assert layer.mlp.gate_up[0].data_ptr() == tl.mlp.gate_proj.weight.data_ptr()
    assert shared.runner.cpu_kernel is None  # it reads weights alone; the adapters live beside them
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]])

    async def go() -> None:
        for step in range(3):
            a, b = await _generate(shared, step), await _generate(merged, step)
            assert [o.output_ids for o in a] == [o.output_ids for o in b]  # decode: the same draws
            worst = max(abs(x - y) for oa, ob in zip(a, b) for x, y in zip(oa.logprobs, ob.logprobs))
            assert worst < TOL, worst
            with torch.no_grad():  # prefill path: logits of the fused forward
                la, lb = shared.model(ids).logits, merged.model(ids).logits
            torch.testing.assert_close(la, lb, atol=TOL, rtol=0)
            trainer.train_step(_groups(a, step))
            shipped = [item for bucket in trainer.export_weights(1 << 20) for item in bucket]
            assert shipped and all(".lora_A." in n or ".lora_B." in n for n, _ in shipped)  # adapters only
            await shared.update_weights(shipped, trainer.version)
            await merged.update_weights(shipped, trainer.version)
        # the adapters moved the policy; the engines still agree, with the trainer too
        lp = trainer.compute_logprobs([t for g in _groups(await _generate(shared, 9), 9) for t in g])
        assert lp
        await shared.close()
        await merged.close()

    asyncio.run(go())
    assert shared.stager.adapters.num_modules == len([n for n in trainer.model.state_dict() if ".lora_A." in n])
    for k, v in frozen.items():  # the engine never wrote into the trainer's base
        assert torch.equal(base[k], v), k
    with torch.no_grad():  # and the trained adapters are not zero: the comparison above meant something
        assert any(m.lora_B.weight.abs().max() > 0 for m in trainer.model.modules() if hasattr(m, "lora_B"))


def test_shared_engine_refuses_base_updates_and_offload_keeps_the_trainers_tensors() -> None:
    model = _model()
    trainer = _trainer(copy.deepcopy(model))
    cfg = EngineConfig(max_batch_size=4, max_seq_len=32)
    engine = EmbeddedEngine.over_shared_base(model.config, trainer.shared_base(), config=cfg)
    q = "model.layers.0.self_attn.q_proj.weight"
    with pytest.raises(WeightError, match="colocated trainer's frozen base"):
        engine.stage_weights([(q, torch.zeros_like(engine.stager.params[q]))])
    base = trainer.shared_base()

    async def go() -> None:
        assert len((await _generate(engine, 0))) == 12
        cache = engine.runner.cache
        kv = sum(t.untyped_storage().nbytes() for t in (cache.k, cache.v))
        released = await engine.offload("host")
        assert released == kv  # the KV cache alone: every weight is the trainer's
        assert all(t.untyped_storage().nbytes() > 0 for t in base.values())
        await engine.update_weights(list(trainer.export_weights(1 << 20))[0], 1)
        assert len((await _generate(engine, 1))) == 12
        await engine.close()

    asyncio.run(go())


def test_sharing_is_refused_where_it_cannot_work() -> None:
    model = _model()
    trainer = _trainer(copy.deepcopy(model))
    base = trainer.shared_base()
    assert sharing_problem(model.config, base, "cpu", torch.float32) is None
    assert "engine runs torch.bfloat16" in sharing_problem(model.config, base, "cpu", torch.bfloat16)
    moe = _model(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    assert "MoE" in sharing_problem(moe.config, moe.state_dict(), "cpu", torch.float32)
    with pytest.raises(ValueError, match="cannot serve the trainer's base weights shared"):
        EmbeddedEngine.over_shared_base(model.config, base, config=EngineConfig(dtype="bfloat16"))
    # a private copy where the dtype differs: nothing of it is shared
    half, names = engine_model(model.config, base, "cpu", torch.bfloat16)
    assert not names and half.model.embed_tokens.weight.dtype == torch.bfloat16


def test_a_colocated_worker_asks_for_the_base_and_a_cpu_trainer_says_why_not(tmp_path, caplog) -> None:
    """The run's wiring: colocated LoRA workers ask the trainer (``base_offer``); a CPU trainer
    cannot share with another process, so the worker's engine loads its own copy, merges, and
    says so in its log and in ``engine/lora_shared_base``."""
    import msgspec

    from miles.actors.factory import build_engine, wants_shared_base
    from miles.config import parse_args
    from miles.engines.shared import BaseOffer, offer, open_offer
    from miles.models import build_tiny_tokenizer, save_pretrained

    model = _model()
    save_pretrained(model, tmp_path / "ckpt", tokenizer=build_tiny_tokenizer())
    (tmp_path / "d.jsonl").write_text('{"input": "q", "label": "a"}\n')
    (tmp_path / "rm.py").write_text("def reward(s):\n    return 1.0\n")
    argv = ["--hf-checkpoint", str(tmp_path / "ckpt"), "--prompt-data", str(tmp_path / "d.jsonl"),
            "--custom-rm-path", f"{tmp_path / 'rm.py'}:reward", "--lora-rank", "4", "--colocate"]
    cfg = parse_args(argv)
    assert wants_shared_base(cfg)
    assert not wants_shared_base(parse_args(argv[:-1]))  # not colocated
    assert not wants_shared_base(parse_args([*argv, "--lora-target-modules", "all-linear", "lm_head"]))
    assert not wants_shared_base(parse_args([a for a in argv if a not in ("--lora-rank", "4")]))
    got = offer(_trainer(copy.deepcopy(model)))
    assert got.base is None and "CUDA IPC shares GPU memory only" in got.why_not
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(got), type=BaseOffer) == got  # crosses Ray as data
    assert open_offer(got, model.config, "cpu", torch.float32) == (None, got.why_not)
    full = EmbeddedTrainer(copy.deepcopy(model), config=TrainerConfig(lr=0.1, compile=False), algo=AlgorithmConfig())
    assert "full-parameter" in offer(full).why_not
    with caplog.at_level("WARNING"):
        engine = build_engine(cfg, base_offer=got)
    assert engine.stats()["engine/lora_shared_base"] == 0.0 and not engine.shared
    assert "merges the adapters" in caplog.text and "CUDA IPC shares GPU memory only" in caplog.text
    asyncio.run(engine.close())


def test_adjacent_rows_views_only_parts_that_follow_each_other() -> None:
    from miles.models.fused import adjacent_rows

    whole = torch.randn(10, 4)
    q, k, v = whole[:6], whole[6:8], whole[8:]
    fused = adjacent_rows([q, k, v])
    assert fused is not None and fused.data_ptr() == whole.data_ptr() and torch.equal(fused, whole)
    assert adjacent_rows([k, q, v]) is None  # out of order
    assert adjacent_rows([q, v]) is None  # a gap
    assert adjacent_rows([torch.randn(6, 4), torch.randn(2, 4)]) is None  # storages of their own


def test_unmerged_adapters_refuse_other_modules_and_mixed_ranks() -> None:
    model = _model()
    trainer = _trainer(copy.deepcopy(model))
    engine = EmbeddedEngine.over_shared_base(model.config, trainer.shared_base(),
                                             config=EngineConfig(max_batch_size=2, max_seq_len=32))
    h = model.config.hidden_size
    with pytest.raises(WeightError, match="unmerged"):
        engine.stage_weights([("lm_head.lora_A.weight", torch.zeros(4, h))])
    q = "model.layers.0.self_attn.q_proj"
    engine.stage_weights([(f"{q}.lora_A.weight", torch.zeros(4, h)), (f"{q}.lora_B.weight", torch.zeros(h, 2))])
    with pytest.raises(WeightError, match="one rank"):
        engine.stager.apply()
    assert engine.stager.adapters.num_modules == 0 and not engine.stager.adapters.buffers  # refused before any change
