"""CausalLM: the one decoder both the embedded engine and the embedded trainer run.

The trainer calls ``forward(input_ids, position_ids, attention_mask)`` (padded, left or
right) or ``forward(..., segment_ids=...)`` (packed); the engine calls the same forward with
a KV-cache attention backend (``kv_cache=``) and ``logits_index`` so that only the rows it
samples from reach the LM head. Both then turn logits into log-probs with
``token_logprobs`` — one function, so rollout and training compute log-probs the same way.

Module and parameter names are the Hugging Face ones (``model.embed_tokens``,
``model.layers.{i}.self_attn.q_proj``, ``model.layers.{i}.mlp.experts.{e}.gate_proj``,
``model.norm``, ``lm_head``), so ``state_dict()`` is an HF checkpoint (see
``miles.models.checkpoint``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from miles.models import invariant
from miles.models.config import ModelConfig
from miles.models.fused import FastPath, layer_args
from miles.models.layers import (
    MLP,
    Attention,
    AttentionBackend,
    DecoderLayer,
    FullAttention,
    RMSNorm,
    Rotary,
    build_mask,
)


@dataclass
class ModelOutput:
    logits: Tensor | None  # [B, T, V] float32 (or [B, 1, V] with logits_index)
    routing: Tensor | None = None  # [B, T, L_moe, k] expert ids, when asked for
    hidden: Tensor | None = None  # [B, T, H] last hidden state after the final norm


class _Backbone(nn.Module):
    """Holds the ``model.*`` parameters (HF's ``*Model``)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        # On the meta device (a checkpoint's names and shapes: every actor's config check and
        # load) the embedding skips its own init, whose meta normal_ imports torch._dynamo
        # (about a second of each process's start); CausalLM.reset_parameters skips meta anyway.
        # Elsewhere it keeps it: seeded models draw the same numbers as before.
        meta = torch.get_default_device().type == "meta"
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                         _weight=torch.empty(config.vocab_size, config.hidden_size) if meta else None)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = _Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = Rotary(config)
        self.moe_layers = config.moe_layers
        self.fast: FastPath | None = None  # set by fuse_projections (inference only)
        self.reset_parameters()
        self.tie_weights()

    # ---- parameters ------------------------------------------------------------------
    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.no_grad()
    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        """HF-style init: normal(0, initializer_range) for matrices, ones for norms, zero bias."""
        std = self.config.initializer_range
        for name, p in self.named_parameters():
            if p.is_meta:
                continue
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0.0, std, generator=generator)

    def fuse_projections(self, fast: FastPath | None = None) -> None:
        """Inference only (the engine calls it): q/k/v and gate/up as single GEMMs and the
        layers on the fast path (``miles.models.fused``; pass a compiled FastPath to use
        torch.compile). Parameters become views of the fused tensors, so names,
        ``state_dict`` and in-place weight updates are unchanged. Call after
        ``.to(device, dtype)`` and with grads off."""
        for module in self.modules():
            if isinstance(module, (Attention, MLP)) and not (
                getattr(module, "qkv", None) is not None or getattr(module, "gate_up", None) is not None
            ):
                module.fuse()
        fast = fast or FastPath()
        self.fast = fast  # the final norm too: compiled, one kernel where eager ran ~7 (bf16 on CUDA)
        for layer in self.model.layers:
            layer.fast_args = layer_args(layer)
            layer.fast = fast

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    # ---- forward ---------------------------------------------------------------------
    def forward(
        self,
        input_ids: Tensor,
        position_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        *,
        segment_ids: Tensor | None = None,
        routing: Tensor | None = None,
        return_routing: bool = False,
        return_hidden: bool = False,
        return_logits: bool = True,
        logits_index: Tensor | None = None,
        kv_cache: AttentionBackend | None = None,
        check_inputs: bool = True,
    ) -> ModelOutput:
        """Run the decoder on ``input_ids`` [B, T].

        - ``position_ids`` default: ``cumsum(attention_mask) - 1`` when a mask is given (so
          left padding gets the positions HF gives it), else ``arange(T)`` per row.
        - ``attention_mask`` [B, T], 1 = real token, right or left padding.
        - ``segment_ids`` [B, T] (packing): tokens attend only within their segment; pass
          per-segment ``position_ids`` too.
        - ``routing`` [B, T, L_moe, k]: expert ids to use instead of the router's top-k.
        - ``logits_index`` [B]: compute logits only at that position of each row → [B, 1, V].
        - ``kv_cache``: an attention backend (the engine's); default full causal attention.
        - ``check_inputs``: validate ids / positions / routing (one host sync); the engine
          validates once at admission and turns this off.
        """
        B, T = input_ids.shape
        if attention_mask is not None and position_ids is None:
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp_(min=0)
        if position_ids is None:
            position_ids = torch.arange(T, device=input_ids.device).expand(B, T)
        if check_inputs:
            self._check(input_ids, position_ids, routing)
        elif kv_cache is None and T > self.rotary.length:
            # A full pass's positions are < T (the trainer and scoring skip the check): grow
            # the table from the shape, with no host sync. Without this, a sequence longer
            # than the default table (8192) gathered past its end: a device-side assert on
            # CUDA, the trainer's process lost.
            self.rotary.reserve(T, input_ids.device)
        backend = kv_cache
        if backend is None:
            backend = FullAttention(build_mask(attention_mask, segment_ids, T, input_ids.device))
        h = invariant.residual(self.model.embed_tokens(input_ids))
        cos, sin = self.rotary(position_ids, h.dtype)
        routes: list[Tensor] = []
        for layer in self.model.layers:
            layer_routing = None
            if routing is not None and layer.is_moe:
                layer_routing = routing[:, :, len(routes)]
            h, idx = layer(h, cos, sin, backend, layer_routing)
            if idx is not None:
                routes.append(idx)
        norm = self.model.norm
        h = norm(h) if self.fast is None else self.fast.rms_norm(h, norm.weight, norm.eps)
        logits = None
        if return_logits:
            rows = h if logits_index is None else h[torch.arange(B, device=h.device), logits_index][:, None]
            logits = self.lm_head(rows).float()
        return ModelOutput(
            logits=logits,
            routing=torch.stack(routes, dim=2) if return_routing and routes else None,
            hidden=h if return_hidden else None,
        )

    def _check(self, input_ids: Tensor, position_ids: Tensor, routing: Tensor | None) -> None:
        V = self.config.vocab_size
        if input_ids.numel():
            lo, hi = int(input_ids.min()), int(input_ids.max())
            if lo < 0 or hi >= V:
                bad = lo if lo < 0 else hi
                raise ValueError(f"token id {bad} outside the vocabulary [0, {V})")
            top = int(position_ids.max())
            if top >= self.rotary.length:
                self.rotary.reserve(top + 1, input_ids.device)
        if routing is not None:
            L, k = len(self.moe_layers), self.config.num_experts_per_tok
            if routing.shape != (*input_ids.shape, L, k):
                raise ValueError(f"routing has shape {tuple(routing.shape)}, expected "
                                 f"{(*input_ids.shape, L, k)} (B, T, moe layers, top-k)")
            if routing.numel() and (int(routing.min()) < 0 or int(routing.max()) >= self.config.num_experts):
                raise ValueError(f"routing holds expert ids outside [0, {self.config.num_experts})")


def token_logprobs(logits: Tensor, tokens: Tensor, temperature: float | Tensor = 1.0) -> Tensor:
    """log softmax(logits / T)[token], in float32, for logits [..., V] and tokens [...].

    The engine records exactly this for sampled tokens when top_p = 1 and top_k = -1 (with
    truncation it renormalises over the kept tokens, which a trainer cannot recompute
    without the same truncation); the trainer calls it with the same temperature.
    """
    logits = logits.float()
    if invariant.on(logits) and not isinstance(temperature, Tensor) and temperature != 1.0:
        # a true division, as the engine's by its [n, 1] tensor (torch divides a CUDA tensor
        # by a Python float as a multiplication by its reciprocal)
        temperature = torch.full((), temperature, device=logits.device)
        logits = logits / temperature
    elif isinstance(temperature, Tensor):
        logits = logits / temperature.to(logits.dtype).unsqueeze(-1)
    elif temperature != 1.0:
        logits = logits / temperature
    logp = F.log_softmax(logits, dim=-1)
    return logp.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)
