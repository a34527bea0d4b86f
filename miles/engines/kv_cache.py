"""Slot-based KV cache and the attention backends that read and write it.

Layout: one K and one V tensor of shape ``[layers, slots, kv_heads, max_seq_len, head_dim]``.
A running request owns one slot. The engine keeps running requests in slots ``0..n-1``
(it moves the last slot into the hole when a request leaves), so a decode step reads the
contiguous prefix ``[:n]`` of the slot dimension and the prefix ``[:L]`` of the time
dimension as *views* — no gather copy — where ``L`` is the longest context in the batch
rounded up to ``kv_block`` (fewer distinct shapes for CUDA graphs, little extra reading).

Backends (see ``miles.models.layers.AttentionBackend``):

- ``PrefillAttention``: causal attention within the new tokens (right-padded batch; causal
  masking alone keeps real tokens away from the pads) and a write of their K/V into the
  given slots at positions ``0..T-1``. Prefill never reads the cache: a resumed or
  recomputed request re-prefills its whole context.
- ``DecodeAttention``: one new token per row at ``positions[b]``: writes its K/V there, then
  attends over ``[0, positions[b]]`` of the row's slot. ``mode="matmul"`` (default) is
  explicit ``q·Kᵀ → masked softmax (float32) → ·V`` with the GQA group folded into the query
  axis, so K and V are each read once and never repeated; ``mode="sdpa"`` hands the same
  views and mask to ``scaled_dot_product_attention``. Both read every row up to ``L``;
  ``mode="triton"`` (CUDA) reads each row only up to its own position
  (``miles.kernels.decode_attention``, also for ``VerifyAttention``; in decode it writes the
  new K/V too), so its cost follows the useful KV positions and the runner passes the whole
  cache length as ``L``: one CUDA graph per batch bucket (and k, for speculative rounds)
  serves every context length.

  With ``split = (S, long_rows)`` every row reads ``[0, S)`` and only the long rows read
  ``[S, L)`` (gathered), their partial softmaxes merged exactly: in a long-tailed batch a
  step otherwise reads every row up to the longest context (``ModelRunner.choose_split``).
- ``VerifyAttention``: T new tokens per row at ``starts[b] .. starts[b] + T - 1`` (a
  speculative verify step, or a draft model catching up): writes their K/V there, then each
  attends over ``[0, its position]`` of the row's slot — causal among the new tokens, same
  cache reads as decode. Positions past a row's accepted context hold K/V of rejected draft
  tokens; they are never read (every read is masked to ``<= position``) before a later step
  writes them again, so rolling back a rejection is only bookkeeping (``kv_len``).

Caches built for speculation have ``max_seq_len + headroom`` positions so that the draft
tokens of a row near the end of its context still have somewhere to go.

An 8-bit cache (``kv_dtype`` float8, the engine's ``kv_cache_dtype``) stores K/V clamped to
the format's range with no scale (``encode``) and every backend reads them back into the
compute dtype (``decode``; the Triton kernel converts its tiles as it loads them), so a
decode step reads half the bytes. Its V is stored transposed (``positions_last``), and NaN is
stored as 0. Prefill attends over its own K/V before they are rounded.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from miles.kernels import decode_attention as triton_decode
from miles.models import invariant
from miles.models.config import ModelConfig


class KVCache:
    """``dtype`` is the model's (what attention computes in); ``kv_dtype`` what the cache
    stores (default: the same)."""

    def __init__(self, config: ModelConfig, num_slots: int, max_seq_len: int,
                 device: torch.device, dtype: torch.dtype, *, headroom: int = 0,
                 kv_dtype: torch.dtype | None = None) -> None:
        shape = (config.num_hidden_layers, num_slots, config.num_key_value_heads, max_seq_len + headroom,
                 config.head_dim)
        kv_dtype = kv_dtype or dtype
        self.dtype = dtype
        self.quantized = kv_dtype != dtype
        self.k = torch.zeros(shape, device=device, dtype=kv_dtype)
        self.v = positions_last(shape, device, kv_dtype) if self.quantized else torch.zeros(shape, device=device,
                                                                                             dtype=kv_dtype)
        self.limit = torch.finfo(kv_dtype).max  # float8 overflows to NaN (e4m3fn) or inf (e5m2): clamp
        self.num_slots, self.max_seq_len = num_slots, max_seq_len
        self.length = max_seq_len + headroom  # positions per slot

    def encode(self, x: Tensor) -> Tensor:
        """K or V as the cache stores them."""
        if not self.quantized:
            return x
        # NaN to 0, not kept: the Triton kernel reads a few positions past each row, weighted by zero
        return torch.nan_to_num(x, nan=0.0).clamp(-self.limit, self.limit).to(self.k.dtype)

    def decode(self, x: Tensor) -> Tensor:
        """Cache contents in the compute dtype (a copy when the cache is 8-bit)."""
        return x.to(self.dtype) if self.quantized else x

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() + self.v.untyped_storage().nbytes()  # V's padding too

    def bytes_per_token(self) -> int:
        """K+V bytes of one token over all layers (for the roofline)."""
        L, _, kv, _, d = self.k.shape
        return 2 * L * kv * d * self.k.element_size()

    def clear_slot(self, slot: int) -> None:
        self.k[:, slot].zero_()
        self.v[:, slot].zero_()

    def move_slot(self, src: int, dst: int, length: int) -> None:
        if src != dst and length > 0:
            self.k[:, dst, :, :length] = self.k[:, src, :, :length]
            self.v[:, dst, :, :length] = self.v[:, src, :, :length]


POSITION_PAD = 128  # a transposed V's positions (the Triton decode attention's largest BLOCK_N)


def positions_last(shape: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> Tensor:
    """A zeroed ``[..., positions, D]`` tensor stored as ``[..., D, positions]``: its transposed
    view. The positions are padded to a multiple of ``POSITION_PAD``, so every head-dim row
    starts aligned and the Triton kernel's unmasked tile loads stay inside the row.

    Why: an 8-bit cache's V is the Triton decode attention's PV-dot operand along the positions,
    and Hopper has no transposing shared-memory load for 8-bit tiles; stored position-major it
    went through shared memory a byte at a time (32 ``LDS.U8`` + 32 ``PRMT`` of the loop's 504
    instructions a trip, benchmarks/kernel_registers.py), and the kernel was bound by issuing
    them. Stored this way V loads like K. Every torch reader and writer takes the view as it is."""
    *lead, positions, head_dim = shape
    store = torch.zeros((*lead, head_dim, -(-positions // POSITION_PAD) * POSITION_PAD), device=device, dtype=dtype)
    return store[..., :positions].transpose(-1, -2)


class PrefillAttention:
    def __init__(self, cache: KVCache, slots: Tensor) -> None:
        self.cache, self.slots = cache, slots

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        T = q.shape[2]
        self.cache.k[layer_idx, self.slots, :, :T] = self.cache.encode(k)
        self.cache.v[layer_idx, self.slots, :, :T] = self.cache.encode(v)
        gqa = q.shape[1] != k.shape[1]
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)


class DecodeAttention:
    """One query token per row; rows ``0..n-1`` are slots ``0..n-1``.

    ``split = (S, long_rows)`` (matmul mode): every row reads ``[0, S)``, and only the rows
    in ``long_rows`` also read ``[S, length)`` (gathered), their two partial softmaxes merged
    exactly. A step otherwise reads every row up to the batch's longest context, so a few
    long rows among many short ones (RL's long tail) make most of the KV read padding."""

    def __init__(self, cache: KVCache, positions: Tensor, length: int, mode: str = "matmul",
                 split: tuple[int, Tensor] | None = None, rope: bool = True,
                 residual_gemm: bool = False, chunk: int = 0, fused_mlp: bool = False) -> None:
        self.cache, self.positions, self.length, self.mode = cache, positions, length, mode
        self.chunk = chunk  # the Triton kernel's positions per program (0: its default)
        # the layers may add the o / down projections into their residual stream in place
        # (``fused_layer_forward``): a decode step's own hidden states, which nothing else holds
        self.residual_gemm = residual_gemm
        self.fused_mlp = fused_mlp  # and their gate/up GEMM and SiLU·up in one kernel (miles.kernels.gate_up)
        n = positions.shape[0]
        dev = positions.device
        self.rows = torch.arange(n, device=dev)
        self.split = split if mode == "matmul" else None
        self.short = self.split[0] if self.split is not None else length  # what every row reads
        # the Triton kernel can take the raw q/k projections and apply the q/k-norms and RoPE
        # itself (``fused_layer_forward`` looks for this; None: it applies them before the call)
        self.attend_rope = self._attend_rope if mode == "triton" and rope else None
        if mode == "triton":
            self.lengths = positions + 1
            return
        # --true-on-policy on CUDA: the mode's own K/V write and attention (miles.kernels.invariant),
        # which bounds each row by its key count, positions + 1, with no mask
        self.kernels = mode == "sdpa" and self.split is None and invariant.on(positions) and not cache.quantized
        if self.kernels:
            self.nkeys = (positions + 1).to(torch.int32)[:, None, None]
            return
        # [n, 1, 1, S]: key j is visible to row b iff j <= positions[b].
        self.mask = (torch.arange(self.short, device=dev)[None, :] <= positions[:, None])[:, None, None, :]
        if self.split is not None:
            long_rows = self.split[1]
            self.long_mask = (torch.arange(self.short, length, device=dev)[None, :]
                              <= positions[long_rows][:, None])[:, None, None, :]

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        n, H, _, D = q.shape
        KV = k.shape[1]
        kc, vc = self.cache.k[layer_idx], self.cache.v[layer_idx]
        qg = q.reshape(n, KV, H // KV, D)  # the GQA group becomes the query axis
        if self.mode == "triton":  # the kernel writes the new K/V itself (no launch of their own)
            out = triton_decode.decode_attention(qg, kc, vc, self.lengths, 1.0 / math.sqrt(D), self.length,
                                                 new_kv=(k[:, :, 0], v[:, :, 0]), chunk=self.chunk)
            return out.reshape(n, H, 1, D)
        cache = self.cache
        if self.kernels:
            from miles.kernels import invariant as invariant_kernels

            invariant_kernels.kv_write(kc, vc, k[:, :, 0], v[:, :, 0], self.positions)
            out = invariant_kernels.attention(qg, kc[:n, :, : self.short], vc[:n, :, : self.short], self.nkeys)
            return out.reshape(n, H, 1, D)
        kc[self.rows, :, self.positions] = cache.encode(k[:, :, 0])
        vc[self.rows, :, self.positions] = cache.encode(v[:, :, 0])
        keys = cache.decode(kc[:n, :, : self.short])  # views: [n, KV, S, D] (copies when 8-bit)
        values = cache.decode(vc[:n, :, : self.short])
        if self.mode == "sdpa":
            out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=self.mask)
            return out.reshape(n, H, 1, D)
        scale = 1.0 / math.sqrt(D)
        scores = (torch.matmul(qg, keys.transpose(-1, -2)) * scale).float().masked_fill(~self.mask, float("-inf"))
        out = torch.matmul(scores.softmax(dim=-1).to(values.dtype), values)
        if self.split is not None:
            out[self.split[1]] = self._long_rows(qg, scores, values, kc, vc, scale)
        return out.reshape(n, H, 1, D)

    def _attend_rope(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor,
                     q_norm: Tensor | None, k_norm: Tensor | None, eps: float) -> Tensor:
        """The triton step from raw projections: q [n, H, D], k and v [n, KV, D] (views of the
        qkv GEMM's output), cos / sin [n, D] at each row's new position; the kernel applies the
        q/k-norms and RoPE (``triton_decode.Rope``). Returns [n, H, 1, D]."""
        n, H, D = q.shape
        KV = k.shape[1]
        out = triton_decode.decode_attention(
            q.view(n, KV, H // KV, D), self.cache.k[layer_idx], self.cache.v[layer_idx], self.lengths,
            1.0 / math.sqrt(D), self.length, new_kv=(k, v), rope=triton_decode.Rope(cos, sin, q_norm, k_norm, eps),
            chunk=self.chunk)
        return out.view(n, H, 1, D)

    def _long_rows(self, qg: Tensor, scores: Tensor, values: Tensor, kc: Tensor, vc: Tensor,
                   scale: float) -> Tensor:
        """The long rows' attention over ``[0, length)``: their ``[0, S)`` scores from the
        common pass, ``[S, length)`` from gathered K/V, one softmax over both."""
        idx = self.split[1]
        k2 = self.cache.decode(kc[idx, :, self.short : self.length])  # gathers
        v2 = self.cache.decode(vc[idx, :, self.short : self.length])
        s1 = scores[idx]
        s2 = (torch.matmul(qg[idx], k2.transpose(-1, -2)) * scale).float().masked_fill(~self.long_mask, float("-inf"))
        top = torch.maximum(s1.amax(-1, keepdim=True), s2.amax(-1, keepdim=True))
        p1, p2 = (s1 - top).exp(), (s2 - top).exp()
        total = p1.sum(-1, keepdim=True) + p2.sum(-1, keepdim=True)
        return torch.matmul((p1 / total).to(v2.dtype), values[idx]) + torch.matmul((p2 / total).to(v2.dtype), v2)


class VerifyAttention:
    """T query tokens per row at ``starts[b] + t``; rows ``0..n-1`` are slots ``0..n-1``."""

    def __init__(self, cache: KVCache, starts: Tensor, T: int, length: int, mode: str = "sdpa",
                 chunk: int = 0) -> None:
        self.cache, self.length, self.mode, self.chunk = cache, length, mode, chunk
        n = starts.shape[0]
        dev = starts.device
        self.positions = starts[:, None] + torch.arange(T, device=dev)[None, :]  # [n, T]
        self.rows = torch.arange(n, device=dev)[:, None]
        if mode == "triton":
            self.lengths = starts + T
            return
        # --true-on-policy on CUDA: the mode's attention, each query bounded by its key count
        # (positions + 1, tiled over the GQA group as the rows are), as in decode
        self.nkeys = None
        if mode == "sdpa" and invariant.on(starts) and not cache.quantized:
            self.nkeys = (self.positions + 1).to(torch.int32)[:, None, :]  # [n, 1, T]
            return
        # [n, 1, T, L]: key j is visible to query t of row b iff j <= starts[b] + t.
        self.mask = (torch.arange(length, device=dev)[None, None, :] <= self.positions[:, :, None])[:, None]

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        n, H, T, D = q.shape
        KV = k.shape[1]
        kc, vc = self.cache.k[layer_idx], self.cache.v[layer_idx]
        cache = self.cache
        kc[self.rows, :, self.positions] = cache.encode(k.transpose(1, 2))  # [n, T, KV, D]
        vc[self.rows, :, self.positions] = cache.encode(v.transpose(1, 2))
        G = H // KV
        qg = q.reshape(n, KV, G * T, D)  # (group, token) rows per KV head
        if self.mode == "triton":
            out = triton_decode.decode_attention(qg, kc, vc, self.lengths, 1.0 / math.sqrt(D), self.length, tokens=T,
                                                 chunk=self.chunk)
            return out.reshape(n, H, T, D)
        if self.nkeys is not None:
            from miles.kernels import invariant as invariant_kernels

            if self.nkeys.shape[-1] != G * T:  # once a step: tiled over the GQA group, as qg's rows are
                self.nkeys = self.nkeys.repeat(1, 1, G)
            out = invariant_kernels.attention(qg, kc[:n, :, : self.length], vc[:n, :, : self.length], self.nkeys)
            return out.reshape(n, H, T, D)
        keys = cache.decode(kc[:n, :, : self.length])  # views: [n, KV, L, D] (copies when 8-bit)
        values = cache.decode(vc[:n, :, : self.length])
        mask = self.mask.expand(n, G, T, self.length).reshape(n, 1, G * T, self.length)
        if self.mode == "sdpa":
            out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask)
        else:
            scores = torch.matmul(qg, keys.transpose(-1, -2)) * (1.0 / math.sqrt(D))
            scores = scores.float().masked_fill(~mask, float("-inf"))
            out = torch.matmul(scores.softmax(dim=-1).to(values.dtype), values)
        return out.reshape(n, H, T, D)
