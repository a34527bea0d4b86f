"""The engine's memory plan (miles.engines.memory): arithmetic and refusals, on the CPU."""

from __future__ import annotations

import pytest
import torch

from miles.engines.memory import (GiB, MemoryPlanError, activation_bytes, kv_bytes_per_token, plan_memory,
                                  trainer_state_bytes)
from miles.models import CausalLM, tiny_config
from miles.trainers.lora import apply_lora

QWEN3_8B = dict(num_hidden_layers=36, num_key_value_heads=8, head_dim=128, hidden_size=4096,
                intermediate_size=12288, num_attention_heads=32, vocab_size=151936)
QWEN3_32B = dict(num_hidden_layers=64, num_key_value_heads=8, head_dim=128, hidden_size=5120,
                 intermediate_size=25600, num_attention_heads=64, vocab_size=151936)


def test_plan_arithmetic() -> None:
    plan = plan_memory(total_bytes=100 * GiB, fraction=0.9, in_use_bytes=20 * GiB, weights_bytes=16 * GiB,
                       kv_bytes_per_token=1000, max_seq_len=4096, max_batch_size=10_000,
                       trainer_peak_bytes=30 * GiB, activation_bytes=GiB, margin_bytes=2 * GiB)
    budget = 90 * GiB - 20 * GiB - 30 * GiB - GiB - 2 * GiB
    assert plan.kv_tokens == budget // 1000
    assert plan.slots == budget // 1000 // 4096
    assert plan.kv_bytes == plan.slots * 4096 * 1000 <= budget
    assert "slots" in plan.describe() and "margin 2.00 GiB" in plan.describe()
    # capped by max_batch_size
    assert plan_memory(total_bytes=100 * GiB, fraction=1.0, in_use_bytes=0, weights_bytes=0,
                       kv_bytes_per_token=1000, max_seq_len=4096, max_batch_size=8).slots == 8


def test_plan_refuses_what_can_never_fit() -> None:
    with pytest.raises(MemoryPlanError, match="--engine-mem-fraction.*--max-seq-len"):
        plan_memory(total_bytes=10 * GiB, fraction=0.5, in_use_bytes=4 * GiB, weights_bytes=4 * GiB,
                    kv_bytes_per_token=1 << 20, max_seq_len=4096, max_batch_size=8, margin_bytes=GiB)
    with pytest.raises(MemoryPlanError, match="in \\(0, 1\\]"):
        plan_memory(total_bytes=GiB, fraction=1.5, in_use_bytes=0, weights_bytes=0, kv_bytes_per_token=1,
                    max_seq_len=2, max_batch_size=1)


def test_sizes_of_a_qwen3_8b_shape() -> None:
    cfg = tiny_config(**QWEN3_8B)
    assert kv_bytes_per_token(cfg, torch.bfloat16) == 2 * 36 * 8 * 128 * 2  # 144 KiB a token
    assert kv_bytes_per_token(cfg, torch.float8_e4m3fn) == 36 * 8 * 128 * 2
    assert activation_bytes(cfg, 64, 8192, torch.bfloat16) > 3 * 64 * 151936 * 4
    assert trainer_state_bytes(8_000_000_000, 8_000_000_000) == 16 * 8_000_000_000
    assert trainer_state_bytes(8_000_000_000, 8_000_000_000, offload_train=True) == 4 * 8_000_000_000


def test_a_qwen3_32b_lora_trainer_and_its_engine_fit_one_h200_only_with_a_bf16_base() -> None:
    cfg = tiny_config(**QWEN3_32B)
    with torch.device("meta"):
        model = CausalLM(cfg)
    n = sum(p.numel() for p in model.parameters())
    assert 32.5e9 < n < 33e9
    apply_lora(model, 16, 32.0, 0.0, ["all-linear"])
    adapters = sum(p.numel() for name, p in model.named_parameters() if ".lora_" in name)
    assert 100e6 < adapters < 200e6  # r=16 on every linear of the decoder: 0.4% of the model
    engine = 2 * n  # the engine's own bf16 copy
    h200 = 139 * GiB
    bf16_base = trainer_state_bytes(n, adapters, lora=True)
    assert engine + bf16_base < h200 - 8 * GiB  # room left for the KV cache and activations
    assert engine + trainer_state_bytes(n, adapters) > h200  # a float32 base beside it does not fit


QWEN3_06B = dict(num_hidden_layers=28, num_key_value_heads=8, head_dim=128, hidden_size=1024,
                 intermediate_size=3072, num_attention_heads=16, vocab_size=151936)


def _saved_bytes(model: CausalLM, input_ids: torch.Tensor) -> int:
    """Bytes autograd keeps for backward in one forward (each storage once, the parameters
    left out: they are the trainer's resident state), plus the logits."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(input_ids).logits
    return sum(seen.values()) + logits.numel() * logits.element_size()


def test_trainer_activation_bound_covers_what_autograd_saves() -> None:
    from miles.engines.memory import trainer_activation_bytes
    from miles.trainers.logprobs import CHUNK_BYTES

    cfg = tiny_config(num_hidden_layers=3, hidden_size=64, intermediate_size=192, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=512)
    torch.manual_seed(0)
    model = CausalLM(cfg).train()
    ids = torch.randint(0, cfg.vocab_size, (4, 32))
    saved = _saved_bytes(model, ids)
    bound = trainer_activation_bytes(cfg, ids.numel(), torch.float32) - 3 * CHUNK_BYTES
    assert saved <= bound <= 3 * saved, (saved, bound)
    ckpt = trainer_activation_bytes(cfg, ids.numel(), torch.float32, checkpointing=True) - 3 * CHUNK_BYTES
    assert ckpt < bound


def test_a_colocated_plan_reserves_the_trainers_micro_batch() -> None:
    """The 80 GB case: a Qwen3-0.6B shape colocated with a 32k-token micro-batch (eager) does not
    fit beside one sequence of KV, and the plan says so before the run starts; a 16k-token
    micro-batch leaves fewer slots than an 8k one."""
    from miles.engines.memory import colocated_trainer_peak, trainer_activation_bytes

    cfg = tiny_config(**QWEN3_06B)
    n, weights = 600_000_000, 1_200_000_000
    state = trainer_state_bytes(n, n)

    def slots(tokens: int, other_in_use: int) -> int:
        peak = colocated_trainer_peak(state, trainer_activation_bytes(cfg, tokens, torch.bfloat16), other_in_use)
        return plan_memory(total_bytes=80 * GiB, fraction=0.9, in_use_bytes=weights + other_in_use,
                           weights_bytes=weights, kv_bytes_per_token=kv_bytes_per_token(cfg, torch.bfloat16),
                           max_seq_len=2112, max_batch_size=256, trainer_peak_bytes=peak).slots

    assert 0 < slots(16384, 0) < slots(8192, 0) < 256
    # the trainer's state counts once, whether it was allocated before the engine's plan or not
    assert slots(8192, state) == slots(8192, 0)
    with pytest.raises(MemoryPlanError, match="--max-tokens-per-micro-batch"):
        slots(32768, 0)


def test_the_colocated_trainer_the_engine_plans_for() -> None:
    from miles.actors.factory import colocated_trainer_bytes
    from miles.config import default_config

    cfg = tiny_config(**QWEN3_06B)
    n = 600_000_000

    def of(**flags) -> tuple[int, int] | None:
        run = default_config(**flags)
        run = run.replace(device="cuda") if "device" not in flags else run
        return colocated_trainer_bytes(run, cfg, n)

    assert of(colocate=False) is None
    assert of(colocate=True, device="cpu") is None
    state, act = of(colocate=True, max_tokens_per_micro_batch=8192)
    assert state == 16 * n and act > 8192 * 2 * 151936 * 2
    assert of(colocate=True, max_tokens_per_micro_batch=4096)[1] < act
    assert of(colocate=True, max_tokens_per_micro_batch=8192, offload_rollout=True) == (state, 0)
    assert of(colocate=True, max_tokens_per_micro_batch=8192, offload_train=True)[0] == 4 * n


def test_a_colocated_trainer_without_a_micro_batch_limit_gets_one_the_plan_shares() -> None:
    """No --micro-batch-size nor --max-tokens-per-micro-batch: the plan once reserved a whole
    step at the full context (hundreds of GiB) and left the engine no KV cache. Now the
    plan and the trainer share a cap: a power of two whose activations fit the budget."""
    from miles.actors.factory import (COLOCATED_ACTIVATION_BUDGET, COLOCATED_MAX_TOKENS, colocated_micro_batch_tokens,
                                      colocated_trainer_bytes)
    from miles.config import default_config
    from miles.engines.memory import trainer_activation_bytes

    cfg = tiny_config(**QWEN3_06B)

    def run(**flags):
        return default_config(colocate=True, **flags).replace(device="cuda")

    cap = colocated_micro_batch_tokens(run(), cfg)
    assert cap is not None and cap & (cap - 1) == 0 and cap <= COLOCATED_MAX_TOKENS
    assert trainer_activation_bytes(cfg, cap, torch.bfloat16) <= COLOCATED_ACTIVATION_BUDGET
    assert trainer_activation_bytes(cfg, 2 * cap, torch.bfloat16) > COLOCATED_ACTIVATION_BUDGET or cap == COLOCATED_MAX_TOKENS
    assert colocated_trainer_bytes(run(), cfg, 600_000_000)[1] == trainer_activation_bytes(cfg, cap, torch.bfloat16)
    assert colocated_micro_batch_tokens(run(max_tokens_per_micro_batch=4096), cfg) is None  # the user's
    assert colocated_micro_batch_tokens(run(micro_batch_size=4), cfg) is None
    assert colocated_micro_batch_tokens(default_config(colocate=False).replace(device="cuda"), cfg) is None
    # a model whose one sequence outgrows the budget still trains one sequence a micro-batch
    wide = tiny_config(**{**QWEN3_06B, "vocab_size": 4_000_000, "max_position_embeddings": 8192})
    assert colocated_micro_batch_tokens(run(max_seq_len=4096), wide) == 4096
