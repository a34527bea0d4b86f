"""Draft models for speculative decoding, and their Hugging Face style checkpoints.

Two kinds (``--speculative-algorithm``):

- ``draft``: a small independent LM of our own architecture — a ``CausalLM`` with a tiny
  config (``draft_lm_config``) sharing the policy's tokenizer and vocabulary. It sees only
  tokens, so it can be trained from trajectories alone.
- ``eagle``: an EAGLE / MTP style head (``EagleHead``) that reads the policy's last hidden
  state. Entry i of its sequence is ``(h_i, x_{i+1})`` — the policy's final-norm hidden
  state at position i and the embedding of the token that followed — and it predicts
  ``x_{i+2}``: ``fc([embed(x_{i+1}); h_i])`` → ``num_hidden_layers`` decoder layers of the
  policy's shape (their own KV cache, RoPE at the entry index) → final norm → a feature
  ``f_i`` meant to match ``h_{i+1}`` → the *policy's* LM head. Drafting k tokens feeds each
  step's own feature back as the next entry's ``h``. The head owns no vocabulary-sized
  tensor: it borrows the policy's ``embed_tokens`` and ``lm_head`` at call time, so its
  checkpoint is small and it follows the policy's embedding as RL changes it.

Checkpoints are HF style directories (``config.json`` + ``model.safetensors``):
``save_draft`` / ``load_draft`` handle both kinds; an EAGLE head's config.json is the
policy-shaped ``ModelConfig`` plus ``"architectures": ["MilesEagleHead"]``, and its tensors
are ``model.fc.weight``, ``model.layers.{i}.*`` and ``model.norm.weight`` (SGLang's EAGLE
draft names, without the embedding and LM head).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from miles.models.checkpoint import CheckpointError, _owned, load_pretrained, save_pretrained
from miles.models.config import ModelConfig
from miles.models.fused import FastPath, layer_args
from miles.models.layers import MLP, Attention, AttentionBackend, DecoderLayer, FullAttention, RMSNorm, Rotary
from miles.models.model import CausalLM

EAGLE_ARCH = "MilesEagleHead"
DraftModel = CausalLM  # | EagleHead (both are nn.Modules with ``config``)


class _HeadBody(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(h, config.rms_norm_eps)


class EagleHead(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.is_moe:
            raise ValueError("an EAGLE head is dense: build its config with eagle_config(policy_config)")
        self.config = config
        self.model = _HeadBody(config)
        self.rotary = Rotary(config)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        std = self.config.initializer_range
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0.0, std, generator=generator)

    def fuse_projections(self, fast: FastPath | None = None) -> None:
        """Inference only: as ``CausalLM.fuse_projections`` (the engine calls it)."""
        for module in self.modules():
            if isinstance(module, Attention) and module.qkv is None:
                module.fuse()
            elif isinstance(module, MLP) and module.gate_up is None:
                module.fuse()
        fast = fast or FastPath()
        for layer in self.model.layers:
            layer.fast_args = layer_args(layer)
            layer.fast = fast

    @property
    def device(self) -> torch.device:
        return self.model.fc.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.fc.weight.dtype

    def forward(self, hidden: Tensor, input_ids: Tensor, embed: nn.Embedding, *,
                position_ids: Tensor | None = None, kv_cache: AttentionBackend | None = None) -> Tensor:
        """Features [B, T, H] for entries ``(hidden[:, t], input_ids[:, t])``; entry t sits at
        ``position_ids[:, t]`` (default ``arange(T)``). Without ``kv_cache``: causal
        attention over these entries only (training)."""
        B, T = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device).expand(B, T)
        emb = embed(input_ids).to(hidden.dtype)
        h = self.model.fc(torch.cat([emb, hidden.to(emb.dtype)], dim=-1))
        backend = kv_cache if kv_cache is not None else FullAttention(None)
        if kv_cache is None and T > self.rotary.length:  # training on a long trajectory: see CausalLM
            self.rotary.reserve(T, input_ids.device)
        cos, sin = self.rotary(position_ids, h.dtype)
        for layer in self.model.layers:
            h, _ = layer(h, cos, sin, backend)
        return self.model.norm(h)


def draft_kind(model: nn.Module) -> str:
    return "eagle" if isinstance(model, EagleHead) else "draft"


# ---- configs ------------------------------------------------------------------------------


def _dense(policy: ModelConfig) -> dict[str, Any]:
    kind = {"qwen3_moe": "qwen3", "qwen2_moe": "qwen2"}.get(policy.model_type, policy.model_type)
    inter = policy.intermediate_size or policy.moe_intermediate_size * max(policy.num_experts_per_tok, 1)
    return dict(model_type=kind, intermediate_size=inter, num_experts=0, num_experts_per_tok=0,
                moe_intermediate_size=0, shared_expert_intermediate_size=0, mlp_only_layers=[],
                decoder_sparse_step=1)


def eagle_config(policy: ModelConfig, num_layers: int = 1) -> ModelConfig:
    """The policy's (dense) layer shape, ``num_layers`` deep: an EAGLE head's config."""
    return msgspec.structs.replace(policy, num_hidden_layers=num_layers, **_dense(policy))


def draft_lm_config(policy: ModelConfig, num_layers: int = 1, hidden_size: int = 0) -> ModelConfig:
    """A small independent LM sharing the policy's vocabulary and special tokens:
    ``hidden_size`` (0 → a quarter of the policy's, at least 64), heads of the policy's
    head_dim (capped at hidden/2), MLP 3× hidden, tied embeddings."""
    hidden = hidden_size or max(64, policy.hidden_size // 4)
    head_dim = min(policy.head_dim, hidden // 2)
    heads = max(1, hidden // head_dim)
    kv = next(d for d in range(min(policy.num_key_value_heads, heads), 0, -1) if heads % d == 0)
    return msgspec.structs.replace(
        policy, hidden_size=hidden, num_hidden_layers=num_layers, num_attention_heads=heads,
        num_key_value_heads=kv, head_dim=head_dim, tie_word_embeddings=True,
        **{**_dense(policy), "intermediate_size": 3 * hidden})


def build_draft(kind: str, policy: ModelConfig, *, num_layers: int = 1, hidden_size: int = 0,
                seed: int = 0) -> nn.Module:
    """A freshly initialised draft (the same weights for the same seed, in every process)."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "eagle":
        model: nn.Module = EagleHead(eagle_config(policy, num_layers))
    elif kind == "draft":
        model = CausalLM(draft_lm_config(policy, num_layers, hidden_size))
    else:
        raise ValueError(f"draft kind {kind!r} not in ('draft', 'eagle')")
    model.reset_parameters(gen)
    return model.eval()


def check_compatible(draft: nn.Module, policy: ModelConfig) -> None:
    """Raise ValueError naming the mismatch if ``draft`` cannot serve ``policy``."""
    cfg = draft.config
    if cfg.vocab_size != policy.vocab_size:
        raise ValueError(f"draft vocab_size {cfg.vocab_size} != the policy's {policy.vocab_size} "
                         "(a draft must share the policy's tokenizer)")
    if isinstance(draft, EagleHead) and cfg.hidden_size != policy.hidden_size:
        raise ValueError(f"EAGLE head hidden_size {cfg.hidden_size} != the policy's {policy.hidden_size}")


# ---- checkpoints --------------------------------------------------------------------------


def save_draft(model: nn.Module, path: str | Path, *, tokenizer: Any = None) -> None:
    """config.json + model.safetensors (+ tokenizer files) for either kind of draft."""
    if isinstance(model, CausalLM):
        save_pretrained(model, path, tokenizer=tokenizer)
        return
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {k: _owned(v.detach().to("cpu")) for k, v in model.state_dict().items()}
    dtype = str(next(iter(state.values())).dtype).removeprefix("torch.")
    hf = model.config.to_hf(dtype=dtype)
    hf["architectures"] = [EAGLE_ARCH]
    (path / "config.json").write_text(json.dumps(hf, indent=2))
    for old in path.glob("model*.safetensors*"):
        old.unlink()
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save(path)


def load_draft(path: str | Path, *, dtype: torch.dtype | None = None, device: torch.device | str = "cpu") -> nn.Module:
    """Load a draft saved by ``save_draft`` (or any HF checkpoint of our architectures)."""
    path = Path(path)
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise CheckpointError(f"{path}: no config.json")
    hf = json.loads(cfg_path.read_text())
    if EAGLE_ARCH not in (hf.get("architectures") or []):
        return load_pretrained(path, dtype=dtype, device=device)
    model = EagleHead(ModelConfig.from_hf(hf))
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    state: dict[str, Tensor] = {}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files")
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as fh:
            for name in fh.keys():
                if name not in expected:
                    raise CheckpointError(f"{file.name}: tensor {name!r} is not part of an EAGLE head "
                                          f"with this config.json")
                t = fh.get_tensor(name)
                if tuple(t.shape) != expected[name]:
                    raise CheckpointError(f"{file.name}: tensor {name!r} has shape {tuple(t.shape)}, "
                                          f"config.json implies {expected[name]}")
                state[name] = t
    missing = sorted(set(expected) - set(state))
    if missing:
        raise CheckpointError(f"{path}: tensors missing from the checkpoint: {missing[:5]}")
    model.load_state_dict(state)
    dtype = dtype or (torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16)
    return model.to(device=device, dtype=dtype).eval()
