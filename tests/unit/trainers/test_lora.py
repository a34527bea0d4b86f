"""LoRA RL (miles.trainers.lora, miles.engines.lora): adapters train over frozen base weights,
updates ship the adapters alone and the engine merges them, checkpoints are PEFT's format."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from miles.algorithms import AlgorithmConfig
from miles.engines import EmbeddedEngine, EngineConfig
from miles.engines.weights import WeightError
from miles.models import save_pretrained
from miles.trainers import EmbeddedTrainer, TrainerConfig
from miles.trainers.lora import lora_problems
from miles.types import GenerateRequest, SamplingParams, Trajectory
from tests.unit.trainers.conftest import make_model

TOL = 1e-5
GOOD = 100  # reward: the share of response tokens below this id (about a third at the start)


def _lora_trainer(model, rank: int = 4, targets=("all-linear",), lr: float = 3e-2, alpha: float = 2.0) -> EmbeddedTrainer:
    cfg = TrainerConfig(lr=lr, lora_rank=rank, lora_alpha=alpha * rank, lora_target_modules=list(targets))
    return EmbeddedTrainer(model, config=cfg, algo=AlgorithmConfig())


async def _rollout(engine: EmbeddedEngine, step: int) -> list[list[Trajectory]]:
    prompts = [[5, 6, 7], [9, 10], [11, 12, 13, 14]]
    groups = []
    for g, p in enumerate(prompts):
        sps = [SamplingParams(max_new_tokens=8, temperature=1.0, ignore_eos=True, seed=1000 * step + 10 * g + m)
               for m in range(6)]
        outs = await asyncio.gather(*(engine.generate(GenerateRequest(rid=f"s{step}g{g}m{m}", input_ids=p, sampling=sp))
                                      for m, sp in enumerate(sps)))
        members = []
        for m, out in enumerate(outs):
            t = Trajectory(id=f"s{step}g{g}m{m}", prompt_id=f"p{g}", group_id=f"s{step}g{g}", prompt_tokens=p)
            t.append(out.output_ids, out.logprobs, out.versions)
            t.reward = sum(tok < GOOD for tok in out.output_ids) / len(out.output_ids)
            members.append(t)
        groups.append(members)
    return groups


def test_lora_run_trains_adapters_over_frozen_base_and_engine_follows() -> None:
    model = make_model()
    engine = EmbeddedEngine(copy.deepcopy(model).eval(), config=EngineConfig(max_batch_size=32, max_seq_len=64))
    # The LM head too: this reward is about which tokens come out (the tiny model learns it
    # slowly through the decoder's projections alone).
    trainer = _lora_trainer(model, rank=8, targets=("all-linear", "lm_head"), lr=0.2)
    base = {k: v.clone() for k, v in trainer.model.state_dict().items() if ".lora_" not in k}
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    full_bytes = sum(v.numel() * 4 for v in base.values())

    async def go() -> tuple[list[float], list[float], int]:
        rewards, worst, shipped = [], [], 0
        for step in range(24):
            groups = await _rollout(engine, step)
            flat = [t for g in groups for t in g]
            got = trainer.compute_logprobs(flat)  # the engine runs the policy the trainer holds
            worst.append(max((torch.tensor(a) - torch.tensor(t.logprobs)).abs().max().item() for a, t in zip(got, flat)))
            rewards.append(sum(t.reward for t in flat) / len(flat))
            trainer.train_step(groups)
            for bucket in trainer.export_weights(1 << 20):
                assert all(".lora_A." in n or ".lora_B." in n for n, _ in bucket)
                shipped += sum(t.numel() * t.element_size() for _, t in bucket)
                await engine.update_weights(bucket, trainer.version)
        await engine.close()
        return rewards, worst, shipped

    rewards, worst, shipped = asyncio.run(go())
    # the engine merges W + s·BA while the trainer computes xW + s·(xA)B: float32 rounds the
    # two apart more as the adapters grow (lr 0.2 over 24 steps), so this run gets a wider bound
    # than the PEFT comparison below, where both sides hold the same adapters unmerged
    assert max(worst) < 5 * TOL, worst
    # the last third against the first four steps: one step's reward (144 tokens) is noisy, and
    # the trajectory's round-off differs with the BLAS thread count (+0.145 on one thread, +0.18 on two)
    assert sum(rewards[-8:]) / 8 > sum(rewards[:4]) / 4 + 0.10, rewards
    now = trainer.model.state_dict()
    assert all(torch.equal(now[k], v) for k, v in base.items())  # the base, bit for bit
    assert shipped < 24 * full_bytes * 0.5  # adapters only (r=8 on a tiny model is a large share of it)


def test_lora_checkpoint_holds_adapters_and_resumes() -> None:
    a = _lora_trainer(make_model())
    groups = asyncio.run(_groups_of(a))
    a.train_step(groups)
    state = a.state_dict()
    assert state["model"] and all(".lora_" in k for k in state["model"])
    b = _lora_trainer(make_model())
    b.load_state_dict(state)
    ma, mb = a.train_step(groups), b.train_step(groups)
    assert ma["train/loss"] == mb["train/loss"]
    sa, sb = a.model.state_dict(), b.model.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


async def _groups_of(trainer: EmbeddedTrainer) -> list[list[Trajectory]]:
    engine = EmbeddedEngine(copy.deepcopy(make_model()).eval(), config=EngineConfig(max_batch_size=32, max_seq_len=64))
    try:
        return await _rollout(engine, 0)
    finally:
        await engine.close()


def test_saved_adapter_loads_with_peft_and_matches_logits(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    model = make_model()
    save_pretrained(model, tmp_path / "base")
    trainer = _lora_trainer(model, rank=3, targets=("q_proj", "v_proj", "down_proj"))
    with torch.no_grad():  # a trained-looking adapter: B is zero at init
        for n, p in trainer.model.named_parameters():
            if ".lora_B." in n:
                p.normal_(0.0, 0.2)
    trainer.save_adapter(str(tmp_path / "adapter"), str(tmp_path / "base"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32)
    peft_model = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    trainer.model.eval()
    with torch.no_grad():
        ours, theirs = trainer.model(ids).logits, peft_model(input_ids=ids).logits
    assert (ours - theirs).abs().max().item() < TOL
    with torch.no_grad(), peft_model.disable_adapter():
        base_logits = peft_model(input_ids=ids).logits
    assert (ours - base_logits).abs().max().item() > 1e-2  # the adapter is really applied


def test_bad_lora_settings_fail_before_training() -> None:
    model = make_model()
    assert "matches no linear layer" in lora_problems(model, 4, ["qkv_proj"])[0]
    assert "larger than" in lora_problems(model, 10_000, ["q_proj"])[0]
    with pytest.raises(ValueError, match="matches no linear layer"):
        _lora_trainer(model, targets=("nope",))


def test_engine_refuses_adapter_of_unknown_module_or_wrong_shape() -> None:
    engine = EmbeddedEngine(make_model().eval(), config=EngineConfig(max_batch_size=2, max_seq_len=32))
    h = engine.model.config.hidden_size
    with pytest.raises(WeightError, match="not a linear weight"):
        engine.stage_weights([("model.layers.0.self_attn.nope.lora_A.weight", torch.zeros(2, h))])
    with pytest.raises(WeightError, match="expected"):
        engine.stage_weights([("model.layers.0.self_attn.q_proj.lora_A.weight", torch.zeros(2, h + 1))])


def test_lora_base_is_kept_in_the_compute_dtype() -> None:
    """With bf16 compute the frozen base matrices are stored in bf16 (half a float32 copy), the
    adapters, norms and embedding in float32; a step trains the adapters and leaves the base
    bit for bit; the forward equals the float32-base trainer's under the same autocast."""
    model = make_model()
    cfg = dict(lr=3e-2, lora_rank=4, lora_alpha=8.0, dtype="bfloat16")
    half = EmbeddedTrainer(copy.deepcopy(model), config=TrainerConfig(**cfg), algo=AlgorithmConfig())
    full = EmbeddedTrainer(copy.deepcopy(model), config=TrainerConfig(**{**cfg, "dtype": "float32"}),
                           algo=AlgorithmConfig())
    params = dict(half.model.named_parameters())
    base = {n: p for n, p in params.items() if not p.requires_grad and p.ndim == 2 and "embed_tokens" not in n}
    assert base and all(p.dtype == torch.bfloat16 for p in base.values())
    assert all(p.dtype == torch.float32 for n, p in params.items() if n not in base)
    assert params["model.embed_tokens.weight"].dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in full.model.parameters())
    bytes_of = lambda t: sum(p.numel() * p.element_size() for p in t.model.parameters())  # noqa: E731
    assert bytes_of(half) < 0.8 * bytes_of(full)
    frozen = {n: p.detach().clone() for n, p in base.items()}
    groups = [[Trajectory(id=f"g{g}m{m}", prompt_id=f"p{g}", group_id=f"g{g}", prompt_tokens=[5, 6, 7],
                          response_tokens=[8 + m, 9, 10 + g], logprobs=[-1.0] * 3, versions=[0] * 3,
                          loss_mask=[1] * 3, reward=float(m)) for m in range(4)] for g in range(2)]
    flat = [t for g in groups for t in g]
    a, b = half.compute_logprobs(flat), full.compute_logprobs(flat)
    assert max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)) < 0.05  # both bf16 GEMMs
    m = half.train_step(groups)
    assert m["train/optimizer_steps"] == 1.0
    assert all(torch.equal(p, frozen[n]) for n, p in base.items())
    assert any(p.grad is None and p.requires_grad for p in params.values())  # adapters trained, grads freed
    assert max((p - q).abs().max().item() for n, p in half.model.state_dict().items()
               if ".lora_B." in n for q in [torch.zeros_like(p)]) > 0
