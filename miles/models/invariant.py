"""Batch-invariant forms of the model's reductions, the building blocks of a true on-policy
mode (miles/engines/CONSISTENCY.md, "Toward a true on-policy mode").

Each function computes one output row from that row's inputs alone, in a reduction order
fixed by the reduction length and ``CHUNK``, never by the number of rows, the batch's other
rows or the sequence length:

- ``linear``: y = x·Wᵀ as a sum over fixed chunks of K, each chunk an elementwise product
  reduced over its last (contiguous) dimension, the chunks added in order. A BLAS GEMM picks
  its blocking (and split-K) by M, so M = 1 in decode and M = thousands in the trainer sum
  one dot product in different orders; this form does not.
- ``attention``: causal attention in which every query's scores are padded with -inf to one
  fixed key length ``keys`` (the engine's and the trainer's common bound, e.g. the context
  length) and V with zeros to the same length, so a query at position t gets the same softmax
  and the same weighted sum of V whether it is decoded alone over a cache or recomputed with the whole sequence.

They trade speed for that invariance (elementwise products materialise [rows, N, CHUNK]
blocks, taken ``ROW_BLOCK`` rows at a time); they are meant for float32 checks on the CPU
and as the reference for batch-invariant kernels.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

CHUNK = 64  # reduction-dimension tile: small enough that torch never splits one sum across threads
ROW_BLOCK = 64  # rows per elementwise block (memory only: rows are independent)


def _dot_chunks(a: Tensor, b: Tensor) -> Tensor:
    """[R, K] · [N, K] → [R, N], summing fixed K-chunks in order."""
    out = None
    for c in range(0, a.shape[-1], CHUNK):
        part = (a[:, None, c : c + CHUNK] * b[None, :, c : c + CHUNK]).sum(-1)
        out = part if out is None else out + part
    return out


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear`` with a reduction order independent of the number of rows."""
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(f"linear: input width {x.shape[-1]} != weight width {weight.shape[-1]}")
    flat = x.reshape(-1, x.shape[-1])
    w = weight.to(flat.dtype).contiguous()
    rows = [_dot_chunks(flat[i : i + ROW_BLOCK].contiguous(), w) for i in range(0, flat.shape[0], ROW_BLOCK)]
    y = torch.cat(rows) if rows else flat.new_zeros(0, w.shape[0])
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.reshape(*x.shape[:-1], w.shape[0])


def attention(q: Tensor, k: Tensor, v: Tensor, positions: Tensor | None, keys: int, scale: float | None = None,
              allowed: Tensor | None = None) -> Tensor:
    """Attention of queries [B, H, Q, D] over keys and values [B, Hkv, S, D] (S ≤ ``keys``;
    key j sits at position j). With ``positions`` [B, Q], query i attends keys 0..positions[b, i];
    otherwise ``allowed`` (bool, broadcastable to [B, H, Q, S]) says which. Every softmax and
    every weighted sum of V runs over exactly ``keys`` entries."""
    B, H, Q, D = q.shape
    S, hkv = k.shape[2], k.shape[1]
    if S > keys:
        raise ValueError(f"{S} keys exceed the fixed key length {keys}")
    scale = D ** -0.5 if scale is None else scale
    rep = H // hkv
    kk = k.repeat_interleave(rep, dim=1)
    vv = v.repeat_interleave(rep, dim=1)
    pad = keys - S
    if positions is not None:
        allowed = (torch.arange(S, device=q.device)[None, None, :] <= positions[:, :, None])[:, None]
    allowed = allowed.expand(B, H, Q, S) if allowed is not None else None
    rows = []
    for b in range(B):
        heads = []
        for h in range(H):
            # row-wise dots (one query's scores never depend on the others), fixed chunks
            s = _dot_chunks(q[b, h].contiguous(), kk[b, h].contiguous()) * scale
            if allowed is not None:
                s = s.masked_fill(~allowed[b, h], float("-inf"))
            s = torch.nn.functional.pad(s, (0, pad), value=float("-inf"))
            p = torch.softmax(s, dim=-1)  # [Q, keys]: the padded keys get exactly 0
            vt = torch.nn.functional.pad(vv[b, h].transpose(0, 1), (0, pad))  # [D, keys], zeros past S
            heads.append(_dot_chunks(p.contiguous(), vt.contiguous()))
        rows.append(torch.stack(heads))
    return torch.stack(rows).to(q.dtype)


_F_LINEAR = torch.nn.functional.linear
_F_SDPA = torch.nn.functional.scaled_dot_product_attention


def _sdpa(keys: int):
    def sdpa(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None, dropout_p: float = 0.0,
             is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False) -> Tensor:
        if dropout_p:
            raise ValueError("batch-invariant attention has no dropout")
        Q, S = q.shape[-2], k.shape[-2]
        allowed = None
        if is_causal:
            allowed = torch.ones(Q, S, dtype=torch.bool, device=q.device).tril(S - Q)[None, None]
        if attn_mask is not None:
            if attn_mask.dtype != torch.bool:
                attn_mask = attn_mask > float("-inf")
            allowed = attn_mask if allowed is None else allowed & attn_mask
        return attention(q, k, v, None, keys, scale, allowed=allowed)
    return sdpa


def enable(keys: int, linear_fn: Any = None) -> None:
    """Route every ``F.linear`` and ``F.scaled_dot_product_attention`` of this process
    through the batch-invariant forms (``--true-on-policy``: each actor process calls it
    once, with the run's context length as ``keys``)."""
    torch.nn.functional.linear = linear_fn or linear
    torch.nn.functional.scaled_dot_product_attention = _sdpa(keys)


def disable() -> None:
    torch.nn.functional.linear = _F_LINEAR
    torch.nn.functional.scaled_dot_product_attention = _F_SDPA


@contextlib.contextmanager
def mode(keys: int, linear_fn=None) -> Iterator[None]:
    """Within it, every ``F.linear`` (the model's projections, experts, router and LM head)
    and every ``F.scaled_dot_product_attention`` runs in its batch-invariant form, attention
    over ``keys`` fixed key positions. ``linear_fn`` swaps in another GEMM (tests break the
    invariance on purpose with it)."""
    enable(keys, linear_fn)
    try:
        yield
    finally:
        disable()
