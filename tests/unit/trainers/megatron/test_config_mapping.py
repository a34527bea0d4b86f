"""MegatronConfig validation and the HF config → TransformerConfig / GPTModel mapping (pure;
no megatron-core needed), and the clear error when megatron-core is missing."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from miles.models import ModelConfig
from miles.trainers.megatron.config import MegatronConfig, MegatronConfigError, data_parallel_size
from miles.trainers.megatron.mapping import (
    check_supported,
    check_trainable,
    gpt_model_kwargs,
    moe_layer_freq,
    padded_vocab_size,
    transformer_config_kwargs,
)

# config.json of Qwen3-0.6B and Qwen3-30B-A3B (the fields that matter here)
QWEN3_06B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 1024,
    "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
    "head_dim": 128, "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 1000000,
    "max_position_embeddings": 40960, "tie_word_embeddings": True, "attention_bias": False,
}
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
    "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "hidden_act": "silu", "rms_norm_eps": 1e-6,
    "rope_theta": 1000000, "max_position_embeddings": 40960, "tie_word_embeddings": False,
    "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "router_aux_loss_coef": 0.001,
}


def test_defaults_and_flag_names() -> None:
    cfg = MegatronConfig()
    assert (cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size, cfg.context_parallel_size,
            cfg.expert_model_parallel_size, cfg.sequence_parallel) == (1, 1, 1, 1, False)
    assert cfg.etp == 1 and MegatronConfig(tensor_model_parallel_size=4).etp == 4
    assert MegatronConfig(tensor_model_parallel_size=4, expert_tensor_parallel_size=1).etp == 1


@pytest.mark.parametrize("kw, flag", [
    (dict(tensor_model_parallel_size=0), "--tensor-model-parallel-size"),
    (dict(expert_model_parallel_size=-1), "--expert-model-parallel-size"),
    (dict(sequence_parallel=True), "--sequence-parallel"),
    (dict(transformer_impl="te"), "--transformer-impl"),
    (dict(recompute_granularity="some"), "--recompute-granularity"),
    (dict(moe_aux_loss_coeff=-1.0), "--moe-aux-loss-coeff"),
])
def test_bad_values_name_the_flag(kw: dict, flag: str) -> None:
    with pytest.raises(MegatronConfigError, match=flag):
        MegatronConfig(**kw)


def test_data_parallel_size() -> None:
    assert data_parallel_size(MegatronConfig(tensor_model_parallel_size=2), 8) == 4
    assert data_parallel_size(MegatronConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2), 8) == 2
    with pytest.raises(MegatronConfigError, match="not a multiple"):
        data_parallel_size(MegatronConfig(tensor_model_parallel_size=3), 8)
    with pytest.raises(MegatronConfigError, match="expert-model-parallel-size"):
        data_parallel_size(MegatronConfig(expert_model_parallel_size=4, tensor_model_parallel_size=2), 4)


def test_qwen3_dense_mapping() -> None:
    model = ModelConfig.from_hf(QWEN3_06B)
    kw = transformer_config_kwargs(model, MegatronConfig(), dtype=torch.bfloat16)
    assert kw["num_layers"] == 28 and kw["hidden_size"] == 1024 and kw["ffn_hidden_size"] == 3072
    assert kw["num_attention_heads"] == 16 and kw["num_query_groups"] == 8
    assert kw["kv_channels"] == 128  # heads × head_dim (2048) ≠ hidden (1024): must be explicit
    assert kw["normalization"] == "RMSNorm" and kw["layernorm_epsilon"] == 1e-6
    assert kw["qk_layernorm"] is True and kw["gated_linear_unit"] is True and kw["activation_func"] is F.silu
    assert kw["add_bias_linear"] is False and kw["add_qkv_bias"] is False
    assert kw["hidden_dropout"] == 0.0 and kw["attention_dropout"] == 0.0
    assert kw["bf16"] is True and kw["params_dtype"] is torch.bfloat16
    assert kw["calculate_per_token_loss"] is True
    assert "num_moe_experts" not in kw and "recompute_granularity" not in kw
    g = gpt_model_kwargs(model, MegatronConfig())
    assert g["share_embeddings_and_output_weights"] is True
    assert g["rotary_base"] == 1e6 and g["position_embedding_type"] == "rope" and g["max_sequence_length"] == 40960
    assert g["vocab_size"] == 151936  # 151936 = 128 · 1187: no padding at TP 1
    assert gpt_model_kwargs(model, MegatronConfig(tensor_model_parallel_size=2))["vocab_size"] == 152064


def test_qwen3_moe_mapping() -> None:
    model = ModelConfig.from_hf(QWEN3_30B_A3B)
    cfg = MegatronConfig(expert_model_parallel_size=8, pipeline_model_parallel_size=4)
    kw = transformer_config_kwargs(model, cfg, dtype=torch.bfloat16)
    assert kw["num_moe_experts"] == 128 and kw["moe_router_topk"] == 8 and kw["moe_ffn_hidden_size"] == 768
    # norm_topk_prob=True ⇔ top-k on the logits, then softmax over the k (no pre-softmax)
    assert kw["moe_router_pre_softmax"] is False and kw["moe_router_score_function"] == "softmax"
    assert kw["moe_layer_freq"] == 1 and kw["num_query_groups"] == 4
    assert kw["moe_router_load_balancing_type"] == "none" and kw["moe_aux_loss_coeff"] == 0.0
    assert kw["moe_enable_routing_replay"] is True and kw["variable_seq_lengths"] is True
    assert kw["expert_model_parallel_size"] == 8 and kw["moe_token_dispatcher_type"] == "alltoall"
    assert "moe_shared_expert_intermediate_size" not in kw
    assert gpt_model_kwargs(model, cfg)["share_embeddings_and_output_weights"] is False
    no_norm = ModelConfig.from_hf({**QWEN3_30B_A3B, "norm_topk_prob": False})
    assert transformer_config_kwargs(no_norm, cfg, dtype=torch.float32)["moe_router_pre_softmax"] is True
    aux = transformer_config_kwargs(model, MegatronConfig(moe_aux_loss_coeff=1e-3), dtype=torch.float32)
    assert aux["moe_router_load_balancing_type"] == "aux_loss" and aux["moe_aux_loss_coeff"] == 1e-3


def test_mixed_layers_shared_expert_and_qkv_bias() -> None:
    model = ModelConfig(model_type="qwen2_moe", vocab_size=100, hidden_size=32, intermediate_size=64,
                        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, attention_bias=True,
                        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                        shared_expert_intermediate_size=48, decoder_sparse_step=2, norm_topk_prob=False)
    assert moe_layer_freq(model) == [0, 1, 0, 1]
    kw = transformer_config_kwargs(model, MegatronConfig(), dtype=torch.float32)
    assert kw["moe_layer_freq"] == [0, 1, 0, 1] and kw["ffn_hidden_size"] == 64
    assert kw["moe_shared_expert_intermediate_size"] == 48 and kw["moe_shared_expert_gate"] is True
    assert kw["add_qkv_bias"] is True and kw["add_bias_linear"] is False and kw["qk_layernorm"] is False


def test_recompute_flags() -> None:
    model = ModelConfig.from_hf(QWEN3_06B)
    kw = transformer_config_kwargs(model, MegatronConfig(), dtype=torch.float32, gradient_checkpointing=True)
    assert (kw["recompute_granularity"], kw["recompute_method"], kw["recompute_num_layers"]) == ("full", "uniform", 1)
    kw = transformer_config_kwargs(model, MegatronConfig(recompute_granularity="selective"), dtype=torch.float32)
    assert kw["recompute_granularity"] == "selective" and "recompute_method" not in kw


def test_padded_vocab_size() -> None:
    assert padded_vocab_size(151936, 128, 1) == 151936
    assert padded_vocab_size(151936, 128, 2) == 152064
    assert padded_vocab_size(288, 128, 1) == 384
    assert padded_vocab_size(288, 1, 2) == 288


@pytest.mark.parametrize("hf, cfg, match", [
    ({**QWEN3_06B, "num_key_value_heads": 2}, MegatronConfig(tensor_model_parallel_size=4), "num_key_value_heads"),
    (QWEN3_06B, MegatronConfig(pipeline_model_parallel_size=3), "num_hidden_layers"),
    (QWEN3_06B, MegatronConfig(expert_model_parallel_size=2), "needs a MoE model"),
    (QWEN3_30B_A3B, MegatronConfig(expert_model_parallel_size=3), "num_experts"),
    ({**QWEN3_06B, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}, MegatronConfig(), "rope_scaling"),
    ({**QWEN3_06B, "attention_bias": True}, MegatronConfig(), "o_proj"),
])
def test_unsupported_layouts_are_named(hf: dict, cfg: MegatronConfig, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        check_supported(ModelConfig.from_hf(hf), cfg)


def test_what_training_moe_needs_beyond_building() -> None:
    model = ModelConfig.from_hf(QWEN3_30B_A3B)
    check_supported(model, MegatronConfig(tensor_model_parallel_size=2))  # builds and converts
    with pytest.raises(MegatronConfigError, match="--sequence-parallel"):
        check_trainable(model, MegatronConfig(tensor_model_parallel_size=2))
    check_trainable(model, MegatronConfig(tensor_model_parallel_size=2, sequence_parallel=True))
    allgather = MegatronConfig(expert_model_parallel_size=2, moe_token_dispatcher_type="allgather")
    check_supported(model, allgather)
    with pytest.raises(MegatronConfigError, match="alltoall"):
        check_trainable(model, allgather)


def test_missing_megatron_core_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from miles.algorithms import AlgorithmConfig
    from miles.models import tiny_config
    from miles.trainers import TrainerConfig
    from miles.trainers.megatron.model import require_megatron
    from miles.trainers.megatron.trainer import MegatronTrainer

    monkeypatch.setitem(sys.modules, "megatron", None)
    monkeypatch.setitem(sys.modules, "megatron.core", None)
    with pytest.raises(ImportError, match=r"pip install miles\[megatron\]"):
        require_megatron()
    with pytest.raises(ImportError, match=r"pip install miles\[megatron\]"):
        MegatronTrainer(tiny_config(), config=TrainerConfig(), algo=AlgorithmConfig())


def test_build_needs_a_checkpoint() -> None:
    from miles.config import default_config
    from miles.trainers.megatron import build_megatron_trainer
    from miles.trainers.megatron.launch import megatron_section

    cfg = default_config()
    assert megatron_section(cfg) == MegatronConfig()
    with pytest.raises(ValueError, match="--hf-checkpoint"):
        build_megatron_trainer(cfg)


def test_megatron_flags_parse() -> None:
    """``megatron`` is a section of the run config: its fields are ``--tensor-model-parallel-size``
    ... without colliding with any other section's flag."""
    from miles.config import build_parser, parse_args, resolve
    from miles.trainers.megatron.launch import megatron_section

    ns = build_parser("miles train").parse_args([
        "--train-backend", "megatron", "--actor-num-gpus-per-node", "8", "--tensor-model-parallel-size", "2",
        "--expert-model-parallel-size", "4", "--sequence-parallel", "--transformer-impl", "local"])
    cfg = resolve({k: v for k, v in vars(ns).items() if k != "config"}, check=False)
    m = megatron_section(cfg)
    assert (m.tensor_model_parallel_size, m.expert_model_parallel_size, m.sequence_parallel) == (2, 4, True)
    assert cfg.run.train_backend == "megatron"
    with pytest.raises(Exception, match="tensor-model-parallel-size"):
        parse_args(["--tensor-model-parallel-size", "0"])


@pytest.mark.parametrize("argv, match", [
    ([], "--actor-num-gpus-per-node"),
    (["--actor-num-gpus-per-node", "3", "--tensor-model-parallel-size", "2"], "world size 3"),
])
def test_run_level_megatron_problems(argv: list[str], match: str) -> None:
    """What only the whole run config can tell: GPUs for the trainer, a layout that divides
    the trainer's world."""
    from miles.config import ConfigError, parse_args

    with pytest.raises(ConfigError, match=match):
        parse_args(["--train-backend", "megatron", *argv])


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_colocated_ranks_fit_on_the_first_gpu(workers: int) -> None:
    """--colocate with several ranks is a valid run: the driving PolicyTrainer actor, rank 0
    and every rollout worker split the first GPU (Ray refuses a bundle asked for more than
    one GPU); disaggregated, the driver and rank 0 share it."""
    pytest.importorskip("megatron.core")
    from miles.config import build_parser, resolve
    from miles.trainers.megatron.launch import first_gpu_share
    from miles.validation import _problems

    ns = build_parser("miles train").parse_args([
        "--train-backend", "megatron", "--actor-num-gpus-per-node", "2", "--device", "cuda",
        "--tensor-model-parallel-size", "2", "--colocate", "--num-rollout-workers", str(workers)])
    cfg = resolve({k: v for k, v in vars(ns).items() if k != "config"}, check=False)
    assert not [p for p in _problems(cfg) if "colocate" in p or "megatron" in p.lower()]
    share = first_gpu_share(cfg.run.colocate, cfg.run.num_rollout_workers)
    assert 0 < (2 + workers) * share <= 1.0 + 1e-9
    assert 2 * first_gpu_share(False, workers) <= 1.0


def test_missing_megatron_core_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    from miles.config import ConfigError, parse_args

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("megatron") else real(name, *a))
    with pytest.raises(ConfigError, match=r"miles\[megatron\]"):
        parse_args(["--train-backend", "megatron", "--actor-num-gpus-per-node", "1"])


def test_factory_dispatches_on_train_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    from miles.actors import factory
    from miles.config import resolve

    seen = []
    monkeypatch.setattr("miles.trainers.megatron.launch.build_megatron_trainer", lambda cfg: seen.append(cfg) or "mg")
    cfg = resolve({"train_backend": "megatron", "actor_num_gpus_per_node": 1}, check=False)
    assert factory.build_policy_trainer(cfg) == "mg" and seen == [cfg]


def test_default_dtype_is_bfloat16() -> None:
    """``--dtype auto`` (the default) is bfloat16 for the CUDA-only Megatron trainer; the H200
    run found it unhandled."""
    from miles.trainers.config import TrainerConfig
    from miles.trainers.megatron.trainer import _dtype

    assert _dtype(TrainerConfig().dtype) == torch.bfloat16
    assert _dtype("float32") == torch.float32
