"""The inference fast path of a decoder layer: fused projections and pure step functions.

``CausalLM.fuse_projections()`` (the engine calls it; inference only) stores each layer's
q/k/v weights, and each MLP's gate/up weights, as views of one concatenated matrix, and
switches the layers to the pure functions below. A layer then costs two calls around its
attention backend:

    q, k, v = attention_input(h, ...)            # norm → qkv GEMM → q/k-norm → RoPE
    a = backend(layer, q, k, v)                   # KV-cache write + attention (engine's)
    h = attention_output_mlp(h, a, ...)          # o_proj → residual → norm → SwiGLU → residual

A decode backend that offers ``attend_rope`` (the Triton decode attention) takes the raw q/k/v
projection instead (``qkv_projection``) and applies the q/k-norms and RoPE in its own kernel:
three launches a layer fewer.

The functions take every weight as an argument, so one ``torch.compile``d copy serves all
layers (``compile_fast_path``): Inductor fuses the elementwise work (RMSNorm, RoPE, SiLU·up,
residuals) into a few kernels, which is what makes small-batch decode memory-bound instead
of launch-bound. Attention stays outside the compiled region on purpose: it mutates the KV
cache, which compiled graphs would treat as an input to copy. MoE layers use the compiled
attention part and the eager expert dispatch (data-dependent shapes).
"""

from __future__ import annotations

import logging
import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from miles.models import invariant

log = logging.getLogger(__name__)

Adapter = tuple[Tensor, Tensor] | None  # an unmerged LoRA adapter: (A, B), α/r folded into B
LayerAdapters = tuple[Adapter, Adapter, Adapter, Adapter] | None  # qkv, o, gate_up, down


class _RMSNorm32(torch.autograd.Function):
    """float32 RMSNorm whose backward reuses the forward's 1/rms. The forward is the fused
    op ``F.rms_norm`` runs (the same bits); autograd's own backward of it recomputes the
    statistics from x with pow/mean/rsqrt passes, each a full pass over [tokens, dim]: on the
    CPU that backward cost several times its forward for a small model's train step."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        out, rstd = torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return out

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        x, weight, rstd = ctx.saved_tensors
        xhat = x * rstd
        dx = dw = None
        if ctx.needs_input_grad[0]:
            gw = g * weight
            dx = (gw - xhat * (gw * xhat).mean(-1, keepdim=True)) * rstd
        if ctx.needs_input_grad[1]:
            dw = (g * xhat).reshape(-1, x.shape[-1]).sum(0)
        return dx, dw, None


_FUSED_RMS = hasattr(torch.ops.aten, "_fused_rms_norm")


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """transformers' RMSNorm numerics: float32 statistics, cast back, then scale, in x's
    dtype. A float32 weight (the trainer's, under autocast) is cast to x's dtype first, so
    the result stays bf16 as in the engine, whose weights are the bf16 copies of the same
    floats: the product is the engine's, bit for bit. transformers would promote it to
    float32, and the trainer's q/k then ran RoPE in float32 and were cast back for
    attention, both ways: a few percent of a train step. In ``--true-on-policy`` on CUDA it is
    the per-row kernel (``miles.models.invariant.rms_norm``) with the same arithmetic.
    A float32 forward that autograd records (the eager trainer's) runs ``_RMSNorm32``:
    the same output, a cheaper backward."""
    if invariant.on(x):
        return invariant.rms_norm(x, weight, eps)
    if x.dtype == torch.float32:
        if (_FUSED_RMS and torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
                and weight.dtype == torch.float32 and not torch.compiler.is_compiling()):
            return _RMSNorm32.apply(x, weight, eps)
        return F.rms_norm(x, (x.shape[-1],), weight, eps)  # bitwise equal in float32
    x32 = x.float()
    return weight.to(x.dtype) * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rope_qk(q: Tensor, k: Tensor, cos: Tensor, signed_sin: Tensor) -> tuple[Tensor, Tensor]:
    """RoPE on q [B, T, H, D] and k [B, T, KV, D] together; returns [B, H, T, D], [B, KV, T, D].

    HF's ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x2, x1)``, written as
    ``roll(x, D/2) * signed_sin`` where ``signed_sin = cat(-sin1, sin2)`` (``Rotary``): the
    same products up to sign, so bitwise equal, in fewer kernels."""
    H, KV = q.shape[2], k.shape[2]
    qk = torch.cat((q, k), dim=2).transpose(1, 2)
    qk = qk * cos + torch.roll(qk, qk.shape[-1] // 2, dims=-1) * signed_sin
    return qk.split((H, KV), dim=1)


def rope_qk_tokens(q: Tensor, k: Tensor, cos: Tensor, signed_sin: Tensor) -> tuple[Tensor, Tensor]:
    """``rope_qk`` without the transpose: q [B, T, H, D], k [B, T, KV, D], cos/sin
    [B, T, 1, D]; returns contiguous q [B, T, H, D] and k [B, T, KV, D].

    The trainer's layers take this path. Compiled with dynamic batch and length, the
    transposing form indexes its [B, H+KV, T, D] output through runtime sizes, so each
    element pays integer divisions by them, which leaves its kernel at a fraction of the copy
    bandwidth. Token-major, every divisor is a
    static head count or head size. Attention gets the transposed views (``_attend``),
    so their gradients come back token-major and contiguous, as the compiled backward
    expects them: split views (as ``rope_qk`` returns) were copied to contiguous there,
    three copies a layer. q and k are rotated apart, with the same products as ``rope_qk``
    (bitwise equal): joined by a cat, split and copied back to contiguous, they cost three
    more passes forward and two more backward, which eager autograd runs one by one."""
    cos, signed_sin = cos.to(q.dtype), signed_sin.to(q.dtype)  # the engine's tables are in its dtype too
    half = q.shape[-1] // 2
    return (q * cos + torch.roll(q, half, dims=-1) * signed_sin,
            k * cos + torch.roll(k, half, dims=-1) * signed_sin)


def plus_lora(y: Tensor, x: Tensor, ab: Adapter) -> Tensor:
    """``y + B(A(x))`` for an unmerged adapter ``ab`` = (A [r', in], B [out, r']; α/r folded into
    B), or ``y`` itself when there is none. A fused projection's adapter is A stacked over its
    parts and B block-diagonal (``miles.engines.lora.UnmergedAdapters``), so the parts' deltas
    come out of two GEMMs, laid out as the fused output is."""
    if ab is None:
        return y
    return y + F.linear(F.linear(x, ab[0]), ab[1])


def attention_input(h: Tensor, norm_w: Tensor, eps: float, qkv_w: Tensor, qkv_b: Tensor | None,
                    q_norm_w: Tensor | None, k_norm_w: Tensor | None, cos: Tensor, sin: Tensor,
                    H: int, KV: int, D: int, qkv_ab: Adapter = None) -> tuple[Tensor, Tensor, Tensor]:
    x = rms_norm(h, norm_w, eps)
    B, T = x.shape[0], x.shape[1]
    qkv = plus_lora(F.linear(x, qkv_w, qkv_b), x, qkv_ab)
    if _kernels_serve(qkv):  # --true-on-policy: the same bits in one launch
        from miles.kernels import invariant as kernels

        qk = kernels.qk_norm_rope(qkv, H, KV, q_norm_w, k_norm_w, eps, cos, sin).transpose(1, 2)
        q, k = qk.split((H, KV), dim=1)
        return q, k, qkv.view(B, T, H + 2 * KV, D)[:, :, H + KV :].transpose(1, 2)
    q, k, v = qkv.view(B, T, H + 2 * KV, D).split((H, KV, KV), dim=2)
    if q_norm_w is not None:
        q, k = rms_norm(q, q_norm_w, eps), rms_norm(k, k_norm_w, eps)
    q, k = rope_qk(q, k, cos, sin)
    return q, k, v.transpose(1, 2)


def qkv_projection(h: Tensor, norm_w: Tensor, eps: float, qkv_w: Tensor, qkv_b: Tensor | None,
                   qkv_ab: Adapter = None) -> Tensor:
    """``attention_input`` up to the raw q/k/v projection, for an attention backend that applies
    the q/k-norms and RoPE itself (``attend_rope``)."""
    x = rms_norm(h, norm_w, eps)
    return plus_lora(F.linear(x, qkv_w, qkv_b), x, qkv_ab)


def _kernels_serve(*ts: Tensor) -> bool:
    """--true-on-policy on CUDA, outside autograd, all in one dtype: the mode's fused kernels
    (bitwise the eager ops the trainer's forward runs) may replace a pair of eager ops."""
    return invariant.on(ts[0]) and not torch.is_grad_enabled() and all(t.dtype == ts[0].dtype for t in ts)


def silu_mul(gate_up: Tensor) -> Tensor:
    # on CUDA, whose SiLU the kernel computes (libdevice's expf); triton's interpreter has numpy's
    if _kernels_serve(gate_up) and gate_up.is_cuda:
        from miles.kernels import invariant as kernels

        return kernels.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def residual_linear(h: Tensor, x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
    """``h + F.linear(x, w, b)``: a residual add after a projection."""
    if _kernels_serve(h, x, w, *(() if b is None else (b,))):
        from miles.kernels import invariant as kernels

        return kernels.matmul(x, w, b, residual=h)
    return h + F.linear(x, w, b)


def attention_output(h: Tensor, attn: Tensor, o_w: Tensor, o_b: Tensor | None, o_ab: Adapter = None) -> Tensor:
    B, T = h.shape[0], h.shape[1]
    x = attn.transpose(1, 2).reshape(B, T, -1)
    return plus_lora(residual_linear(h, x, o_w, o_b), x, o_ab)


def attention_output_mlp(h: Tensor, attn: Tensor, o_w: Tensor, o_b: Tensor | None, norm_w: Tensor,
                         eps: float, gate_up_w: Tensor, down_w: Tensor, lora: LayerAdapters = None) -> Tensor:
    if lora is None:
        h = attention_output(h, attn, o_w, o_b)
        return residual_linear(h, silu_mul(F.linear(rms_norm(h, norm_w, eps), gate_up_w)), down_w)
    _, o_ab, gate_up_ab, down_ab = lora
    h = attention_output(h, attn, o_w, o_b, o_ab)
    x = rms_norm(h, norm_w, eps)
    act = silu_mul(plus_lora(F.linear(x, gate_up_w), x, gate_up_ab))
    return plus_lora(residual_linear(h, act, down_w), act, down_ab)


class FastPath:
    """The step functions a fused layer calls (plain, or compiled by ``compile_fast_path``)."""

    def __init__(self, wrap: Any = None) -> None:
        wrap = wrap or (lambda fn: fn)
        self.attention_input = wrap(attention_input)
        self.qkv_projection = wrap(qkv_projection)
        self.attention_output = wrap(attention_output)
        self.attention_output_mlp = wrap(attention_output_mlp)
        self.rms_norm = wrap(rms_norm)
        self.silu_mul = wrap(silu_mul)


_COMPILED: dict[tuple, FastPath] = {}


def _compiled_or_eager(fn: Any, kw: dict[str, Any]) -> Any:
    """``torch.compile(fn)`` that turns into ``fn`` for good once dynamo refuses to compile
    another variant: the copy is shared by every model of the process, and a process that
    builds many (tests, a policy next to a draft in two dtypes) can pass dynamo's recompile
    limit, which ``fullgraph=True`` makes a hard error. The refusal comes before running."""
    compiled = torch.compile(fn, **kw)
    eager = False

    def call(*args: Any, **kwargs: Any) -> Any:
        nonlocal eager
        if not eager:
            try:
                return compiled(*args, **kwargs)
            except torch._dynamo.exc.FailOnRecompileLimitHit:
                eager = True
                log.warning("%s: dynamo's recompile limit reached; running it eagerly from now on", fn.__name__)
        return fn(*args, **kwargs)

    return call


def _own_code(fn: Any) -> Any:
    """``fn`` with a code object of its own: dynamo keeps compiled variants, and counts them
    against its recompile limit, per code object."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def compile_fast_path(role: str = "policy", **compile_kwargs: Any) -> FastPath:
    """One compiled copy of each step function per ``role``, shared by all layers and all
    models of that role in the process (dynamic shapes, so batch and sequence length changes
    do not recompile). A draft model (``role="draft"``) gets copies of its own: sharing the
    policy's, its shapes and dtypes passed dynamo's limit of 8 variants in a speculative
    engine (``benchmarks/spec_overhead.py``), and the policy's prefill then ran eagerly too."""
    kw = {"dynamic": True, "fullgraph": True, **compile_kwargs}
    key = (role, *sorted(kw.items()))
    if key not in _COMPILED:
        _COMPILED[key] = FastPath(lambda fn: _compiled_or_eager(_own_code(fn), kw))
    return _COMPILED[key]


def adjacent_rows(parts: list[Tensor]) -> Tensor | None:
    """The one matrix ``parts`` already are, as a view of their storage, when they lie one after
    another in it (row-major, same dtype and width); else None. A LoRA trainer lays its frozen
    q/k/v and gate/up out so (``miles.trainers.lora.fuse_frozen_base``), and an engine serving
    those tensors (``miles.engines.shared``) then fuses them without a copy."""
    first = parts[0]
    cols, size = first.shape[-1], first.element_size()
    offset = first.storage_offset()
    for p in parts:
        if (p.ndim != 2 or p.shape[1] != cols or p.dtype != first.dtype or not p.is_contiguous()
                or p.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or p.storage_offset() != offset):
            return None
        offset += p.numel()
    if offset * size > first.untyped_storage().nbytes():
        return None
    rows = sum(p.shape[0] for p in parts)
    return torch.empty(0, dtype=first.dtype, device=first.device).set_(
        first.untyped_storage(), first.storage_offset(), (rows, cols), (cols, 1))


def fuse_linears(*linears: nn.Linear) -> tuple[Tensor, Tensor | None]:
    """Concatenate the weights (and biases) of ``linears`` into one tensor and make each
    module's parameters views of it, so in-place weight updates reach the fused copy and
    ``state_dict`` keeps the HF names. Inference only: gradients would not reach the views."""
    if any(p.requires_grad for lin in linears for p in lin.parameters()):
        raise RuntimeError("fusing projections is for inference: freeze the parameters first")
    weight = adjacent_rows([lin.weight.detach() for lin in linears])
    if weight is None:
        weight = torch.cat([lin.weight.detach() for lin in linears])
    for lin, view in zip(linears, weight.split([lin.out_features for lin in linears])):
        lin.weight = nn.Parameter(view, requires_grad=False)
    bias = None
    if linears[0].bias is not None:
        bias = torch.cat([lin.bias.detach() for lin in linears])
        for lin, view in zip(linears, bias.split([lin.out_features for lin in linears])):
            lin.bias = nn.Parameter(view, requires_grad=False)
    return weight, bias


def layer_args(layer: Any) -> tuple[tuple, tuple | None]:
    """The tensors and sizes a fused layer passes to its step functions, gathered once
    (in-place weight updates keep them valid; re-assigning a Parameter would not)."""
    attn, norm, post = layer.self_attn, layer.input_layernorm, layer.post_attention_layernorm
    qn = attn.q_norm.weight if attn.q_norm is not None else None
    kn = attn.k_norm.weight if attn.k_norm is not None else None
    first = (norm.weight, norm.eps, *attn.qkv, qn, kn)
    sizes = (attn.num_heads, attn.num_kv_heads, attn.head_dim)
    o = (attn.o_proj.weight, attn.o_proj.bias)
    second = None if layer.is_moe else (*o, post.weight, post.eps, layer.mlp.gate_up[0], layer.mlp.down_proj.weight)
    return (first, sizes, o), second


def fused_layer_forward(layer: Any, fast: FastPath, h: Tensor, cos: Tensor, sin: Tensor,
                        backend: Any, routing: Tensor | None) -> tuple[Tensor, Tensor | None]:
    """DecoderLayer.forward for a fused layer (same math as the module path)."""
    (first, sizes, o), second = layer.fast_args
    lora: LayerAdapters = getattr(layer, "lora_args", None)  # unmerged adapters (miles.engines.lora)
    qkv_ab = lora[0] if lora is not None else None
    attend_rope = getattr(backend, "attend_rope", None)
    if attend_rope is not None and h.shape[1] == 1:  # a decode step whose attention does q/k-norm + RoPE
        B, (H, KV, D) = h.shape[0], sizes
        norm_w, eps, qkv_w, qkv_b, q_norm, k_norm = first
        qkv = fast.qkv_projection(h, norm_w, eps, qkv_w, qkv_b, qkv_ab).view(B, H + 2 * KV, D)
        q, k, v = qkv.split((H, KV, KV), dim=1)
        qk_eps = layer.self_attn.q_norm.eps if q_norm is not None else 0.0
        a = attend_rope(layer.self_attn.layer_idx, q, k, v, cos.reshape(B, D), sin.reshape(B, D), q_norm, k_norm,
                        qk_eps)
    else:
        q, k, v = fast.attention_input(h, *first, cos, sin, *sizes, qkv_ab)
        a = backend(layer.self_attn.layer_idx, q, k, v)
    if second is None:  # MoE: experts stay eager (an engine with unmerged adapters is dense: lora is None)
        h = fast.attention_output(h, a, *o)
        y, idx = layer.mlp(layer.post_attention_layernorm(h), routing)
        return h + y, idx
    if getattr(backend, "residual_gemm", False) and second[1] is None:
        return residual_gemm_mlp(fast, h, a, *second, fused_mlp=getattr(backend, "fused_mlp", False), lora=lora), None
    return fast.attention_output_mlp(h, a, *second, lora), None


def residual_gemm_mlp(fast: FastPath, h: Tensor, attn: Tensor, o_w: Tensor, o_b: None, norm_w: Tensor,
                      eps: float, gate_up_w: Tensor, down_w: Tensor, *, fused_mlp: bool = False,
                      lora: LayerAdapters = None) -> Tensor:
    """``attention_output_mlp`` with its two residual adds inside the o / down GEMMs:
    ``h.addmm_(x, wᵀ)`` is one cuBLAS call with beta = 1, where ``h + linear(x, w)`` is the
    GEMM and then an add kernel. Why: at decode sizes a kernel's cost is mostly fixed (launch,
    ramp and tail, whatever its bytes; ``benchmarks/blas_choice.py``), and a 28-layer step has
    56 such adds.

    ``h`` is updated in place and returned: the decode step's own residual stream (each
    layer's input is the previous layer's output, the first a fresh embedding), which the
    backend vouches for with ``residual_gemm``. The sum is rounded once (GEMM accumulator +
    h in float32) where the unfused path rounds the projection first: CONSISTENCY.md.

    ``fused_mlp``: the gate/up GEMM and SiLU·up in one Triton kernel (``miles.kernels.gate_up``,
    the backend's ``fused_mlp``, which the runner sets for steps of at least ``gate_up.MIN_ROWS``
    rows), one launch a layer fewer.

    ``lora``: unmerged adapters; each adds its ``B(A(x))`` with one more GEMM (the o / down
    deltas also into ``h`` in place), and gate/up with an adapter runs unfused (the kernel
    has no place for the delta before SiLU·up)."""
    B = h.shape[0]
    h2 = h.view(B, -1)
    a2 = attn.reshape(B, -1)
    h2.addmm_(a2, o_w.t())
    o_ab, gate_up_ab, down_ab = (None, None, None) if lora is None else lora[1:]
    if o_ab is not None:
        h2.addmm_(F.linear(a2, o_ab[0]), o_ab[1].t())
    x = fast.rms_norm(h, norm_w, eps)
    if gate_up_ab is not None:
        x2 = x.view(B, -1)
        act = fast.silu_mul(plus_lora(F.linear(x2, gate_up_w), x2, gate_up_ab))
    elif fused_mlp:
        from miles.kernels.gate_up import gate_up_silu

        act = gate_up_silu(x.view(B, -1), gate_up_w)
    else:
        act = fast.silu_mul(F.linear(x, gate_up_w)).view(B, -1)
    h2.addmm_(act, down_w.t())
    if down_ab is not None:
        h2.addmm_(F.linear(act, down_ab[0]), down_ab[1].t())
    return h
