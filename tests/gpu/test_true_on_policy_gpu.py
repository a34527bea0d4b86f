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


def test_every_gemm_tiling_sums_each_element_in_the_same_order() -> None:
    """The mode's GEMM picks its M × N tile by shape on CUDA (``gemm_config``); only the K tile
    fixes an element's sum, so every candidate tiling gives the same bits, at every M."""
    from miles.kernels import invariant as kernels

    g = torch.Generator(device="cuda").manual_seed(0)
    for N, K in ((1024, 2048), (4096, 1024), (3000, 1000)):
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
        for M in (1, 5, 64, 300):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=g)
            ref = kernels.matmul(x, w, config=kernels.CUDA_GEMMS[0])
            for cfg in kernels.CUDA_GEMMS[1:]:
                assert torch.equal(kernels.matmul(x, w, config=cfg), ref), (N, K, M, cfg)
            assert torch.equal(kernels.matmul(x[M // 2 : M // 2 + 1], w), ref[M // 2 : M // 2 + 1]), (N, K, M)


def test_attention_rows_agree_across_row_tiles_and_call_forms() -> None:
    """A query bounded by its key count gets the same bits with a 16- or 64-row tile, decoded
    over a cache or recomputed in a causal forward. (An equivalent bool mask compiles another
    kernel, whose bits can differ: the mode's engine and trainer pass key counts.)"""
    from miles.kernels import invariant as kernels

    g = torch.Generator(device="cuda").manual_seed(1)
    KV, G, D, T = 8, 2, 128, 150
    q = torch.randn(1, KV * G, T, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, KV, T, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(1, KV, T, D, device="cuda", dtype=torch.bfloat16, generator=g)
    full = kernels.attention(q, k, v, kernels.causal_nkeys(T, T, q.device))
    for bm in (16, 64):
        assert torch.equal(kernels.attention(q, k, v, kernels.causal_nkeys(T, T, q.device), block_m=bm), full)
    # decode form: row t is query t alone over the cache, its GQA group as the query axis
    qd = q[0].view(KV, G, T, D).permute(2, 0, 1, 3).contiguous()
    nk = torch.arange(1, T + 1, device="cuda", dtype=torch.int32)[:, None, None]
    kd, vd = k.expand(T, KV, T, D), v.expand(T, KV, T, D)
    want = full[0].view(KV, G, T, D).permute(2, 0, 1, 3)
    for bm in (None, 16, 64):
        assert torch.equal(kernels.attention(qd, kd, vd, nk, block_m=bm), want), bm


@pytest.mark.parametrize("norm", [True, False])
def test_qk_norm_rope_is_bitwise_the_unfused_bf16_ops(norm: bool) -> None:
    """The mode's one-launch q/k-norm + RoPE against the row-norm kernel then torch's bf16 RoPE
    ops (``fused.rope_qk``, the arithmetic the trainer's layers run), decode- and prefill-shaped."""
    from tests.unit.models.test_invariant_kernels import check_qk_norm_rope

    for B, T in ((64, 1), (3, 200)):
        check_qk_norm_rope(B, T, 16, 8, 128, norm, torch.bfloat16, "cuda", seed=2 + T)


def test_silu_mul_and_the_residual_epilogue_are_bitwise_the_eager_bf16_ops() -> None:
    """The decode layer's SiLU·up kernel against torch's ``F.silu(gate) * up``, and the GEMM's
    residual epilogue against ``h + matmul`` under every tiling, in bf16, decode- and
    prefill-shaped, over the range where SiLU's exp saturates too."""
    import torch.nn.functional as F

    from miles.kernels import invariant as kernels

    g = torch.Generator(device="cuda").manual_seed(7)
    edge = torch.tensor([-100.0, -88.0, -30.0, -1e-3, 0.0, 1e-3, 30.0, 88.0, 100.0], device="cuda")
    for M in (1, 64, 300):
        gu = (torch.randn(M, 2 * 3072, device="cuda", generator=g) * 6).to(torch.bfloat16)
        gu[:, : edge.numel()] = edge.to(torch.bfloat16)
        gate, up = gu.chunk(2, dim=-1)
        assert torch.equal(kernels.silu_mul(gu), F.silu(gate) * up), M
        x = torch.randn(M, 3072, device="cuda", dtype=torch.bfloat16, generator=g)
        w = torch.randn(1024, 3072, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
        h = torch.randn(M, 1024, device="cuda", dtype=torch.bfloat16, generator=g) * 4
        want = h + kernels.matmul(x, w)
        for cfg in kernels.CUDA_GEMMS:
            assert torch.equal(kernels.matmul(x, w, config=cfg, residual=h), want), (M, cfg)
