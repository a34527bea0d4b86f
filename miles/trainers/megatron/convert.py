"""HF ↔ Megatron weight conversion as pure tensor functions (no megatron-core, no collectives).

``param_specs(model, naming)`` lists every Megatron parameter of the whole model with the HF
tensors it is made of, in HF checkpoint order. For one parameter:

- ``hf_to_shard(spec, get, ...)`` builds the shard a (tensor-parallel) rank holds;
- ``shards_to_hf(spec, shards, ...)`` joins the shards of all TP ranks back into HF tensors.

The loader (``model.load_hf``) and the exporter (``export``) use these with the rank's
layout and, for export, collectives; the unit tests run the round trip for every TP / EP
degree by splitting into per-rank shards on the CPU.

Layouts (megatron-core ``ColumnParallelLinear`` / ``RowParallelLinear`` / ``VocabParallelEmbedding``):

- column-parallel weights are cut along dim 0, row-parallel along dim 1, the embedding and
  the output layer along the (padded) vocabulary;
- ``linear_qkv`` is grouped by query group: for each of the ``ng`` groups its ``h/ng`` query
  heads, then its key head, then its value head; rank r holds whole groups
  ``[r·ng/tp, (r+1)·ng/tp)``, i.e. a plain dim-0 chunk of the grouped tensor;
- ``linear_fc1`` is ``[gate; up]``, and under TP rank r holds ``[gate_r; up_r]``;
- experts are placed contiguously over expert-parallel ranks (rank r owns
  ``[r·E/EP, (r+1)·E/EP)``) and tensor-split over the *expert* tensor-parallel group.

Names: the local layer spec keeps the norms as modules (``input_layernorm``,
``pre_mlp_layernorm``) and experts as ``SequentialMLP`` (``experts.local_experts.{l}.*``);
the Transformer Engine spec fuses the norms into ``linear_qkv.layer_norm_weight`` and (dense
layers) ``linear_fc1.layer_norm_weight``, and grouped experts are ``experts.linear_fc1.weight{l}``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from miles.models import ModelConfig

REPLICATED, VOCAB, COLUMN, ROW, QKV, GLU = "replicated", "vocab", "column", "row", "qkv", "glu"


@dataclass(frozen=True)
class Naming:
    """Which layer spec's parameter names to use."""

    te: bool = False  # Transformer Engine spec (fused norms)
    grouped_experts: bool = False  # TEGroupedMLP (``weight{l}``) instead of SequentialMLP


@dataclass(frozen=True)
class ParamSpec:
    """One Megatron parameter. ``template`` has ``{layer}`` / ``{expert}`` fields;
    ``name`` is it with the global indices filled in."""

    template: str
    hf: tuple[str, ...]
    kind: str
    layer: int | None = None
    expert: int | None = None

    @property
    def name(self) -> str:
        return self.template.format(layer=self.layer, expert=self.expert)

    def local_name(self, layer_offset: int = 0, expert_offset: int = 0) -> str:
        """The name in a pipeline stage whose first layer is ``layer_offset`` and an expert
        rank whose first expert is ``expert_offset``."""
        layer = None if self.layer is None else self.layer - layer_offset
        expert = None if self.expert is None else self.expert - expert_offset
        return self.template.format(layer=layer, expert=expert)


def _layer_specs(model: ModelConfig, naming: Naming, i: int) -> list[ParamSpec]:
    hf = f"model.layers.{i}."
    mg = "decoder.layers.{layer}."
    out: list[ParamSpec] = []

    def add(template: str, names: tuple[str, ...], kind: str, expert: int | None = None) -> None:
        out.append(ParamSpec(mg + template, tuple(hf + n for n in names), kind, i, expert))

    add("self_attention.linear_qkv.layer_norm_weight" if naming.te else "input_layernorm.weight",
        ("input_layernorm.weight",), REPLICATED)
    add("self_attention.linear_qkv.weight",
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"), QKV)
    if model.attention_bias:
        add("self_attention.linear_qkv.bias",
            ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"), QKV)
    if model.qk_norm:
        add("self_attention.q_layernorm.weight", ("self_attn.q_norm.weight",), REPLICATED)
        add("self_attention.k_layernorm.weight", ("self_attn.k_norm.weight",), REPLICATED)
    add("self_attention.linear_proj.weight", ("self_attn.o_proj.weight",), ROW)
    moe = model.is_moe_layer(i)
    add("mlp.linear_fc1.layer_norm_weight" if naming.te and not moe else "pre_mlp_layernorm.weight",
        ("post_attention_layernorm.weight",), REPLICATED)
    if not moe:
        add("mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight"), GLU)
        add("mlp.linear_fc2.weight", ("mlp.down_proj.weight",), ROW)
        return out
    add("mlp.router.weight", ("mlp.gate.weight",), REPLICATED)
    for e in range(model.num_experts):
        ex = f"mlp.experts.{e}."
        if naming.grouped_experts:
            fc1, fc2 = "mlp.experts.linear_fc1.weight{expert}", "mlp.experts.linear_fc2.weight{expert}"
        else:
            fc1 = "mlp.experts.local_experts.{expert}.linear_fc1.weight"
            fc2 = "mlp.experts.local_experts.{expert}.linear_fc2.weight"
        add(fc1, (ex + "gate_proj.weight", ex + "up_proj.weight"), GLU, e)
        add(fc2, (ex + "down_proj.weight",), ROW, e)
    if model.shared_expert_intermediate_size:
        add("mlp.shared_experts.linear_fc1.weight",
            ("mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight"), GLU)
        add("mlp.shared_experts.linear_fc2.weight", ("mlp.shared_expert.down_proj.weight",), ROW)
        add("mlp.shared_experts.gate_weight", ("mlp.shared_expert_gate.weight",), REPLICATED)
    return out


def param_specs(model: ModelConfig, naming: Naming = Naming()) -> list[ParamSpec]:
    """Every Megatron parameter of the full model, in HF checkpoint order."""
    specs = [ParamSpec("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), VOCAB)]
    for i in range(model.num_hidden_layers):
        specs += _layer_specs(model, naming, i)
    specs.append(ParamSpec("decoder.final_layernorm.weight", ("model.norm.weight",), REPLICATED))
    if not model.tie_word_embeddings:
        specs.append(ParamSpec("output_layer.weight", ("lm_head.weight",), VOCAB))
    return specs


# ---- layouts --------------------------------------------------------------------------------


def qkv_merge(q: Tensor, k: Tensor, v: Tensor, num_groups: int) -> Tensor:
    """HF q [h·d, …], k / v [g·d, …] → Megatron's grouped [g·(h/g + 2)·d, …]."""
    rest = q.shape[1:]
    qg = q.reshape(num_groups, -1, *rest)  # [g, (h/g)·d, …]
    kg = k.reshape(num_groups, -1, *rest)
    vg = v.reshape(num_groups, -1, *rest)
    return torch.cat([qg, kg, vg], dim=1).reshape(-1, *rest)


def qkv_split(fused: Tensor, num_heads: int, num_groups: int, head_dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """Inverse of ``qkv_merge``."""
    rest = fused.shape[1:]
    hpg = num_heads // num_groups
    g = fused.reshape(num_groups, hpg + 2, head_dim, *rest)
    q = g[:, :hpg].reshape(num_heads * head_dim, *rest)
    k = g[:, hpg].reshape(num_groups * head_dim, *rest)
    v = g[:, hpg + 1].reshape(num_groups * head_dim, *rest)
    return q, k, v


def glu_shard(gate: Tensor, up: Tensor, size: int, rank: int) -> Tensor:
    """Rank ``rank``'s ``[gate_r; up_r]`` of a fused fc1 split over ``size`` ranks."""
    return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]], dim=0)


def glu_join(shards: list[Tensor]) -> tuple[Tensor, Tensor]:
    """Inverse of ``glu_shard`` over all ranks: (gate, up)."""
    halves = [s.chunk(2, dim=0) for s in shards]
    return torch.cat([h[0] for h in halves], dim=0), torch.cat([h[1] for h in halves], dim=0)


def pad_rows(t: Tensor, rows: int) -> Tensor:
    if t.shape[0] == rows:
        return t
    pad = t.new_zeros(rows - t.shape[0], *t.shape[1:])
    return torch.cat([t, pad], dim=0)


def hf_to_shard(
    spec: ParamSpec,
    get: Callable[[str], Tensor],
    model: ModelConfig,
    *,
    tp_size: int = 1,
    tp_rank: int = 0,
    padded_vocab: int | None = None,
) -> Tensor:
    """The shard of ``spec`` on tensor-parallel rank ``tp_rank`` of ``tp_size`` (for expert
    parameters: the expert tensor-parallel group), built from HF tensors ``get(name)``."""
    tensors = [get(n) for n in spec.hf]
    if spec.kind == REPLICATED:
        return tensors[0]
    if spec.kind == VOCAB:
        full = pad_rows(tensors[0], padded_vocab or model.vocab_size)
        return full.chunk(tp_size, dim=0)[tp_rank]
    if spec.kind == COLUMN:
        return tensors[0].chunk(tp_size, dim=0)[tp_rank]
    if spec.kind == ROW:
        return tensors[0].chunk(tp_size, dim=1)[tp_rank]
    if spec.kind == QKV:
        return qkv_merge(*tensors, num_groups=model.num_key_value_heads).chunk(tp_size, dim=0)[tp_rank]
    if spec.kind == GLU:
        return glu_shard(tensors[0], tensors[1], tp_size, tp_rank)
    raise ValueError(f"unknown parameter kind {spec.kind!r}")


def shards_to_hf(spec: ParamSpec, shards: list[Tensor], model: ModelConfig) -> list[tuple[str, Tensor]]:
    """Join the shards of all TP ranks (rank order) into the HF tensors of ``spec``."""
    if spec.kind == REPLICATED:
        return [(spec.hf[0], shards[0])]
    if spec.kind == VOCAB:
        return [(spec.hf[0], torch.cat(shards, dim=0)[: model.vocab_size])]
    if spec.kind in (COLUMN, ROW):
        return [(spec.hf[0], torch.cat(shards, dim=0 if spec.kind == COLUMN else 1))]
    if spec.kind == QKV:
        full = torch.cat(shards, dim=0)
        q, k, v = qkv_split(full, model.num_attention_heads, model.num_key_value_heads, model.head_dim)
        return list(zip(spec.hf, (q, k, v)))
    if spec.kind == GLU:
        return list(zip(spec.hf, glu_join(shards)))
    raise ValueError(f"unknown parameter kind {spec.kind!r}")


def hf_shapes(spec: ParamSpec, model: ModelConfig) -> list[tuple[int, ...]]:
    """Shapes of the HF tensors of ``spec`` (what the exporter allocates on ranks that do
    not own the parameter, before a pipeline broadcast)."""
    h, d = model.hidden_size, model.head_dim
    shapes: list[tuple[int, ...]] = []
    for name in spec.hf:
        leaf = name.rsplit(".", 2)[-2] if name.endswith((".weight", ".bias")) else name
        bias = name.endswith(".bias")
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            shapes.append((model.vocab_size, h))
        elif leaf == "q_proj":
            shapes.append((model.num_attention_heads * d,) if bias else (model.num_attention_heads * d, h))
        elif leaf in ("k_proj", "v_proj"):
            shapes.append((model.num_key_value_heads * d,) if bias else (model.num_key_value_heads * d, h))
        elif leaf in ("q_norm", "k_norm"):
            shapes.append((d,))
        elif leaf == "o_proj":
            shapes.append((h, model.num_attention_heads * d))
        elif leaf in ("gate_proj", "up_proj", "down_proj"):
            inter = (model.moe_intermediate_size if ".experts." in name
                     else model.shared_expert_intermediate_size if ".shared_expert." in name
                     else model.intermediate_size)
            shapes.append((h, inter) if leaf == "down_proj" else (inter, h))
        elif leaf == "gate":
            shapes.append((model.num_experts, h))
        elif leaf == "shared_expert_gate":
            shapes.append((1, h))
        else:  # norms
            shapes.append((h,))
    return shapes
