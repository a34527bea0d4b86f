"""Building blocks of the decoder: RMSNorm, RoPE, attention, SwiGLU MLP and the sparse MoE block.

Parameter names follow Hugging Face (``q_proj``, ``q_norm``, ``gate_proj``, ``mlp.gate``,
``mlp.experts.{e}.*``, ``shared_expert``, ``shared_expert_gate``) so that a state dict of
this model *is* an HF checkpoint. The numerics follow transformers' Qwen3 code (RMSNorm
in float32 then cast back, router softmax in float32, RoPE tables in float32) so that
logits agree with it to float32 round-off.

Attention does not own a KV cache. It calls an *attention backend*: a callable
``backend(layer_idx, q, k, v) -> out`` with q ``[B, H, T, D]`` and k, v ``[B, KV, T, D]``
(RoPE and q/k-norm already applied), returning ``[B, H, T, D]``. ``FullAttention`` below is
the training / scoring backend; the engine supplies cache-writing prefill and cache-reading
decode backends (``miles.engines.kv_cache``), and a speculative verify step can be one more.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from miles.models import invariant
from miles.models.config import ModelConfig
from miles.models.fused import FastPath, fuse_linears, fused_layer_forward, rms_norm, rope_qk_tokens


class AttentionBackend(Protocol):
    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor: ...


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope_inv_freq(config: ModelConfig) -> Tensor:
    """Inverse frequencies for default, linear, llama3 and yarn RoPE (as transformers
    computes them)."""
    dim = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))
    scaling = config.rope_scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        inv = inv / scaling["factor"]
    elif kind == "llama3":
        factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_ctx / lo, inv / factor, inv)
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_ctx / hi) * ~(wavelen > old_ctx / lo)
        inv = torch.where(medium, smoothed, scaled)
    elif kind == "yarn":
        # YaRN: interpolate (÷ factor) the low frequencies, keep the high ones, and ramp
        # linearly between the dims that turn beta_slow and beta_fast times over the
        # original context (Peng et al. 2023; transformers' _compute_yarn_parameters).
        factor, old_ctx = _yarn_factor(config)
        fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

        def dim_of(rotations: float) -> float:
            return dim * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(config.rope_theta))

        lo_dim, hi_dim = dim_of(fast), dim_of(slow)
        if scaling.get("truncate", True):
            lo_dim, hi_dim = math.floor(lo_dim), math.ceil(hi_dim)
        lo_dim, hi_dim = max(lo_dim, 0), min(hi_dim, dim - 1)
        if lo_dim == hi_dim:
            hi_dim += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - lo_dim) / (hi_dim - lo_dim)).clamp(0, 1)
        keep = 1 - ramp  # 1: extrapolate (the original frequency), 0: interpolate
        inv = inv / factor * (1 - keep) + inv * keep
    return inv


def _yarn_factor(config: ModelConfig) -> tuple[float, int]:
    """YaRN's (factor, original context): a missing factor is the ratio of the two contexts."""
    scaling = config.rope_scaling or {}
    old_ctx = scaling.get("original_max_position_embeddings") or config.max_position_embeddings
    factor = scaling.get("factor") or config.max_position_embeddings / old_ctx
    return float(factor), int(old_ctx)


def rope_attention_scaling(config: ModelConfig) -> float:
    """The factor on cos and sin (YaRN's attention temperature; 1 for the other kinds)."""
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type", "default") != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, _ = _yarn_factor(config)

    def mscale_of(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if m and m_all:
        return mscale_of(factor, m) / mscale_of(factor, m_all)
    return mscale_of(factor)


class Rotary:
    """cos/sin tables (float32) gathered by position ids.

    Not an nn.Module buffer on purpose: the tables are derived, never saved, and must not
    be re-allocated while a CUDA graph holds their address (the engine calls ``reserve``
    for its context length before capturing; the model grows the table only when it is
    asked to check its inputs).
    """

    def __init__(self, config: ModelConfig) -> None:
        self.inv_freq = rope_inv_freq(config)
        self.scale = rope_attention_scaling(config)
        self.default_length = min(config.max_position_embeddings, 8192)
        self._cos: Tensor | None = None
        self._sin: Tensor | None = None
        self._packed: dict[torch.dtype, Tensor | None] = {}  # reserve(dtype=...)'s tables

    @property
    def length(self) -> int:
        return 0 if self._cos is None else self._cos.shape[0]

    def reserve(self, length: int, device: torch.device | str, dtype: torch.dtype | None = None) -> None:
        """Tables for positions ``[0, length)`` on ``device``; with ``dtype``, also cos and sin
        packed in that dtype (``[L, 2, D]``), which ``__call__`` then gathers in one kernel instead
        of two gathers and two casts: four launches a decode step in the engine's graphs became
        one (the engine reserves its dtype before it captures them)."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if self._cos is None or self._cos.device != device or self.length < length:
            pos = torch.arange(max(length, self.length), device=device, dtype=torch.int64).float()
            freqs = pos[:, None] * self.inv_freq.to(device)[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            # sin with its first half negated: rotate_half(x) * sin == roll(x, D/2) * signed_sin
            # exactly (only signs move), in 2 ops instead of 4 (see fused.rope_qk).
            half = emb.shape[-1] // 2
            self._cos, self._sin = emb.cos(), torch.cat((-emb[:, :half].sin(), emb[:, half:].sin()), dim=-1)
            if self.scale != 1.0:
                self._cos, self._sin = self._cos * self.scale, self._sin * self.scale
            self._packed = dict.fromkeys(self._packed)  # rebuilt below from the new tables
        if dtype is not None:
            self._packed.setdefault(dtype, None)
        for dt, table in self._packed.items():
            if table is None:
                self._packed[dt] = torch.stack((self._cos, self._sin), dim=1).to(dt)  # the same values, cast

    def __call__(self, position_ids: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, signed sin of shape [B, 1, T, D] in ``dtype`` for position_ids [B, T]."""
        if self._cos is None or self._cos.device != position_ids.device:
            self.reserve(self.default_length, position_ids.device)
        assert self._cos is not None and self._sin is not None
        packed = self._packed.get(dtype)
        if packed is not None:
            both = packed[position_ids].unsqueeze(1)  # [B, 1, T, 2, D]
            return both[..., 0, :], both[..., 1, :]
        cos = self._cos[position_ids].to(dtype).unsqueeze(1)
        sin = self._sin[position_ids].to(dtype).unsqueeze(1)
        return cos, sin


class FullAttention:
    """Attention over the tokens of this forward pass only (training, scoring, HF parity).

    ``mask`` None → causal (right padding needs no mask: real tokens never see later pads);
    otherwise a bool ``[B, 1, T, T]`` mask (True = may attend) from ``build_mask``.
    """

    def __init__(self, mask: Tensor | None) -> None:
        self.mask = mask

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        gqa = q.shape[1] != k.shape[1]
        if self.mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask, enable_gqa=gqa)


class UnpaddedAttention:
    """Causal attention for a forward over packed tokens: ``input_ids`` [1, N] holds the real
    tokens of B right-padded rows back to back (``position_ids`` restarting at 0 per row), a
    prompt that several rows share packed once (``TokenBatch.packed_positions``).
    Everything but attention works per token, so it runs on the N packed tokens only; this
    backend gathers q/k/v into the padded [B, T] grid for the plain causal (flash) kernel
    and takes the packed tokens' outputs back. ``grid`` [B · T] is the packed token of each
    grid cell (N for a pad, which reads zeros); ``index`` [N] is each packed token's cell
    (row · T + position). The outputs at real tokens are those of ``FullAttention(None)`` on
    the padded batch: under causal attention a real token never sees the pads after it."""

    def __init__(self, index: Tensor, grid: Tensor, batch: int, length: int) -> None:
        self.index, self.grid, self.batch, self.length = index, grid, batch, length
        self.full = FullAttention(None)

    def _grid(self, x: Tensor) -> Tensor:
        """[1, heads, N, D] packed → [B, heads, T, D] (a view of a token-major tensor), 0 on pads."""
        tokens = x[0].transpose(0, 1)  # [N, heads, D]
        cells = torch.cat([tokens, tokens.new_zeros(1, *tokens.shape[1:])]).index_select(0, self.grid)
        return cells.view(self.batch, self.length, *tokens.shape[1:]).transpose(1, 2)

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        out = self.full(layer_idx, self._grid(q), self._grid(k), self._grid(v)).transpose(1, 2)  # [B, T, H, D]
        out = out.reshape(self.batch * self.length, *out.shape[2:])  # a view: the kernel writes token-major
        return out.index_select(0, self.index).transpose(0, 1)[None]  # [1, H, N, D]

def build_mask(attention_mask: Tensor | None, segment_ids: Tensor | None, T: int,
               device: torch.device) -> Tensor | None:
    """Causal mask AND key-is-real AND same-segment (packing); the diagonal always stays
    open so that a padding query row has one key and its softmax stays finite."""
    if attention_mask is None and segment_ids is None:
        return None
    mask = torch.ones(T, T, dtype=torch.bool, device=device).tril()[None, None]
    if attention_mask is not None:
        mask = mask & attention_mask.bool()[:, None, None, :]
    if segment_ids is not None:
        mask = mask & (segment_ids[:, None, :, None] == segment_ids[:, None, None, :])
    return mask | torch.eye(T, dtype=torch.bool, device=device)[None, None]


def _attend(attn: "Attention", backend: AttentionBackend, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """The attention call, kept out of a compiled layer's graph (the trainer's --compile; see
    ``attention_out_of_graphs``):
    inductor's backward of SDPA with dynamic shapes asserts on the saved inputs' strides
    (torch 2.13, CPU), and the fusions worth having (norms, RoPE, SwiGLU, residuals) sit
    around it. It reads ``layer_idx`` itself: read in the compiled forward, the int is a
    guard and every layer recompiles (past dynamo's limit of 8 the later layers ran eager).
    q, k, v come token-major, [B, T, heads, D], and are transposed here, outside the compiled
    graph (see ``rope_qk_tokens``). Eager callers pay one Python call for the wrapper."""
    return backend(attn.layer_idx, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))


def attention_out_of_graphs() -> None:
    """Make ``_attend`` a ``torch.compiler.disable`` function, before a layer is compiled.
    Why not a decorator: ``torch.compiler.disable`` imports dynamo, which doubles torch's
    import time in every process that imports the models (each rollout worker, the buffer,
    the broadcaster), most of which never compile. The layers look ``_attend`` up at call
    time, so the rebinding reaches every layer built before or after it."""
    global _attend
    if not getattr(_attend, "_miles_disabled", False):
        _attend = torch.compiler.disable(_attend)
        _attend._miles_disabled = True  # type: ignore[attr-defined]


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = d = config.head_dim
        h = config.hidden_size
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=config.attention_bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=config.attention_bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=bool(config.o_proj_bias))
        if config.qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps)
            self.k_norm = RMSNorm(d, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.qkv: tuple[Tensor, Tensor | None] | None = None  # set by fuse() (inference only)

    def fuse(self) -> None:
        """Re-store q/k/v weights as views of one matrix: one GEMM instead of three."""
        self.qkv = fuse_linears(self.q_proj, self.k_proj, self.v_proj)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, backend: AttentionBackend) -> Tensor:
        B, T, _ = x.shape
        H, KV, D = self.num_heads, self.num_kv_heads, self.head_dim
        q = self.q_proj(x).view(B, T, H, D)
        k = self.k_proj(x).view(B, T, KV, D)
        v = self.v_proj(x).view(B, T, KV, D)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope_qk_tokens(q, k, cos.transpose(1, 2), sin.transpose(1, 2))
        out = _attend(self, backend, q, k, v)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, H * D))


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.gate_up: tuple[Tensor, Tensor | None] | None = None  # set by fuse()

    def fuse(self) -> None:
        self.gate_up = fuse_linears(self.gate_proj, self.up_proj)

    def forward(self, x: Tensor) -> Tensor:
        if self.gate_up is not None:
            gate, up = F.linear(x, self.gate_up[0]).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoE(nn.Module):
    """Top-k softmax router over ``num_experts`` SwiGLU experts (+ optional gated shared expert).

    ``routing`` (expert ids ``[N, k]``) replaces the router's top-k choice — rollout routing
    replay: the trainer reuses the experts the engine picked; the combine weights are still
    the current router's probabilities of those experts (renormalised if ``norm_topk_prob``),
    so the router keeps its gradient.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.gate = nn.Linear(h, self.num_experts, bias=False)
        self.experts = nn.ModuleList(
            MLP(h, config.moe_intermediate_size) for _ in range(self.num_experts)
        )
        if config.shared_expert_intermediate_size:
            self.shared_expert = MLP(h, config.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(h, 1, bias=False)
        else:
            self.shared_expert = self.shared_expert_gate = None

    def forward(self, x: Tensor, routing: Tensor | None = None) -> tuple[Tensor, Tensor]:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        probs = F.softmax(self.gate(flat), dim=-1, dtype=torch.float32)
        if routing is None:
            weights, idx = torch.topk(probs, self.top_k, dim=-1)
        else:
            idx = routing.reshape(-1, self.top_k).to(device=flat.device, dtype=torch.long)
            weights = probs.gather(1, idx)
        if self.norm_topk_prob:
            weights = weights / invariant.row_sum(weights)
        out = self._experts(flat, idx, weights.to(flat.dtype))
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return out.reshape(shape), idx.reshape(*shape[:-1], self.top_k)

    def _experts(self, flat: Tensor, idx: Tensor, weights: Tensor) -> Tensor:
        # Group (token, slot) pairs by expert; one dense matmul per expert that has tokens.
        flat_idx = idx.reshape(-1)
        order = torch.argsort(flat_idx, stable=True)
        counts = torch.bincount(flat_idx, minlength=self.num_experts).tolist()
        token_of = order // self.top_k
        xs = flat[token_of]
        ys = []
        start = 0
        for e, n in enumerate(counts):
            if n:
                ys.append(self.experts[e](xs[start : start + n]))
                start += n
        y = torch.cat(ys) * weights.reshape(-1)[order, None]
        return torch.zeros_like(flat).index_add_(0, token_of, y)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.is_moe = config.is_moe_layer(layer_idx)
        self.mlp: nn.Module = (
            SparseMoE(config) if self.is_moe else MLP(config.hidden_size, config.intermediate_size)
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.fast: FastPath | None = None  # set by CausalLM.fuse_projections

    def forward(self, h: Tensor, cos: Tensor, sin: Tensor, backend: AttentionBackend,
                routing: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        if self.fast is not None:
            return fused_layer_forward(self, self.fast, h, cos, sin, backend, routing)
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, backend)
        x = self.post_attention_layernorm(h)
        if self.is_moe:
            y, idx = self.mlp(x, routing)
            return h + y, idx
        return h + self.mlp(x), None
