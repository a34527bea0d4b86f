"""The one quantizer of miles: FP8 (e4m3, block-scaled) and INT4 (group-wise, QAT), used by
the trainer's forward, the engine's weights, the weight transport and checkpoint export.

Formats (the DeepSeek-V3 / Transformer Engine block-scaling recipe for FP8):

- FP8 weights: e4m3 values with one float32 scale per 128 × 128 block of ``[out, in]``
  (``scale = max|w| / 448`` over the block); activations: one float32 scale per token and
  128 input features (1 × 128). Edge blocks are partial; nothing needs to divide by 128.
- INT4 weights (W4A16): symmetric, one float32 scale per row and ``group_size`` inputs,
  ``scale = max|w| / 7``, values in [-7, 7]; stored two a byte (``pack_int4``: low nibble the
  even column, each nibble ``q + 8``). The group size must divide the input dimension.
- Either quantizes a weight's bf16 rounding (``_source``), what a bf16 engine holds: the
  trainer's float32 master weights and an engine's bf16 copy of the same checkpoint then give
  one stored form, before the first weight update as after it.

``apply_quantization(model, spec)`` swaps the targeted ``nn.Linear`` modules' class to
``QuantLinear`` (names and ``state_dict`` unchanged: master weights stay in their own dtype).
Its forward is the fake-quantized one, ``linear(qdq(x), qdq(W))``, with a straight-through
estimator: the gradient is the higher-precision gradient taken at the dequantized weights.
The engine runs the same module, so on the CPU its forward *is* the trainer's; on CUDA
(no grad) it caches the quantized weight once per weight update (the parameter's
``_version`` moves on each in-place copy) and runs the low-precision GEMMs of
``miles.kernels.lowp`` (FP8 ``torch._scaled_mm``, the Triton dequantizing INT4 GEMM). After a
weight update the engine's cache holds the trainer's own values and scales as the wire
brought them (``refresh(model, exact)``), not a requantization of its bf16 parameters.

Activation quantization turns any difference in a layer's input, however small, into whole
FP8 steps for the elements it tips over a rounding boundary, so unified FP8's mismatch is only
as small as the engine's and trainer's forwards are alike *before* each quantizer. So a
quantized model under autocast (the trainer) keeps its residual stream in the autocast dtype,
as the bf16 engine's is, instead of float32 (``_stream_in_compute_dtype``); what still differs
on CUDA is the kernels' summation order, which depends on the batch's shape (cuBLAS, attention).
Under ``--true-on-policy`` (``invariant.on``) the CUDA forward takes the quantizer's own
arithmetic instead of ``lowp``'s GEMMs (dequantized operands through the mode's
batch-invariant GEMM), so the engine's forward is the trainer's bit for bit, quantizers included.

Targets: the decoder layers' projections; never the embedding, the LM head or a router
(``mlp.gate``, ``shared_expert_gate``), which stay in high precision as in the references.
INT4 targets MoE expert weights by default (``--int4-targets experts``), or every such
linear weight (``all-linear``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from miles.kernels.quantize import (  # noqa: F401  (the quantizer's numerics, re-exported)
    FP8,
    FP8_MAX,
    INT4_MAX,
    BLOCK,
    _blocks,
    _expand,
    fp8_quantize_weight,
    fp8_dequantize_weight,
    fp8_quantize_act,
    fp8_qdq_act,
    _check_group,
    int4_quantize,
    int4_dequantize,
    pack_int4,
    unpack_int4,
)
from miles.models import invariant

MODES = ("none", "fp8", "int4-qat")
_EXPERT = re.compile(r"\.experts\.\d+\.")


class QuantConfig(msgspec.Struct, kw_only=True):
    """Low-precision weights (and FP8 activations) of the engine and the trainer."""

    quantization: Literal["none", "fp8", "int4-qat"] = "none"  # one quantizer for sampling and training (unified)
    rollout_quantization: Literal["none", "fp8"] = "none"  # the engines alone sample in FP8 (bf16 training; TIS/MIS correct it)
    int4_group_size: int = 128  # inputs per INT4 scale (must divide each quantized layer's input dimension)
    int4_targets: Literal["experts", "all-linear"] = "experts"  # INT4 on MoE expert weights, or on every decoder linear

    def engine_spec(self) -> "QuantSpec | None":
        mode = self.quantization if self.quantization != "none" else self.rollout_quantization
        return _spec(mode, self)

    def trainer_spec(self) -> "QuantSpec | None":
        return _spec(self.quantization, self)


def _spec(mode: str, cfg: QuantConfig) -> "QuantSpec | None":
    if mode == "none":
        return None
    return QuantSpec("fp8" if mode == "fp8" else "int4", cfg.int4_group_size, cfg.int4_targets)


@dataclass(frozen=True)
class QuantSpec:
    kind: Literal["fp8", "int4"]
    group_size: int = 128  # INT4 only
    targets: str = "experts"  # INT4 only; FP8 always quantizes every decoder linear

    def targets_name(self, name: str) -> bool:
        """Whether the linear module ``name`` (HF naming, no ``.weight``) is quantized: a
        decoder layer's ``*_proj`` (routers, norms, embeddings and the head never are)."""
        if ".layers." not in f".{name}" or not name.endswith("_proj"):
            return False
        return self.kind == "fp8" or self.targets == "all-linear" or bool(_EXPERT.search(f"{name}."))


# ---- one entry per spec ------------------------------------------------------------------------
def _source(w: Tensor) -> Tensor:
    """A weight as the quantizer reads it: rounded to bf16 (a float32 checkpoint that the engine
    loads in bf16 quantized otherwise differently on the two sides until the first update)."""
    return w.detach() if w.dtype == torch.bfloat16 else w.detach().to(torch.bfloat16)


def quantize_weight(w: Tensor, spec: QuantSpec) -> tuple[Tensor, Tensor]:
    """The stored form: (fp8 values, block scales) or (packed INT4 bytes, group scales)."""
    if spec.kind == "fp8":
        return fp8_quantize_weight(_source(w))
    q, scale = int4_quantize(_source(w), spec.group_size)
    return pack_int4(q), scale


def dequantize_weight(q: Tensor, scale: Tensor, spec: QuantSpec, dtype: torch.dtype = torch.float32) -> Tensor:
    if spec.kind == "fp8":
        return fp8_dequantize_weight(q, scale, dtype)
    return int4_dequantize(unpack_int4(q), scale, dtype)


def qdq_weight(w: Tensor, spec: QuantSpec) -> Tensor:
    """Quantize–dequantize, in ``w``'s dtype (no gradient)."""
    if spec.kind == "fp8":
        return fp8_dequantize_weight(*fp8_quantize_weight(_source(w)), w.dtype)
    return int4_dequantize(*int4_quantize(_source(w), spec.group_size), w.dtype)


class _STE(torch.autograd.Function):
    """Forward: the quantized–dequantized tensor; backward: the gradient as it comes."""

    @staticmethod
    def forward(ctx, x: Tensor, qdq: Tensor) -> Tensor:  # noqa: ANN001
        return qdq

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # noqa: ANN001
        return grad, None


def fake_quant_weight(w: Tensor, spec: QuantSpec) -> Tensor:
    return _STE.apply(w, qdq_weight(w, spec)) if w.requires_grad else qdq_weight(w, spec)


def fake_quant_act(x: Tensor) -> Tensor:
    return _STE.apply(x, fp8_qdq_act(x)) if x.requires_grad else fp8_qdq_act(x)


class _FP8Linear(torch.autograd.Function):
    """The trainer's FP8 linear on CUDA: the forward is the engine's (``lowp.linear``: FP8 values,
    block-wise cuBLAS GEMM), so the log-probs the loss sees are the ones the engine sampled with;
    the backward is the fake-quantized linear's, straight through both quantizers (gradients
    against the dequantized operands, in the forward's dtype)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor, bias: Tensor | None, stored: tuple[Tensor, ...],
                spec: QuantSpec) -> Tensor:
        from miles.kernels import lowp

        ctx.save_for_backward(x, *stored)
        ctx.has_bias, ctx.w_dtype = bias is not None, w.dtype
        return lowp.linear(x, stored, spec, bias)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, wq, ws = ctx.saved_tensors
        w = fp8_dequantize_weight(wq, ws, grad.dtype)
        g2 = grad.reshape(-1, grad.shape[-1])
        gx = (g2 @ w).view(*grad.shape[:-1], w.shape[1]) if ctx.needs_input_grad[0] else None
        gw = None
        if ctx.needs_input_grad[1]:
            gw = (g2.t() @ fp8_qdq_act(x).reshape(-1, x.shape[-1]).to(grad.dtype)).to(ctx.w_dtype)
        gb = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb, None, None


def _kernels(t: Tensor) -> bool:
    """Whether ``lowp``'s low-precision GEMMs serve ``t`` (CUDA, outside ``--true-on-policy``);
    elsewhere the quantizer's arithmetic runs on dequantized operands."""
    return t.is_cuda and not invariant.on(t)


class QuantLinear(nn.Linear):
    """An ``nn.Linear`` whose forward is quantized by ``self.quant`` (set by
    ``apply_quantization``). Grad-free calls cache the weight's stored form (values, scales)
    per weight version, and where the quantizer's arithmetic runs instead of ``lowp``'s GEMMs
    (the CPU, ``--true-on-policy``), its dequantized weight, derived from that form."""

    quant: QuantSpec
    _cache: tuple[tuple[int, int], tuple[Tensor, Tensor]] | None = None  # (weight version, stored form)
    _deq: Tensor | None = None  # the stored form dequantized into the weight's dtype

    def forward(self, x: Tensor) -> Tensor:
        spec, w = self.quant, self.weight
        grad = torch.is_grad_enabled() and w.requires_grad
        kernels = _kernels(x)
        if grad and not (kernels and spec.kind == "fp8"):
            xin = fake_quant_act(x) if spec.kind == "fp8" else x
            return F.linear(xin, fake_quant_weight(w, spec), self.bias)
        stored = self._stored(w)
        if grad:  # FP8 on CUDA: the engine's forward, a straight-through backward
            if torch.is_autocast_enabled("cuda"):  # the GEMM's inputs in the dtype F.linear would take
                dt = torch.get_autocast_dtype("cuda")
                x, bias = x.to(dt), None if self.bias is None else self.bias.to(dt)
            else:
                bias = self.bias
            with torch.autocast("cuda", enabled=False):
                return _FP8Linear.apply(x, w, bias, stored, spec)
        if kernels:
            from miles.kernels import lowp

            return lowp.linear(x, stored, spec, self.bias)
        if self._deq is None:
            with torch.no_grad():
                self._deq = dequantize_weight(*stored, spec, w.dtype)
        xin = fp8_qdq_act(x) if spec.kind == "fp8" else x
        return F.linear(xin, self._deq, self.bias)

    def _stored(self, w: Tensor) -> tuple[Tensor, Tensor]:
        """The stored form of this weight version, quantized once per version."""
        key = (w._version, w.data_ptr())
        if self._cache is None or self._cache[0] != key:
            with torch.no_grad():
                self._cache, self._deq = (key, quantize_weight(w, self.quant)), None
        return self._cache[1]


def _stream_in_compute_dtype(module: nn.Module, args: Any, out: Tensor) -> Tensor:
    """Forward hook on a quantized model's embedding: under autocast, the residual stream in the
    autocast dtype, as the engine's is (its weights' dtype). A float32 stream (the trainer's
    float32 embedding) rounds differently at every residual add and norm, and each FP8
    activation quantizer turns such differences into whole FP8 steps."""
    dev = out.device.type
    if out.dtype == torch.float32 and torch.is_autocast_enabled(dev):
        return out.to(torch.get_autocast_dtype(dev))
    return out


def apply_quantization(model: nn.Module, spec: QuantSpec | None) -> int:
    """Quantize the targeted linear layers' forward in place; returns how many. ``None``: no-op.
    Under autocast the model's residual stream then runs in the autocast dtype, as the
    engine's does (``_stream_in_compute_dtype``): the trainer's forward is the engine's."""
    if spec is None:
        return 0
    n = 0
    for name, module in model.named_modules():
        if type(module) is nn.Linear and spec.targets_name(name):
            if spec.kind == "int4":
                _check_group(module.weight, spec.group_size)
            module.__class__ = QuantLinear
            module.quant = spec
            n += 1
    if n == 0:
        raise ValueError(f"--quantization/--rollout-quantization {spec.kind}: no layer of this model is a target"
                         + (" (a dense model: use --int4-targets all-linear)" if spec.kind == "int4" else ""))
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if embed is not None and spec_of(model) is None:
        embed.register_forward_hook(_stream_in_compute_dtype)
    model.quant_spec = spec
    return n


def spec_of(model: nn.Module) -> QuantSpec | None:
    return getattr(model, "quant_spec", None)


def check_device(spec: QuantSpec | None, device: torch.device | str) -> str | None:
    """Why ``spec`` cannot run on ``device`` (None if it can)."""
    device = torch.device(device)
    if spec is None or device.type != "cuda" or spec.kind != "fp8":
        return None
    if not torch.cuda.is_available():
        return None  # the device is not visible here; the engine checks again where it runs
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return (f"FP8 GEMMs need compute capability 8.9 or newer (Ada, Hopper); this GPU has {major}.{minor}: "
                f"use --quantization int4-qat or none")
    return None


@torch.no_grad()
def refresh(model: nn.Module, exact: dict[str, tuple[Tensor, Tensor]] | None = None) -> None:
    """Re-quantize every cached weight after a weight update, into the same buffers (a CUDA
    graph captured over them reads the new values; the engine calls it after each commit).
    ``exact`` (``WireDecoder.take_exact``): per ``X.weight``, the trainer's stored form, which
    that layer then serves as sent instead of a requantization of its parameter."""
    exact = exact or {}
    for name, module in model.named_modules():
        if not isinstance(module, QuantLinear):
            continue
        w, sent = module.weight, exact.get(f"{name}.weight")
        if module._cache is None and sent is None:
            continue
        new = tuple(t.to(w.device) for t in sent) if sent is not None else quantize_weight(w, module.quant)
        key = (w._version, w.data_ptr())
        if module._cache is None:
            module._cache, module._deq = (key, new), None
            continue
        for dst, src in zip(module._cache[1], new, strict=True):
            if dst.shape != src.shape or dst.dtype != src.dtype:
                raise ValueError(f"{name}: the update's stored form {tuple(src.shape)} {src.dtype} does not match "
                                 f"the layer's {tuple(dst.shape)} {dst.dtype}")
            dst.copy_(src)
        module._cache = (key, module._cache[1])
        if module._deq is not None:
            module._deq.copy_(dequantize_weight(*module._cache[1], module.quant, module._deq.dtype))
