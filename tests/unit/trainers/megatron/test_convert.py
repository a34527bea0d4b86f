"""HF ↔ Megatron conversion as pure tensor functions: HF → per-rank shards for every
(TP, EP) degree → joined back → exactly the HF tensors (dense, MoE, shared expert + qkv bias,
tied embeddings), and the layouts themselves (grouped QKV, [gate_r; up_r] fc1)."""

from __future__ import annotations

import pytest
import torch

from miles.models import CausalLM, ModelConfig, tiny_config
from miles.trainers.megatron.convert import (
    Naming,
    glu_join,
    glu_shard,
    hf_shapes,
    hf_to_shard,
    param_specs,
    qkv_merge,
    qkv_split,
    shards_to_hf,
)
from miles.trainers.megatron.mapping import padded_vocab_size
from miles.trainers.megatron.weights import mapping_getter

MODELS = {
    "dense": lambda: tiny_config(),
    "dense_tied": lambda: tiny_config(tie_word_embeddings=True),
    "moe": lambda: tiny_config(moe=True),
    "qwen2_moe_shared": lambda: ModelConfig(
        model_type="qwen2_moe", vocab_size=288, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention_bias=True, num_experts=4,
        num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        decoder_sparse_step=2, norm_topk_prob=False),
}


def _hf_state(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    state = CausalLM(cfg).state_dict()
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight")
    return {k: v.clone() for k, v in state.items()}


def test_qkv_layout_is_grouped_per_query_group() -> None:
    heads, groups, d, h = 8, 2, 3, 5
    q, k, v = torch.randn(heads * d, h), torch.randn(groups * d, h), torch.randn(groups * d, h)
    fused = qkv_merge(q, k, v, num_groups=groups)
    hpg = heads // groups
    for g in range(groups):
        block = fused[g * (hpg + 2) * d : (g + 1) * (hpg + 2) * d]
        assert torch.equal(block[: hpg * d], q[g * hpg * d : (g + 1) * hpg * d])
        assert torch.equal(block[hpg * d : (hpg + 1) * d], k[g * d : (g + 1) * d])
        assert torch.equal(block[(hpg + 1) * d :], v[g * d : (g + 1) * d])
    back = qkv_split(fused, heads, groups, d)
    assert all(torch.equal(a, b) for a, b in zip(back, (q, k, v)))
    bias = qkv_merge(q[:, 0], k[:, 0], v[:, 0], num_groups=groups)  # 1-D biases use the same layout
    assert torch.equal(bias, fused[:, 0])


def test_fc1_shards_hold_gate_then_up_of_their_slice() -> None:
    gate, up = torch.randn(8, 3), torch.randn(8, 3)
    shards = [glu_shard(gate, up, 2, r) for r in range(2)]
    assert torch.equal(shards[1][:4], gate[4:]) and torch.equal(shards[1][4:], up[4:])
    g, u = glu_join(shards)
    assert torch.equal(g, gate) and torch.equal(u, up)


def _round_trip(cfg: ModelConfig, tp: int, ep: int, etp: int) -> dict[str, torch.Tensor]:
    """HF → every rank's shards (simulated on the CPU) → HF, as the exporter joins them."""
    hf = _hf_state(cfg)
    get = mapping_getter(hf)
    padded = padded_vocab_size(cfg.vocab_size, 128, tp)
    out: dict[str, torch.Tensor] = {}
    local_experts = cfg.num_experts // ep if cfg.is_moe else 0
    for spec in param_specs(cfg):
        if spec.expert is None:
            shards = [hf_to_shard(spec, get, cfg, tp_size=tp, tp_rank=r, padded_vocab=padded) for r in range(tp)]
            if spec.kind == "vocab":
                assert all(s.shape[0] == padded // tp for s in shards)
        else:
            owner = spec.expert // local_experts  # contiguous expert blocks per EP rank
            assert owner * local_experts <= spec.expert < (owner + 1) * local_experts
            shards = [hf_to_shard(spec, get, cfg, tp_size=etp, tp_rank=r) for r in range(etp)]
        for name, t in shards_to_hf(spec, shards, cfg):
            assert name not in out
            out[name] = t
    return out


LAYOUTS = [(1, 1, 1), (2, 1, 2), (1, 2, 1), (2, 2, 2), (2, 2, 1)]  # (tp, ep, etp)
CASES = [(m, *lay) for m in sorted(MODELS) for lay in LAYOUTS if lay[1] == 1 or "moe" in m]


@pytest.mark.parametrize("model, tp, ep, etp", CASES)
def test_hf_to_megatron_to_hf_is_exact(model: str, tp: int, ep: int, etp: int) -> None:
    cfg = MODELS[model]()
    hf = _hf_state(cfg)
    got = _round_trip(cfg, tp, ep, etp)
    assert set(got) == set(hf)
    for name, t in hf.items():
        assert torch.equal(got[name], t), name


@pytest.mark.parametrize("model", sorted(MODELS))
def test_hf_shapes_match_the_model(model: str) -> None:
    cfg = MODELS[model]()
    hf = _hf_state(cfg)
    for spec in param_specs(cfg):
        assert [tuple(hf[n].shape) for n in spec.hf] == hf_shapes(spec, cfg), spec.name


def test_names_of_both_layer_specs() -> None:
    cfg = tiny_config(moe=True)
    local = {s.name for s in param_specs(cfg)}
    te = {s.name for s in param_specs(cfg, Naming(te=True, grouped_experts=True))}
    assert "decoder.layers.0.input_layernorm.weight" in local
    assert "decoder.layers.0.mlp.experts.local_experts.7.linear_fc1.weight" in local
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in te
    assert "decoder.layers.0.mlp.experts.linear_fc2.weight7" in te
    assert "decoder.layers.0.pre_mlp_layernorm.weight" in te  # MoE layers keep a separate norm
    dense_te = {s.name for s in param_specs(tiny_config(), Naming(te=True))}
    assert "decoder.layers.1.mlp.linear_fc1.layer_norm_weight" in dense_te
    spec = next(s for s in param_specs(cfg) if s.expert == 5 and "fc2" in s.name)
    local = spec.local_name(layer_offset=0, expert_offset=4)
    assert local == "decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight"


def test_every_hf_tensor_is_covered_once() -> None:
    for make in MODELS.values():
        cfg = make()
        names = [n for s in param_specs(cfg) for n in s.hf]
        assert sorted(names) == sorted(_hf_state(cfg)), cfg.model_type
