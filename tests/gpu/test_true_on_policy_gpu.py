"""--true-on-policy on CUDA (bf16, miles.kernels.invariant): the engine's recorded log-probs are
bitwise the trainer's recompute, dense and MoE (routing replay), with continuous batching, and a
sync train step reports rollout_logprob_abs_diff_max == 0.0 and tis_ratio_max == 1.0."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SMALL = dict(num_hidden_layers=4, hidden_size=1024, intermediate_size=3072, num_attention_heads=16,
             num_key_value_heads=8, head_dim=128, vocab_size=8192, rope_theta=1_000_000.0,
             max_position_embeddings=4096)


@pytest.mark.parametrize("moe", [False, True])
def test_engine_logprobs_are_the_trainers_bitwise(moe: bool) -> None:
    from benchmarks.true_on_policy import exactness

    shape = dict(SMALL, **(dict(model_type="qwen3_moe", moe_intermediate_size=512, num_experts=8,
                                num_experts_per_tok=2) if moe else {}))
    r = exactness(shape, "cuda", True)
    assert r["max_abs_diff"] == 0.0, r
    assert r["step_abs_diff_max"] == 0.0 and r["tis_ratio_max"] == 1.0, r
