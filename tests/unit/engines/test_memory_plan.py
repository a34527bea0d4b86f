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
