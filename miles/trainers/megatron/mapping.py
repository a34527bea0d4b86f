"""HF config (``miles.models.ModelConfig``) → megatron-core ``TransformerConfig`` / ``GPTModel`` arguments.

Pure functions over plain dicts: no megatron-core import, so the mapping is tested on any
machine. ``miles.trainers.megatron.model`` turns the dicts into megatron objects.

The mapping (Megatron-Bridge's Qwen3 bridges and slime's Qwen3 scripts agree on it):

| HF | Megatron |
| --- | --- |
| num_hidden_layers, hidden_size, intermediate_size | num_layers, hidden_size, ffn_hidden_size |
| num_attention_heads, num_key_value_heads, head_dim | num_attention_heads, num_query_groups, kv_channels |
| rms_norm_eps | layernorm_epsilon (RMSNorm) |
| qwen3 q/k norm | qk_layernorm=True |
| qwen2 q/k/v bias | add_qkv_bias=True (add_bias_linear stays False: o_proj/MLP have none) |
| rope_theta, max_position_embeddings | GPTModel(rotary_base, max_sequence_length), rope |
| tie_word_embeddings | GPTModel(share_embeddings_and_output_weights) |
| num_experts, num_experts_per_tok, moe_intermediate_size | num_moe_experts, moe_router_topk, moe_ffn_hidden_size |
| norm_topk_prob | moe_router_pre_softmax = not norm_topk_prob, score function softmax |
| decoder_sparse_step, mlp_only_layers | moe_layer_freq (a 0/1 list when not every layer is MoE) |
| shared_expert_intermediate_size (qwen2_moe) | moe_shared_expert_intermediate_size + moe_shared_expert_gate |

Megatron's default MoE routing (top-k on the logits, then softmax over those k) equals HF's
softmax → top-k → renormalise; with ``norm_topk_prob=False`` Megatron takes the softmax over
all experts first (pre-softmax) and keeps the k values, as HF does.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from miles.models import ModelConfig
from miles.trainers.megatron.config import MegatronConfig, MegatronConfigError

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen3_moe", "qwen2", "qwen2_moe", "llama")


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron-LM's rule: the next multiple of ``divisible_by × tp``. Padded rows are zero
    and their logits are masked out of every softmax (``logprobs``), then stripped on export."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def moe_layer_freq(model: ModelConfig) -> int | list[int]:
    """1 when every layer is MoE, else a per-layer 0/1 list (Megatron's ``moe_layer_freq``)."""
    pattern = [int(model.is_moe_layer(i)) for i in range(model.num_hidden_layers)]
    return 1 if all(pattern) else pattern


def check_supported(model: ModelConfig, cfg: MegatronConfig) -> None:
    """Raise MegatronConfigError / ValueError naming what this model and layout cannot do."""
    if model.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"the Megatron backend supports model_type {SUPPORTED_MODEL_TYPES}, got {model.model_type!r}")
    if model.rope_scaling:
        raise ValueError(f"rope_scaling {model.rope_scaling!r} is not mapped to Megatron (default RoPE only)")
    if model.o_proj_bias:
        raise ValueError("attention_bias on o_proj is not mapped to Megatron (add_bias_linear would also "
                         "put biases on the MLP)")
    tp, ep, pp = cfg.tensor_model_parallel_size, cfg.expert_model_parallel_size, cfg.pipeline_model_parallel_size
    if model.num_attention_heads % tp:
        raise MegatronConfigError("tensor_model_parallel_size",
                                  f"num_attention_heads {model.num_attention_heads} is not divisible by {tp}")
    if model.num_key_value_heads % tp:
        raise MegatronConfigError("tensor_model_parallel_size",
                                  f"num_key_value_heads {model.num_key_value_heads} is not divisible by {tp}")
    if model.num_hidden_layers % pp:
        raise MegatronConfigError("pipeline_model_parallel_size",
                                  f"num_hidden_layers {model.num_hidden_layers} is not divisible by {pp}")
    ffn = [model.intermediate_size] if any(not model.is_moe_layer(i) for i in range(model.num_hidden_layers)) else []
    for size in ffn:
        if size % tp:
            raise MegatronConfigError("tensor_model_parallel_size",
                                      f"intermediate_size {size} is not divisible by {tp}")
    if model.is_moe:
        if model.num_experts % ep:
            raise MegatronConfigError("expert_model_parallel_size",
                                      f"num_experts {model.num_experts} is not divisible by {ep}")
        for name in ("moe_intermediate_size", "shared_expert_intermediate_size"):
            size = getattr(model, name)
            if size and size % cfg.etp:
                raise MegatronConfigError("expert_tensor_parallel_size", f"{name} {size} is not divisible by {cfg.etp}")
    elif ep > 1:
        raise MegatronConfigError("expert_model_parallel_size", "> 1 needs a MoE model (num_experts > 0)")


def check_trainable(model: ModelConfig, cfg: MegatronConfig) -> None:
    """What training (not just building / converting) additionally needs."""
    check_supported(model, cfg)
    if model.is_moe and cfg.expert_model_parallel_size > 1 and cfg.moe_token_dispatcher_type != "alltoall":
        raise MegatronConfigError("moe_token_dispatcher_type", "--expert-model-parallel-size > 1 needs "
                                  "'alltoall' (data-parallel ranks' micro-batches differ in length)")
    if model.is_moe and cfg.tensor_model_parallel_size > 1 and not cfg.sequence_parallel:
        # megatron-core's MoELayer refuses to train with TP > 1 unless sequence parallelism is on
        raise MegatronConfigError("sequence_parallel", "a MoE model with --tensor-model-parallel-size > 1 "
                                  "needs --sequence-parallel (and so the transformer_engine layer spec)")


def transformer_config_kwargs(
    model: ModelConfig,
    cfg: MegatronConfig,
    *,
    dtype: torch.dtype,
    gradient_checkpointing: bool = False,
    use_te: bool = False,
    cpu_init: bool = False,
) -> dict[str, Any]:
    """Keyword arguments of ``TransformerConfig`` for this model and layout."""
    check_supported(model, cfg)
    bf16 = dtype == torch.bfloat16
    kw: dict[str, Any] = dict(
        num_layers=model.num_hidden_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.intermediate_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_key_value_heads,
        kv_channels=model.head_dim,
        layernorm_epsilon=model.rms_norm_eps,
        normalization="RMSNorm",
        qk_layernorm=bool(model.qk_norm),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=bool(model.attention_bias),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=model.initializer_range,
        bf16=bf16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        # micro-batches differ in shape; only pipeline p2p needs to be told (and Megatron's
        # allgather dispatcher refuses the flag)
        variable_seq_lengths=cfg.pipeline_model_parallel_size > 1,
        # The trainer normalises its loss itself (global token / sequence counts), so the
        # schedule must neither divide by token counts nor average over data-parallel ranks.
        calculate_per_token_loss=True,
        tensor_model_parallel_size=cfg.tensor_model_parallel_size,
        pipeline_model_parallel_size=cfg.pipeline_model_parallel_size,
        context_parallel_size=cfg.context_parallel_size,
        expert_model_parallel_size=cfg.expert_model_parallel_size,
        expert_tensor_parallel_size=cfg.etp,
        sequence_parallel=cfg.sequence_parallel,
        use_cpu_initialization=cpu_init,
        # Megatron's default (allgather) rejects variable_seq_lengths even for dense models
        moe_token_dispatcher_type=cfg.moe_token_dispatcher_type,
        # Fused kernels that need apex / TE / compiled extensions stay off on the local spec.
        masked_softmax_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
    )
    granularity = cfg.recompute_granularity or ("full" if gradient_checkpointing else None)
    if granularity is not None:
        kw["recompute_granularity"] = granularity
        if granularity == "full":
            kw.update(recompute_method=cfg.recompute_method, recompute_num_layers=cfg.recompute_num_layers)
    if model.is_moe:
        kw.update(
            num_moe_experts=model.num_experts,
            moe_router_topk=model.num_experts_per_tok,
            moe_ffn_hidden_size=model.moe_intermediate_size,
            moe_layer_freq=moe_layer_freq(model),
            moe_router_pre_softmax=not model.norm_topk_prob,
            moe_router_score_function="softmax",
            moe_router_load_balancing_type="aux_loss" if cfg.moe_aux_loss_coeff > 0 else "none",
            moe_aux_loss_coeff=cfg.moe_aux_loss_coeff,
            moe_router_dtype=cfg.moe_router_dtype,
            moe_grouped_gemm=use_te,
            moe_permute_fusion=False,
            moe_enable_routing_replay=True,  # inert until the trainer switches a replay on
        )
        if model.shared_expert_intermediate_size:
            kw.update(moe_shared_expert_intermediate_size=model.shared_expert_intermediate_size,
                      moe_shared_expert_gate=True)
    return kw


def gpt_model_kwargs(model: ModelConfig, cfg: MegatronConfig) -> dict[str, Any]:
    """Keyword arguments of ``GPTModel`` besides ``config`` and ``transformer_layer_spec``."""
    return dict(
        vocab_size=padded_vocab_size(model.vocab_size, cfg.make_vocab_size_divisible_by,
                                     cfg.tensor_model_parallel_size),
        max_sequence_length=model.max_position_embeddings,
        share_embeddings_and_output_weights=bool(model.tie_word_embeddings),
        position_embedding_type="rope",
        rotary_percent=1.0,
        rotary_base=model.rope_theta,
        parallel_output=True,
    )
