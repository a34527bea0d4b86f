"""ModelConfig: the architecture of a Qwen3 / Qwen3-MoE / Qwen2(-MoE) / Llama style decoder.

Field names are the Hugging Face ``config.json`` keys, so ``from_hf`` reads a released
checkpoint's config and ``to_hf`` writes one that ``transformers`` loads as the matching
``*ForCausalLM``. The same struct drives the embedded engine and the embedded trainer
(one model definition, so rollout and training compute the same log-probs).

Supported ``model_type``s and what distinguishes them here:

- ``llama``: no q/k-norm; ``attention_bias`` puts a bias on q, k, v *and* o.
- ``qwen2``: no q/k-norm; bias on q, k, v only (``attention_bias`` True, ``o_proj_bias`` False).
- ``qwen3``: q/k-norm (RMSNorm over each head); ``attention_bias`` on q, k, v and o.
- ``qwen3_moe``: qwen3 attention; MoE MLP on the layers ``decoder_sparse_step`` selects,
  top-k softmax router, optional renormalisation of the top-k weights (``norm_topk_prob``).
- ``qwen2_moe``: qwen2 attention; MoE plus a shared expert with a sigmoid gate.
"""

from __future__ import annotations

from typing import Any

import msgspec

MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class ConfigError(ValueError):
    """A model config is invalid or asks for something this model does not implement."""


class ModelConfig(msgspec.Struct, kw_only=True):
    model_type: str = "qwen3"
    vocab_size: int = 151936
    hidden_size: int = 1024
    intermediate_size: int = 3072
    num_hidden_layers: int = 28
    num_attention_heads: int = 16
    num_key_value_heads: int = 8
    head_dim: int = 0  # 0 → hidden_size // num_attention_heads
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    # HF ``rope_scaling`` / ``rope_parameters`` beyond the base: {"rope_type": "llama3", ...}.
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q_proj, k_proj, v_proj
    o_proj_bias: bool | None = None  # None → same as attention_bias (llama/qwen3); qwen2: False
    qk_norm: bool | None = None  # None → True for qwen3 / qwen3_moe
    # ---- MoE (num_experts == 0 → dense) ----
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0  # 0 → no shared expert
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = []
    # ---- special tokens ----
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        if self.head_dim == 0 and self.num_attention_heads:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.qk_norm is None:
            self.qk_norm = self.model_type in ("qwen3", "qwen3_moe")
        if self.o_proj_bias is None:
            self.o_proj_bias = self.attention_bias and self.model_type not in ("qwen2", "qwen2_moe")
        self.validate()

    # ---- derived -----------------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        """Qwen-MoE's rule for which decoder layers get the sparse MLP."""
        return (
            self.is_moe
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return [self.eos_token_id] if isinstance(self.eos_token_id, int) else list(self.eos_token_id)

    def validate(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ConfigError(msg)

        need(self.model_type in MODEL_TYPES, f"model_type {self.model_type!r} not in {MODEL_TYPES}")
        need(self.hidden_act == "silu", f"hidden_act {self.hidden_act!r} unsupported (only silu)")
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "max_position_embeddings"):
            need(getattr(self, name) > 0, f"{name} must be > 0, got {getattr(self, name)}")
        need(self.num_attention_heads % self.num_key_value_heads == 0,
             f"num_attention_heads {self.num_attention_heads} is not a multiple of "
             f"num_key_value_heads {self.num_key_value_heads}")
        need(self.head_dim % 2 == 0, f"head_dim {self.head_dim} must be even for RoPE")
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        need(rope_type in _ROPE_TYPES, f"rope_type {rope_type!r} unsupported ({_ROPE_TYPES})")
        if self.is_moe:
            need(0 < self.num_experts_per_tok <= self.num_experts,
                 f"num_experts_per_tok {self.num_experts_per_tok} not in [1, {self.num_experts}]")
            need(self.moe_intermediate_size > 0, "moe_intermediate_size must be > 0 for MoE")
            need(self.decoder_sparse_step > 0, "decoder_sparse_step must be > 0")
            need(self.model_type in ("qwen2_moe", "qwen3_moe"),
                 f"num_experts > 0 needs a MoE model_type, got {self.model_type!r}")
        else:
            need(self.intermediate_size > 0, "intermediate_size must be > 0")
        if self.shared_expert_intermediate_size:
            need(self.is_moe, "a shared expert needs num_experts > 0")

    # ---- Hugging Face config.json ------------------------------------------------------
    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Read a Hugging Face ``config.json`` dict (old ``rope_theta``/``rope_scaling`` keys or
        transformers-5 ``rope_parameters``)."""
        model_type = hf.get("model_type", "")
        if model_type not in MODEL_TYPES:
            raise ConfigError(f"model_type {model_type!r} not in {MODEL_TYPES}")
        if hf.get("mlp_bias"):
            raise ConfigError("mlp_bias=True is not supported")
        if hf.get("use_sliding_window"):
            raise ConfigError("use_sliding_window=True is not supported")
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
        if "type" in rope and "rope_type" not in rope:
            rope["rope_type"] = rope.pop("type")
        rope_scaling = rope if rope.get("rope_type", "default") != "default" else None
        qwen2 = model_type in ("qwen2", "qwen2_moe")
        kw: dict[str, Any] = {
            "model_type": model_type,
            "rope_theta": float(theta),
            "rope_scaling": rope_scaling,
            "qk_norm": model_type in ("qwen3", "qwen3_moe"),
            "attention_bias": bool(hf.get("qkv_bias", True)) if qwen2 else bool(hf.get("attention_bias", False)),
            "o_proj_bias": False if qwen2 else bool(hf.get("attention_bias", False)),
            "num_key_value_heads": hf.get("num_key_value_heads") or hf["num_attention_heads"],
            "head_dim": hf.get("head_dim") or 0,
        }
        if model_type == "qwen2_moe":
            kw["shared_expert_intermediate_size"] = hf.get("shared_expert_intermediate_size", 0)
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "hidden_act", "rms_norm_eps", "max_position_embeddings",
                     "tie_word_embeddings", "decoder_sparse_step", "bos_token_id",
                     "eos_token_id", "pad_token_id", "initializer_range"):
            if hf.get(name) is not None:
                kw[name] = hf[name]
        if model_type.endswith("_moe"):
            for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
                kw[name] = hf.get(name, 0)
            if "num_local_experts" in hf:  # transformers 5 writes num_experts under this name
                kw["num_experts"] = hf["num_local_experts"]
            kw["norm_topk_prob"] = bool(hf.get("norm_topk_prob", False))  # HF's default
            kw["mlp_only_layers"] = list(hf.get("mlp_only_layers") or [])
        return cls(**kw)

    def to_hf(self, *, dtype: str = "float32") -> dict[str, Any]:
        """A ``config.json`` dict that transformers loads as the matching ``*ForCausalLM``."""
        hf: dict[str, Any] = {
            "architectures": [_ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": self.hidden_act,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "use_sliding_window": False,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "initializer_range": self.initializer_range,
            "torch_dtype": dtype,
        }
        if self.model_type in ("qwen2", "qwen2_moe"):
            if self.o_proj_bias or self.qk_norm:
                raise ConfigError(f"{self.model_type} cannot express o_proj_bias/qk_norm")
            hf["qkv_bias"] = self.attention_bias
        else:
            if self.o_proj_bias != self.attention_bias:
                raise ConfigError(f"{self.model_type} has one attention_bias for q, k, v and o")
            if self.qk_norm != (self.model_type in ("qwen3", "qwen3_moe")):
                raise ConfigError(f"{self.model_type} fixes qk_norm={not self.qk_norm}")
            hf["attention_bias"] = self.attention_bias
        if self.is_moe:
            hf.update(
                num_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size,
                norm_topk_prob=self.norm_topk_prob,
                decoder_sparse_step=self.decoder_sparse_step,
                mlp_only_layers=list(self.mlp_only_layers),
            )
            if self.model_type == "qwen2_moe":
                hf["shared_expert_intermediate_size"] = self.shared_expert_intermediate_size
            elif self.shared_expert_intermediate_size:
                raise ConfigError("qwen3_moe has no shared expert; use model_type qwen2_moe")
        return hf


def tiny_config(*, moe: bool = False, **overrides: Any) -> ModelConfig:
    """A few-layer, small-hidden config for tests and CPU examples (vocab fits the tiny tokenizer)."""
    base: dict[str, Any] = dict(
        model_type="qwen3_moe" if moe else "qwen3",
        vocab_size=288,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        bos_token_id=2,
        eos_token_id=1,
        pad_token_id=0,
    )
    if moe:
        base.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
    base.update(overrides)
    return ModelConfig(**base)
