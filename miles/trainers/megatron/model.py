"""Build a megatron-core ``GPTModel`` for a Qwen3 / Qwen3-MoE (and Qwen2 / Llama) HF config.

``build_gpt`` needs Megatron's parallel state (``distributed.init_parallel``); it picks the
layer spec (Transformer Engine when ``transformer_impl`` resolves to it, else the local
spec), builds this pipeline stage's layers, and casts the model to the training dtype
(Megatron-LM's ``Float16Module`` does the same cast). Weights come from ``weights.load_hf``.

Version notes (checked against megatron-core 0.16.1 on Python 3.11 and 0.19.2 on 3.12):

- both have ``get_gpt_decoder_block_spec`` (honours ``moe_layer_freq`` and the pipeline
  slice), ``RouterReplay`` and the same TransformerConfig fields used here;
- 0.16.1 without Transformer Engine leaves ``moe_utils.te_general_gemm`` undefined, so the
  router's gating GEMM raises NameError; ``_compat`` defines it as None (the torch path);
- the local spec's ``DotProductAttention`` materialises [b, h, s, s] scores; with
  ``local_core_attention="sdpa"`` it is swapped for ``SDPACoreAttention`` (same module,
  forward through ``torch.nn.functional.scaled_dot_product_attention``, causal, GQA).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from typing import Any

import torch
import torch.nn.functional as F

from miles.models import ModelConfig
from miles.trainers.megatron.config import MegatronConfig, MegatronConfigError
from miles.trainers.megatron.convert import Naming
from miles.trainers.megatron.mapping import gpt_model_kwargs, transformer_config_kwargs

EXTRA_HINT = "pip install miles[megatron]"


def require_megatron() -> Any:
    """Import megatron.core, or raise ImportError naming the extra to install."""
    try:
        import megatron.core as core
    except ImportError as exc:
        raise ImportError(f"the Megatron trainer backend needs megatron-core: {EXTRA_HINT} "
                          f"(import failed: {exc})") from exc
    return core


def megatron_version() -> tuple[int, ...]:
    core = require_megatron()
    parts = []
    for p in str(getattr(core, "__version__", "0")).split(".")[:3]:
        digits = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


@functools.cache
def te_available() -> bool:
    if importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        importlib.import_module("transformer_engine.pytorch")
    except Exception:  # a broken TE install counts as absent (the local spec still works)
        return False
    return True


def resolve_impl(cfg: MegatronConfig) -> str:
    """"local" or "transformer_engine"; raises when the choice cannot work here."""
    impl = cfg.transformer_impl
    if impl == "auto":
        impl = "transformer_engine" if te_available() else "local"
    if impl == "transformer_engine" and not te_available():
        raise MegatronConfigError("transformer_impl", "transformer_engine is not importable; use 'local'")
    if impl == "local":
        if cfg.context_parallel_size > 1:
            raise MegatronConfigError("context_parallel_size", "> 1 needs the transformer_engine layer spec")
        if cfg.sequence_parallel:
            raise MegatronConfigError("sequence_parallel", "needs the transformer_engine layer spec "
                                      "(the local spec's torch norms do not support it)")
    return impl


def naming_for(impl: str) -> Naming:
    return Naming(te=impl == "transformer_engine", grouped_experts=impl == "transformer_engine")


def _compat() -> None:
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


@functools.cache
def sdpa_core_attention() -> type:
    """``DotProductAttention`` whose forward runs torch SDPA for the causal, unmasked case
    (the trainer's right-padded batches) and defers to Megatron's code otherwise."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    class SDPACoreAttention(DotProductAttention):
        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None, **kwargs):  # type: ignore[no-untyped-def]
            mask_type = attn_mask_type or self.attn_mask_type
            if (attention_mask is not None or attention_bias is not None or packed_seq_params is not None
                    or mask_type != AttnMaskType.causal or kwargs):
                return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                                       attention_bias=attention_bias, packed_seq_params=packed_seq_params,
                                       **kwargs)
            # [s, b, heads, d] → [b, heads, s, d]
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale,
                                                 enable_gqa=q.shape[1] != k.shape[1])
            s, b = out.shape[2], out.shape[0]
            return out.permute(2, 0, 1, 3).reshape(s, b, -1)

    return SDPACoreAttention


def transformer_config(model: ModelConfig, cfg: MegatronConfig, *, dtype: torch.dtype,
                       gradient_checkpointing: bool = False, cpu_init: bool = False,
                       impl: str | None = None) -> Any:
    """megatron-core ``TransformerConfig`` for ``model`` (fields this version lacks are an error)."""
    require_megatron()
    import dataclasses

    from megatron.core.transformer import TransformerConfig

    impl = impl or resolve_impl(cfg)
    kw = transformer_config_kwargs(model, cfg, dtype=dtype, gradient_checkpointing=gradient_checkpointing,
                                   use_te=impl == "transformer_engine", cpu_init=cpu_init)
    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    kw["transformer_impl"] = impl
    # Always initialise: megatron-core 0.16 sets the tensor-parallel attributes of a parameter
    # (which the grad-norm and clipping read) only inside its init functions on the CPU path.
    kw["perform_initialization"] = True
    missing = sorted(k for k in kw if k not in fields)
    if missing:
        raise RuntimeError(f"megatron-core {megatron_version()} lacks TransformerConfig fields {missing}; "
                           f"{EXTRA_HINT} installs a supported version")
    return TransformerConfig(**kw)


def layer_spec(tcfg: Any, impl: str, core_attention: str) -> Any:
    """The decoder block spec of this pipeline stage (dense / MoE layers per moe_layer_freq)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    spec = get_gpt_decoder_block_spec(tcfg, use_transformer_engine=impl == "transformer_engine",
                                      normalization="RMSNorm")
    if impl == "local":
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        # Without TE the final norm may resolve to apex FusedLayerNorm, which has no RMSNorm.
        spec.layer_norm = WrappedTorchNorm
        if core_attention == "sdpa":
            for layer in spec.layer_specs:
                layer.submodules.self_attention.submodules.core_attention = sdpa_core_attention()
    return spec


def build_gpt(model: ModelConfig, cfg: MegatronConfig, *, dtype: torch.dtype, device: str,
              gradient_checkpointing: bool = False) -> Any:
    """This pipeline stage's ``GPTModel`` (parallel state must exist), in ``dtype`` on ``device``."""
    require_megatron()
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    _compat()
    impl = resolve_impl(cfg)
    cpu = not device.startswith("cuda")
    tcfg = transformer_config(model, cfg, dtype=dtype, gradient_checkpointing=gradient_checkpointing,
                              cpu_init=cpu, impl=impl)
    gpt = GPTModel(
        config=tcfg,
        transformer_layer_spec=layer_spec(tcfg, impl, cfg.local_core_attention),
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
        **gpt_model_kwargs(model, cfg),
    )
    gpt.to(device=torch.device("cpu") if cpu else torch.cuda.current_device(), dtype=dtype)
    gpt.miles_impl = impl
    return gpt


def unwrap(module: Any) -> Any:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(module, "module") and not hasattr(module, "decoder"):
        module = module.module
    return module


class hidden_states_only:  # noqa: N801 - used as a context manager
    """Make ``GPTModel.forward`` return the decoder's final hidden states ([s, b, h], after
    the final norm) instead of logits, so the trainer applies the LM head only at response
    positions (``GPTModel._postprocess`` returns early when ``post_process`` is False)."""

    def __init__(self, gpt: Any) -> None:
        self.gpt = gpt

    def __enter__(self) -> None:
        self.saved = self.gpt.post_process
        self.gpt.post_process = False

    def __exit__(self, *exc: Any) -> None:
        self.gpt.post_process = self.saved


def output_weight(gpt: Any) -> Any:
    """This rank's vocab shard of the LM head ([V_pad/tp, h]); the embedding when tied."""
    if gpt.share_embeddings_and_output_weights:
        return gpt.shared_embedding_or_output_weight()
    return gpt.output_layer.weight
