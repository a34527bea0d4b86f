"""The Triton kernels of ``--true-on-policy`` on CUDA (miles.kernels.invariant), run in triton's
CPU interpreter (scripts/test.sh, MILES_KERNEL_TESTS=1): a row's output is bitwise the same in a
batch of one or of many, and decode over a cache (the engine's call forms) is bitwise the full
causal forward's row. Tiny shapes: the interpreter is slow."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from miles.kernels import invariant as kernels
from miles.models import invariant

pytestmark = pytest.mark.skipif(not kernels.available("cpu"), reason="needs triton's interpreter (TRITON_INTERPRET=1)")


@pytest.fixture
def on_cpu():
    with invariant.mode(keys=0, device="cpu", kernels=True):
        yield


def test_gemm_rows_and_columns_do_not_depend_on_the_batch() -> None:
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(70, 96, generator=g), torch.randn(40, 96, generator=g), torch.randn(40, generator=g)
    full = kernels.matmul(x, w, b)
    assert (full - F.linear(x, w, b)).abs().max() < 1e-4
    for rows in ([0], [69], [5, 20, 3], list(range(70))[::-1]):
        assert torch.equal(kernels.matmul(x[rows], w, b), full[rows])
    assert torch.equal(kernels.matmul(x[:3], w[7:30], b[7:30]), full[:3, 7:30])  # a fused projection's slice
    xb, wb = x.to(torch.bfloat16), w.to(torch.bfloat16)  # bf16 tiles: a product here too, as on CUDA
    assert (kernels.matmul(xb, wb).float() - F.linear(xb.float(), wb.float())).abs().max() < 0.25


def test_row_kernels_do_not_depend_on_the_batch() -> None:
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(9, 48, generator=g), torch.randn(48, generator=g)
    ref = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    for fn, want in ((lambda t: kernels.rms_norm(t, w, 1e-6), ref), (kernels.logsumexp, torch.logsumexp(x, -1)),
                     (kernels.softmax, torch.softmax(x, -1)), (kernels.log_softmax, torch.log_softmax(x, -1))):
        full = fn(x)
        assert (full - want).abs().max() < 1e-5
        assert torch.equal(fn(x[4:5]), full[4:5]) and torch.equal(fn(x[[8, 0]]), full[[8, 0]])
    wide = torch.randn(3, 5000, generator=g)  # more than one LSE_BLOCK of logits
    assert (kernels.logsumexp(wide) - torch.logsumexp(wide, -1)).abs().max() < 1e-5


def test_decode_over_a_cache_equals_the_full_causal_forward(on_cpu) -> None:
    """The engine's call forms through ``F.scaled_dot_product_attention``: decode (the GQA group
    as the query axis, a bool mask over a longer cache holding stale keys), prefill of a prefix
    and the trainer's right-padded mask, against its causal forward, bitwise."""
    g = torch.Generator().manual_seed(2)
    B, H, Hkv, T, D, S = 2, 4, 2, 9, 16, 80  # S > one key chunk
    q, k, v = (torch.randn(B, h, T, D, generator=g) for h in (H, Hkv, Hkv))
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    ref = invariant._F_SDPA(q, k, v, is_causal=True, enable_gqa=True)
    assert (full - ref).abs().max() < 1e-5
    kc, vc = torch.randn(B, Hkv, S, D, generator=g), torch.randn(B, Hkv, S, D, generator=g)
    kc[:, :, :T], vc[:, :, :T] = k, v
    for t in (0, 5, T - 1):
        mask = (torch.arange(S) <= t)[None, None, None, :].expand(B, 1, 1, S)
        one = F.scaled_dot_product_attention(q[:, :, t].reshape(B, Hkv, H // Hkv, D), kc, vc, attn_mask=mask)
        assert torch.equal(one.reshape(B, H, D), full[:, :, t])
    alone = F.scaled_dot_product_attention(q[1:, :, :4], k[1:, :, :4], v[1:, :, :4], is_causal=True, enable_gqa=True)
    assert torch.equal(alone[0], full[1, :, :4])  # a prefill, one row of the batch
    real = torch.ones(B, T, dtype=torch.bool)
    real[0, 6:] = False  # right padding: row 0 has 6 tokens
    mask = torch.ones(T, T, dtype=torch.bool).tril()[None, None] & real[:, None, None, :]
    padded = F.scaled_dot_product_attention(q, k, v, attn_mask=mask | torch.eye(T, dtype=torch.bool), enable_gqa=True)
    assert torch.equal(padded[0, :, :6], full[0, :, :6]) and torch.equal(padded[1], full[1])


def test_gradients_flow_through_the_wrapped_kernels(on_cpu) -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 32, generator=g, requires_grad=True)
    w = torch.randn(24, 32, generator=g, requires_grad=True)
    y = F.log_softmax(F.linear(x, w), dim=-1)
    y[:, 3].sum().backward()
    x2, w2 = x.detach().requires_grad_(True), w.detach().requires_grad_(True)
    invariant._F_LOG_SOFTMAX(invariant._F_LINEAR(x2, w2), -1)[:, 3].sum().backward()
    assert torch.allclose(x.grad, x2.grad, atol=1e-5) and torch.allclose(w.grad, w2.grad, atol=1e-5)


@pytest.mark.parametrize("moe", [False, True])
def test_engine_logprobs_equal_the_trainers_through_the_kernels(on_cpu, moe: bool) -> None:
    """The embedded engine (continuous batching: rows of different prompt lengths prefill,
    decode together and finish) against the trainer's recompute, with every GEMM, attention,
    RMSNorm, softmax and log-softmax in the mode's Triton kernels, in bf16 as on CUDA (a bf16
    engine; a trainer with float32 weights under bf16 autocast): bitwise equal. Without the mode
    the same pair differs by ~3e-2."""
    import asyncio
    import copy

    from miles.algorithms import AlgorithmConfig
    from miles.engines import EmbeddedEngine, EngineConfig
    from miles.trainers import EmbeddedTrainer, TrainerConfig
    from tests.unit.trainers.conftest import make_model
    from tests.unit.trainers.test_engine_consistency import _rollout

    extra = dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32) if moe else {}
    model = make_model(**extra)
    engine = EmbeddedEngine(copy.deepcopy(model).eval(), config=EngineConfig(
        max_batch_size=4, max_seq_len=64, decode_attention="sdpa", cpu_decode_kernel=False, dtype="bfloat16",
        decode_residual_gemm=False, decode_fused_mlp=False, compile=False))
    tr = EmbeddedTrainer(model, config=TrainerConfig(lr=1e-2, use_rollout_routing_replay=moe, dtype="bfloat16",
                                                     true_on_policy_check="strict"),
                         algo=AlgorithmConfig(use_tis=True))
    trajs = asyncio.run(_rollout(engine, [[5, 6, 7, 8], [9, 10], [9, 10, 11, 12, 13]], 1.0, moe))
    got = tr.compute_logprobs(trajs)
    assert all(a == t.logprobs for a, t in zip(got, trajs))


def check_qk_norm_rope(B: int, T: int, H: int, KV: int, D: int, norm: bool, dtype: torch.dtype, device: str,
                       seed: int = 3) -> None:
    """``kernels.qk_norm_rope`` against the row-norm kernel then ``fused.rope_qk`` (torch's own
    ops), bit for bit, from a random qkv projection and the rotary tables as the engine holds them."""
    from miles.models import fused
    from miles.models.config import tiny_config
    from miles.models.layers import Rotary

    g = torch.Generator(device=device).manual_seed(seed)
    qkv = torch.randn(B, T, (H + 2 * KV) * D, device=device, generator=g).to(dtype)
    qn, kn = (torch.rand(D, device=device, generator=g) + 0.5 if norm else None for _ in range(2))
    rotary = Rotary(tiny_config(head_dim=D, num_attention_heads=H, num_key_value_heads=KV, hidden_size=H * D,
                                rope_theta=1_000_000.0))
    rotary.reserve(4096, device, dtype)
    cos, sin = rotary(torch.randint(0, 4000, (B, T), device=device, generator=g), dtype)
    got = kernels.qk_norm_rope(qkv, H, KV, qn, kn, 1e-6, cos, sin)
    q, k, _ = qkv.view(B, T, H + 2 * KV, D).split((H, KV, KV), dim=2)
    if norm:
        q, k = kernels.rms_norm(q, qn, 1e-6), kernels.rms_norm(k, kn, 1e-6)
    wq, wk = fused.rope_qk(q, k, cos, sin)
    assert torch.equal(got[:, :, :H].transpose(1, 2), wq) and torch.equal(got[:, :, H:].transpose(1, 2), wk)
    if norm and dtype == torch.bfloat16 and device == "cpu":
        # the row-norm kernel rounds as torch's ops do, too (on CUDA torch's mean sums a row in
        # an order of its own: the mode's trainer runs the kernel, so only the roundings matter)
        assert torch.equal(q, invariant._rms_norm_ref(qkv.view(B, T, H + 2 * KV, D)[:, :, :H], qn, 1e-6))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [True, False])
def test_qk_norm_rope_is_bitwise_the_unfused_ops(norm: bool, dtype: torch.dtype) -> None:
    """The one-launch q/k-norm + RoPE equals the unfused ops (torch's, which round every bf16
    product and sum) bit for bit, in triton's interpreter (the same check runs on CUDA)."""
    check_qk_norm_rope(3, 5, 4, 2, 16, norm, dtype, "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_residual_epilogue_is_the_unfused_add(dtype: torch.dtype) -> None:
    """``matmul(x, w, residual=h)`` is ``h + matmul(x, w)`` (torch's add of the rounded GEMM
    output) bit for bit, with and without a bias, and per row as in a batch."""
    g = torch.Generator().manual_seed(4)
    x, w, b = (torch.randn(*s, generator=g).to(dtype) for s in ((21, 96), (40, 96), (40,)))
    h = (torch.randn(21, 40, generator=g) * 3).to(dtype)
    for bias in (None, b):
        want = h + kernels.matmul(x, w, bias)
        got = kernels.matmul(x, w, bias, residual=h)
        assert torch.equal(got, want)
        assert torch.equal(kernels.matmul(x[[3, 17]], w, bias, residual=h[[3, 17]]), got[[3, 17]])
    with pytest.raises(ValueError, match="residual"):
        kernels.matmul(x, w, residual=h[:, :5])


def test_silu_mul_rounds_as_torch_and_does_not_depend_on_the_batch() -> None:
    """The one-launch SiLU·up: each row alone as in the batch, and torch's value (on CUDA its
    bits, ``tests/gpu``; the interpreter's exp is numpy's, so here within a bf16 rounding)."""
    g = torch.Generator().manual_seed(5)
    gu = (torch.randn(7, 2 * 1500, generator=g) * 4).to(torch.bfloat16)  # more than one program a row
    got = kernels.silu_mul(gu)
    gate, up = gu.chunk(2, dim=-1)
    want = F.silu(gate) * up
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    assert ((got.float() - want.float()).abs() <= want.float().abs() * 2**-7 + 1e-30).all()
    assert torch.equal(kernels.silu_mul(gu[2:3]), got[2:3])
    with pytest.raises(ValueError, match="even"):
        kernels.silu_mul(gu[:, :-1])
