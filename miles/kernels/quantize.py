"""The quantizer's numerics: FP8 e4m3 block scales and INT4 symmetric groups, in torch.

``miles.models.quant`` (trainer, engine, weight sync, export) and the GEMMs in ``lowp.py``
share these functions, so the kernels package imports nothing from ``models``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
FP8_RECIP = 1.0 / FP8_MAX  # rounded to float32 where it multiplies a float32 tensor
INT4_MAX = 7
BLOCK = 128


# ---- FP8 -------------------------------------------------------------------------------------
def _blocks(t: Tensor, rows: int, cols: int) -> Tensor:
    """``t`` [R, C] zero-padded to whole blocks, viewed as [R/rows, rows, C/cols, cols]."""
    R, C = t.shape
    pr, pc = -R % rows, -C % cols
    if pr or pc:
        t = F.pad(t, (0, pc, 0, pr))
    return t.view(t.shape[0] // rows, rows, t.shape[1] // cols, cols)


def _expand(scale: Tensor, rows: int, cols: int, shape: torch.Size) -> Tensor:
    return scale.repeat_interleave(rows, 0).repeat_interleave(cols, 1)[: shape[0], : shape[1]]


def fp8_quantize_weight(w: Tensor) -> tuple[Tensor, Tensor]:
    """e4m3 values ``[N, K]`` and float32 scales ``[ceil(N/128), ceil(K/128)]``."""
    b = _blocks(w.detach().float(), BLOCK, BLOCK)
    scale = (b.abs().amax(dim=(1, 3)) / FP8_MAX).clamp_min(1e-12)
    q = (b / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    q = q.view(b.shape[0] * BLOCK, b.shape[2] * BLOCK)[: w.shape[0], : w.shape[1]].contiguous()
    return q, scale


def fp8_dequantize_weight(q: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    return (q.float() * _expand(scale, BLOCK, BLOCK, q.shape)).to(dtype)


def fp8_quantize_act(x: Tensor) -> tuple[Tensor, Tensor]:
    """e4m3 values of ``x`` [..., K] and float32 scales [..., ceil(K/128)] (1 × 128 groups)."""
    K = x.shape[-1]
    flat = x.detach().float().reshape(-1, K)
    g = _blocks(flat, 1, BLOCK)  # [M, 1, G, 128]
    # times the float32 reciprocal, not / 448: torch's CUDA division by a scalar is that
    # product and its CPU division is exact, so this one form is the same bits on both, and
    # lowp_triton.fp8_act_quant computes it too
    scale = (g.abs().amax(dim=3) * FP8_RECIP).clamp_min(1e-12)  # [M, 1, G]
    q = (g / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(flat.shape[0], -1)[:, :K]
    return q.reshape(x.shape), scale.view(*x.shape[:-1], -1)


def fp8_qdq_act(x: Tensor) -> Tensor:
    q, scale = fp8_quantize_act(x)
    s = scale.repeat_interleave(BLOCK, -1)[..., : x.shape[-1]]
    return (q.float() * s).to(x.dtype)


# ---- INT4 ------------------------------------------------------------------------------------
def _check_group(w: Tensor, group: int) -> None:
    if group <= 0 or w.shape[-1] % group:
        raise ValueError(f"--int4-group-size {group} does not divide the input dimension {w.shape[-1]}")


def int4_quantize(w: Tensor, group: int = 128) -> tuple[Tensor, Tensor]:
    """int8 values in [-7, 7] ``[N, K]`` and float32 scales ``[N, K / group]``."""
    _check_group(w, group)
    g = w.detach().float().reshape(w.shape[0], -1, group)
    scale = (g.abs().amax(-1) / INT4_MAX).clamp_min(1e-12)
    q = torch.round(g / scale[..., None]).clamp(-INT4_MAX, INT4_MAX).to(torch.int8)
    return q.view(w.shape), scale


def int4_dequantize(q: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    group = q.shape[-1] // scale.shape[-1]
    return (q.float().view(q.shape[0], -1, group) * scale[..., None]).view(q.shape).to(dtype)


def pack_int4(q: Tensor) -> Tensor:
    """Two INT4 values a byte: ``[N, K]`` int8 in [-8, 7] → ``[N, K/2]`` uint8."""
    if q.shape[-1] % 2:
        raise ValueError(f"packing INT4 needs an even input dimension, got {q.shape[-1]}")
    u = (q.to(torch.int16) + 8).to(torch.uint8)
    return (u[..., 0::2] | (u[..., 1::2] << 4)).contiguous()


def unpack_int4(packed: Tensor) -> Tensor:
    lo = (packed & 0x0F).to(torch.int8) - 8
    hi = (packed >> 4).to(torch.int8) - 8
    return torch.stack((lo, hi), dim=-1).view(*packed.shape[:-1], packed.shape[-1] * 2)
