"""CausalLM behaviour the trainer and engine rely on: padding, packing, routing replay,
hidden states, input checks, and ``token_logprobs``."""

from __future__ import annotations

import pytest
import torch

from miles.models import CausalLM, ModelConfig, token_logprobs, tiny_config


@pytest.fixture(scope="module")
def dense() -> CausalLM:
    torch.manual_seed(0)
    return CausalLM(tiny_config(initializer_range=0.1)).eval()


@pytest.fixture(scope="module")
def moe() -> CausalLM:
    torch.manual_seed(0)
    return CausalLM(tiny_config(moe=True, initializer_range=0.1)).eval()


@torch.no_grad()
def test_right_and_left_padding_match_unpadded(dense: CausalLM) -> None:
    a = torch.randint(5, 200, (9,))
    b = torch.randint(5, 200, (5,))
    ref_a, ref_b = dense(a[None]).logits[0], dense(b[None]).logits[0]
    right = torch.zeros(2, 9, dtype=torch.long)
    right[0], right[1, :5] = a, b
    mask = (torch.arange(9) < torch.tensor([[9], [5]])).long()
    out = dense(right, attention_mask=mask).logits
    assert torch.allclose(out[0], ref_a, atol=1e-5) and torch.allclose(out[1, :5], ref_b, atol=1e-5)
    left = torch.zeros(2, 9, dtype=torch.long)
    left[0], left[1, 4:] = a, b
    out = dense(left, attention_mask=mask.flip(-1)).logits
    assert torch.allclose(out[1, 4:], ref_b, atol=1e-5)
    assert torch.isfinite(out).all()  # fully masked pad rows stay finite


@torch.no_grad()
def test_packed_segments_match_separate_forwards(dense: CausalLM) -> None:
    a, b = torch.randint(5, 200, (6,)), torch.randint(5, 200, (4,))
    packed = torch.cat([a, b])[None]
    seg = torch.tensor([[0] * 6 + [1] * 4])
    pos = torch.tensor([list(range(6)) + list(range(4))])
    out = dense(packed, position_ids=pos, segment_ids=seg).logits[0]
    assert torch.allclose(out[:6], dense(a[None]).logits[0], atol=1e-5)
    assert torch.allclose(out[6:], dense(b[None]).logits[0], atol=1e-5)


@torch.no_grad()
def test_routing_replay(moe: CausalLM) -> None:
    ids = torch.randint(5, 200, (2, 10))
    out = moe(ids, return_routing=True)
    L, k = len(moe.moe_layers), moe.config.num_experts_per_tok
    assert out.routing.shape == (2, 10, L, k)
    replay = moe(ids, routing=out.routing, return_routing=True)
    assert torch.equal(replay.logits, out.logits)
    assert torch.equal(replay.routing, out.routing)
    other = (out.routing + 1) % moe.config.num_experts
    forced = moe(ids, routing=other, return_routing=True)
    assert torch.equal(forced.routing, other)
    assert not torch.allclose(forced.logits, out.logits)


def test_routing_replay_gradient_reaches_router(moe: CausalLM) -> None:
    ids = torch.randint(5, 200, (1, 6))
    with torch.no_grad():
        routing = moe(ids, return_routing=True).routing
    moe.zero_grad()
    moe(ids, routing=routing).logits.sum().backward()
    assert moe.model.layers[0].mlp.gate.weight.grad.abs().sum() > 0
    moe.zero_grad()


@torch.no_grad()
def test_hidden_and_logits_index(dense: CausalLM) -> None:
    ids = torch.randint(5, 200, (2, 7))
    full = dense(ids, return_hidden=True)
    assert full.hidden.shape == (2, 7, dense.config.hidden_size)
    assert torch.allclose(dense.lm_head(full.hidden).float(), full.logits)
    last = dense(ids, logits_index=torch.tensor([6, 3])).logits
    assert last.shape == (2, 1, dense.config.vocab_size)
    # allclose, not equal: the LM-head matmul over 2 rows vs 14 may take another kernel.
    assert torch.allclose(last[0, 0], full.logits[0, 6], atol=1e-5)
    assert torch.allclose(last[1, 0], full.logits[1, 3], atol=1e-5)


def test_bad_inputs_are_named(dense: CausalLM, moe: CausalLM) -> None:
    V = dense.config.vocab_size
    with pytest.raises(ValueError, match=f"token id {V} outside the vocabulary"):
        dense(torch.tensor([[1, V]]))
    with pytest.raises(ValueError, match="token id -1"):
        dense(torch.tensor([[-1, 3]]))
    with pytest.raises(ValueError, match="routing has shape"):
        moe(torch.tensor([[1, 2]]), routing=torch.zeros(1, 2, 1, 1, dtype=torch.long))
    bad = torch.full((1, 2, len(moe.moe_layers), moe.config.num_experts_per_tok), 99)
    with pytest.raises(ValueError, match="expert ids outside"):
        moe(torch.tensor([[1, 2]]), routing=bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_major_rope_is_the_same_arithmetic(dtype: torch.dtype) -> None:
    """The layers' token-major RoPE (``rope_qk_tokens``) and the engine's transposing form
    (``rope_qk``) give the same q and k, bitwise: only the memory layout differs."""
    from miles.models.fused import rope_qk, rope_qk_tokens
    from miles.models.layers import Rotary

    torch.manual_seed(0)
    cfg = tiny_config()
    B, T, H, KV, D = 2, 7, 4, 2, cfg.head_dim
    q, k = torch.randn(B, T, H, D, dtype=dtype), torch.randn(B, T, KV, D, dtype=dtype)
    cos, sin = Rotary(cfg)(torch.arange(T).repeat(B, 1) + 3, dtype)  # [B, 1, T, D]
    q1, k1 = rope_qk(q, k, cos, sin)
    q2, k2 = rope_qk_tokens(q, k, cos.transpose(1, 2), sin.transpose(1, 2))
    assert q2.is_contiguous() and k2.is_contiguous() and q2.dtype == dtype
    assert torch.equal(q2.transpose(1, 2), q1) and torch.equal(k2.transpose(1, 2), k1)


@pytest.mark.parametrize("frozen", [False, True])
def test_float32_rms_norm_with_autograd_is_the_fused_forward_and_the_exact_gradient(frozen: bool) -> None:
    """``fused.rms_norm`` under autograd (``_RMSNorm32``): the forward is ``F.rms_norm``'s,
    bitwise, and its gradients of x and of the weight match float64 autograd of the plain
    formula to float32 rounding; a frozen weight gets none."""
    from miles.models.fused import rms_norm

    torch.manual_seed(0)
    x = torch.randn(3, 5, 4, 24, requires_grad=True)
    w = (torch.rand(24) + 0.5).requires_grad_(not frozen)
    g = torch.randn(3, 5, 4, 24)
    out = rms_norm(x, w, 1e-6)
    assert out.grad_fn is not None and "RMSNorm32" in type(out.grad_fn).__name__
    assert torch.equal(out, torch.nn.functional.rms_norm(x.detach(), (24,), w.detach(), 1e-6))
    out.backward(g)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * w64).backward(g.double())
    torch.testing.assert_close(x.grad, x64.grad.float(), rtol=1e-5, atol=1e-5)
    if frozen:
        assert w.grad is None
    else:
        torch.testing.assert_close(w.grad, w64.grad.float(), rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # outside autograd: the plain fused op
        assert torch.equal(rms_norm(x, w, 1e-6), out.detach())


def test_rope_tables_packed_in_a_dtype_are_the_same_values() -> None:
    """``Rotary.reserve(dtype=...)``: cos and sin gathered from one table packed in that dtype
    (the engine's, one kernel) equal the float32 tables' gathers cast, bitwise, and the packed
    table survives the tables growing."""
    from miles.models.layers import Rotary

    cfg = tiny_config()
    pos = torch.tensor([[0, 5, 17], [3, 3, 90]])
    plain = Rotary(cfg)
    packed = Rotary(cfg)
    packed.reserve(64, "cpu", torch.bfloat16)
    for length in (64, 200):  # the second call grows the tables past position 90
        packed.reserve(length, "cpu")
        cos, sin = packed(pos.clamp(max=length - 1), torch.bfloat16)
        want_cos, want_sin = plain(pos.clamp(max=length - 1), torch.bfloat16)
        assert cos.shape == want_cos.shape == (2, 1, 3, cfg.head_dim)
        assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
        assert packed._packed[torch.bfloat16] is not None and packed._packed[torch.bfloat16].shape[0] >= length


def test_token_logprobs_matches_log_softmax() -> None:
    logits = torch.randn(3, 5, 11)
    toks = torch.randint(0, 11, (3, 5))
    ref = torch.log_softmax(logits / 0.7, -1).gather(-1, toks[..., None])[..., 0]
    assert torch.allclose(token_logprobs(logits, toks, 0.7), ref)
    temps = torch.tensor([[0.7] * 5] * 3)
    assert torch.allclose(token_logprobs(logits, toks, temps), ref)


def test_config_hf_roundtrip_and_errors() -> None:
    for cfg in (tiny_config(), tiny_config(moe=True), tiny_config(model_type="llama"),
                tiny_config(moe=True, model_type="qwen2_moe", shared_expert_intermediate_size=8,
                            attention_bias=True)):
        assert ModelConfig.from_hf(cfg.to_hf()) == cfg
    hf = tiny_config().to_hf()
    hf.pop("rope_theta")
    hf["rope_parameters"] = {"rope_type": "default", "rope_theta": 5000.0}  # transformers-5 form
    assert ModelConfig.from_hf(hf).rope_theta == 5000.0
    assert tiny_config(model_type="llama").qk_norm is False
    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        ModelConfig.from_hf({**hf, "model_type": "gpt2"})
    with pytest.raises(ValueError, match="rope_type 'longrope'"):
        ModelConfig.from_hf({**hf, "rope_parameters": {"rope_type": "longrope", "factor": 4.0}})
    with pytest.raises(ValueError, match="not a multiple"):
        tiny_config(num_key_value_heads=3)
    with pytest.raises(ValueError, match="no shared expert"):
        tiny_config(moe=True, shared_expert_intermediate_size=8).to_hf()
