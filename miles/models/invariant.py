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
blocks, taken ``ROW_BLOCK`` rows at a time); they are the CPU float32 path. On CUDA
``enable(device="cuda")`` routes the same functions, and the last-dimension softmax,
log-softmax, logsumexp and RMSNorm, through the Triton kernels of ``miles.kernels.invariant``
(bf16 with float32 accumulation), whose forward passes the engine and the trainer share.
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
_F_LOG_SOFTMAX = torch.nn.functional.log_softmax
_F_SOFTMAX = torch.nn.functional.softmax
_LOGSUMEXP = torch.logsumexp

# True while the CUDA kernels (miles.kernels.invariant) serve the mode: the model then keeps
# the trainer's residual stream in the autocast dtype, as the engine's is (``residual``),
# RMSNorm runs as a per-row kernel (``rms_norm``), and the router's top-k weights are
# renormalised by explicit adds (``row_sum``).
KERNELS = False
_DEVICE = "cuda"  # the device type the kernels serve (the CPU only under triton's interpreter, in tests)


def on(x: Tensor) -> bool:
    """Whether the mode's kernels serve ``x``'s device."""
    return serves(x.device)


def serves(device: torch.device) -> bool:
    """Whether the mode's kernels serve ``device``."""
    return KERNELS and device.type == _DEVICE


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


# ---- CUDA: the Triton kernels, wrapped for autograd ------------------------------------
# Forward passes run the batch-invariant kernels; backward passes (the trainer's gradients,
# which no rollout compares) run torch's own ops on the saved inputs.


def _compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype an op computes in: autocast's where it is on (as torch's own linear and
    attention would), else the input's."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def _grad_needed(*ts: Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ts)


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, dt: torch.dtype) -> Tensor:
        from miles.kernels import invariant as kernels

        ctx.save_for_backward(x, weight)
        ctx.dt, ctx.has_bias = dt, bias is not None
        return kernels.matmul(x.to(dt), weight.to(dt), None if bias is None else bias.to(dt))

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple:
        x, weight = ctx.saved_tensors
        dt = ctx.dt
        g = g.to(dt)
        gx = (g @ weight.to(dt)).to(x.dtype) if ctx.needs_input_grad[0] else None
        gw = None
        if ctx.needs_input_grad[1]:
            gw = (g.reshape(-1, g.shape[-1]).t() @ x.reshape(-1, x.shape[-1]).to(dt)).to(weight.dtype)
        gb = g.reshape(-1, g.shape[-1]).float().sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb, None


def cuda_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear`` on CUDA as one fixed-tiling Triton GEMM (``miles.kernels.invariant.matmul``)."""
    if not on(x):
        return _F_LINEAR(x, weight, bias)
    dt = _compute_dtype(x)
    if _grad_needed(x, weight, bias):
        out = _Linear.apply(x, weight, bias, dt)
    else:
        from miles.kernels import invariant as kernels

        out = kernels.matmul(x.to(dt), weight.to(dt), None if bias is None else bias.to(dt))
    return out if bias is None or bias.dtype == dt else out.to(torch.promote_types(dt, bias.dtype))


def _allowed(nkeys: Tensor, mask: Tensor | None, S: int) -> Tensor:
    allowed = torch.arange(S, device=nkeys.device)[None, None, None, :] < nkeys[..., None]
    return allowed if mask is None else allowed & mask


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, nkeys: Tensor, mask: Tensor | None,
                scale: float | None) -> Tensor:
        from miles.kernels import invariant as kernels

        ctx.save_for_backward(q, k, v, nkeys, mask)
        ctx.scale = scale
        return kernels.attention(q, k, v, nkeys, mask, scale)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple:
        q, k, v, nkeys, mask = ctx.saved_tensors
        with torch.enable_grad():
            q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
            out = _F_SDPA(q, k, v, attn_mask=_allowed(nkeys, mask, k.shape[-2]), scale=ctx.scale,
                          enable_gqa=q.shape[1] != k.shape[1])
            gq, gk, gv = torch.autograd.grad(out, (q, k, v), g)
        return gq, gk, gv, None, None, None


def cuda_sdpa(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None = None, dropout_p: float = 0.0,
              is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False) -> Tensor:
    """``F.scaled_dot_product_attention`` on CUDA as ``miles.kernels.invariant.attention``:
    a query's keys are reduced in the same fixed chunks from key 0 whichever path calls it."""
    if not on(q):
        return _F_SDPA(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                       enable_gqa=enable_gqa)
    from miles.kernels import invariant as kernels

    if dropout_p:
        raise ValueError("batch-invariant attention has no dropout")
    Q, S = q.shape[-2], k.shape[-2]
    nkeys = kernels.causal_nkeys(Q, S, q.device) if is_causal else torch.full((1, 1, 1), S, device=q.device,
                                                                               dtype=torch.int32)
    mask = None
    if attn_mask is not None:
        mask = attn_mask if attn_mask.dtype == torch.bool else attn_mask > float("-inf")
        while mask.dim() < 4:
            mask = mask[None]
        nkeys = torch.minimum(nkeys, kernels.mask_nkeys(mask))
    dt = _compute_dtype(q)
    q, k, v = q.to(dt), k.to(dt), v.to(dt)
    if _grad_needed(q, k, v):
        return _Attention.apply(q, k, v, nkeys, mask, scale)
    return kernels.attention(q, k, v, nkeys, mask, scale)


def _rms_norm_ref(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    x32 = x.float()
    return weight.to(x.dtype) * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        from miles.kernels import invariant as kernels

        ctx.save_for_backward(x, weight)
        ctx.eps = eps
        return kernels.rms_norm(x, weight, eps)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple:
        x, weight = ctx.saved_tensors
        with torch.enable_grad():
            x, weight = x.detach().requires_grad_(True), weight.detach().requires_grad_(True)
            gx, gw = torch.autograd.grad(_rms_norm_ref(x, weight, ctx.eps), (x, weight), g)
        return gx, gw, None


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm as the per-row kernel (``miles.models.fused.rms_norm`` calls it in the mode)."""
    if _grad_needed(x, weight):
        return _RMSNorm.apply(x, weight, eps)
    from miles.kernels import invariant as kernels

    return kernels.rms_norm(x, weight, eps)


class _LogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        from miles.kernels import invariant as kernels

        y = kernels.log_softmax(x)
        ctx.save_for_backward(y)
        ctx.in_dtype = x.dtype
        return y

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple:
        (y,) = ctx.saved_tensors
        return (g - y.exp() * g.sum(-1, keepdim=True)).to(ctx.in_dtype),


class _Softmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, dtype: torch.dtype | None) -> Tensor:
        from miles.kernels import invariant as kernels

        y = kernels.softmax(x, dtype)
        ctx.save_for_backward(y)
        ctx.in_dtype = x.dtype
        return y

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple:
        (y,) = ctx.saved_tensors
        return (y * (g - (g * y).sum(-1, keepdim=True))).to(ctx.in_dtype), None


class _LogSumExp(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        from miles.kernels import invariant as kernels

        lse = kernels.logsumexp(x)
        ctx.save_for_backward(x, lse)
        return lse

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple:
        x, lse = ctx.saved_tensors
        return (g[..., None] * (x.float() - lse[..., None]).exp()).to(x.dtype),


def _last(x: Tensor, dim: int | None) -> bool:
    return on(x) and x.dim() > 0 and dim is not None and dim in (-1, x.dim() - 1)


def cuda_log_softmax(input: Tensor, dim: int | None = None, _stacklevel: int = 3,
                     dtype: torch.dtype | None = None) -> Tensor:
    """Last-dimension log-softmax of float32 logits as ``x - logsumexp(x)``, the row kernel's."""
    if _last(input, dim) and (dtype or input.dtype) == torch.float32:
        return _LogSoftmax.apply(input)
    return _F_LOG_SOFTMAX(input, dim, _stacklevel, dtype)


def cuda_softmax(input: Tensor, dim: int | None = None, _stacklevel: int = 3,
                 dtype: torch.dtype | None = None) -> Tensor:
    if _last(input, dim) and input.shape[-1] <= 65536:
        return _Softmax.apply(input, dtype)
    return _F_SOFTMAX(input, dim, _stacklevel, dtype)


def cuda_logsumexp(input: Tensor, dim: Any, keepdim: bool = False, **kw: Any) -> Tensor:
    d = dim[0] if isinstance(dim, (tuple, list)) and len(dim) == 1 else dim
    if not kw and isinstance(d, int) and _last(input, d) and input.dtype == torch.float32:
        out = _LogSumExp.apply(input)
        return out[..., None] if keepdim else out
    return _LOGSUMEXP(input, dim, keepdim, **kw)


def residual(h: Tensor) -> Tensor:
    """The model's residual stream after the embedding: in the mode on CUDA, the autocast dtype
    (the engine's stream is in its bf16 weights' dtype; the trainer's float32 embedding would
    otherwise carry a float32 stream, rounded differently at every residual add)."""
    if on(h) and torch.is_autocast_enabled(h.device.type):
        return h.to(torch.get_autocast_dtype(h.device.type))
    return h


def row_sum(w: Tensor) -> Tensor:
    """``w.sum(-1, keepdim=True)`` as explicit adds, left to right, in the mode on CUDA (a
    reduction kernel splits a row by the number of rows)."""
    if not on(w):
        return w.sum(dim=-1, keepdim=True)
    total = w[..., :1]
    for j in range(1, w.shape[-1]):
        total = total + w[..., j : j + 1]
    return total


def enable(keys: int, linear_fn: Any = None, device: torch.device | str = "cpu",
           kernels: bool | None = None) -> None:
    """Route every ``F.linear`` and ``F.scaled_dot_product_attention`` of this process
    through the batch-invariant forms (``--true-on-policy``: each actor process calls it
    once, with the run's context length as ``keys``). On CUDA (``device``) they, and the
    last-dimension softmax, log-softmax, logsumexp and RMSNorm, are the Triton kernels of
    ``miles.kernels.invariant``; ``keys`` then does not matter (the kernels' key chunks are
    fixed from key 0). ``kernels=True`` on the CPU runs them in triton's interpreter (tests)."""
    global KERNELS, _DEVICE
    dev = torch.device(device).type
    if (dev == "cuda") if kernels is None else kernels:
        from miles.kernels import invariant as triton_kernels

        if not triton_kernels.available(dev):
            raise RuntimeError(f"--true-on-policy on {dev} needs triton (miles.kernels.invariant)")
        KERNELS, _DEVICE = True, dev
        torch.nn.functional.linear = linear_fn or cuda_linear
        torch.nn.functional.scaled_dot_product_attention = cuda_sdpa
        torch.nn.functional.log_softmax = cuda_log_softmax
        torch.nn.functional.softmax = cuda_softmax
        torch.logsumexp = cuda_logsumexp
        return
    torch.nn.functional.linear = linear_fn or linear
    torch.nn.functional.scaled_dot_product_attention = _sdpa(keys)


def skip_uninitialized_fill() -> None:
    """Deterministic algorithms (the mode's) fill every new tensor with NaN so that a read of
    memory nothing wrote is reproducible; the mode's kernels and ops write every element they
    later read, so the fills are pure cost: a launch for every tensor a decode step creates,
    several a layer (benchmarks/log/true_on_policy.md has the profile)."""
    torch.utils.deterministic.fill_uninitialized_memory = False


def disable() -> None:
    global KERNELS
    KERNELS = False
    torch.nn.functional.linear = _F_LINEAR
    torch.nn.functional.scaled_dot_product_attention = _F_SDPA
    torch.nn.functional.log_softmax = _F_LOG_SOFTMAX
    torch.nn.functional.softmax = _F_SOFTMAX
    torch.logsumexp = _LOGSUMEXP


@contextlib.contextmanager
def mode(keys: int, linear_fn: Any = None, device: torch.device | str = "cpu",
         kernels: bool | None = None) -> Iterator[None]:
    """Within it, every ``F.linear`` (the model's projections, experts, router and LM head)
    and every ``F.scaled_dot_product_attention`` runs in its batch-invariant form, attention
    over ``keys`` fixed key positions (on the CPU; on CUDA ``device`` the Triton kernels).
    ``linear_fn`` swaps in another GEMM (tests break the invariance on purpose with it)."""
    enable(keys, linear_fn, device, kernels)
    try:
        yield
    finally:
        disable()
