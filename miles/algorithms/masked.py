"""Masked reductions shared by the estimators, corrections and losses.

All take a value tensor and a same-shaped 0/1 (or bool) mask; masked-out entries never
contribute, even when they hold NaN or Inf (they are replaced with ``torch.where`` before any
arithmetic, so their gradient is exactly zero too). Empty masks give 0, never NaN.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch
from torch import Tensor

_FINITE_CHECKS = contextvars.ContextVar("miles_finite_checks", default=True)


@contextlib.contextmanager
def deferred_finite_checks() -> Iterator[None]:
    """Within it, the losses and corrections skip their own "non-finite value on a loss
    token" checks (each one a device read that makes the host wait for the GPU). For a
    caller that checks finiteness itself once per step, on the device, as the embedded
    trainer does: a non-finite micro-batch then skips the optimizer step instead of raising."""
    token = _FINITE_CHECKS.set(False)
    try:
        yield
    finally:
        _FINITE_CHECKS.reset(token)


def finite_checks() -> bool:
    """False inside ``deferred_finite_checks``."""
    return _FINITE_CHECKS.get()


def as_bool(mask: Tensor) -> Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


def zero_masked(values: Tensor, mask: Tensor, fill: float = 0.0) -> Tensor:
    """``values`` where ``mask`` else ``fill`` (gradient-safe for non-finite masked values)."""
    return torch.where(as_bool(mask), values, torch.full_like(values, fill))


def masked_sum(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    v = zero_masked(values, mask)
    return v.sum() if dim is None else v.sum(dim)


def masked_mean(values: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    m = as_bool(mask)
    count = m.sum() if dim is None else m.sum(dim)
    return masked_sum(values, m, dim) / count.clamp(min=1).to(values.dtype)


def masked_max(values: Tensor, mask: Tensor) -> Tensor:
    """Max over masked entries; 0 when the mask is empty."""
    m = as_bool(mask)
    if values.numel() == 0:
        return values.new_zeros(())
    lowest = torch.finfo(values.dtype).min
    out = torch.where(m, values, torch.full_like(values, lowest)).max()
    return torch.where(m.any(), out, values.new_zeros(()))


def masked_var(values: Tensor, mask: Tensor) -> Tensor:
    """Population variance over masked entries (0 when fewer than two)."""
    mean = masked_mean(values, mask)
    return masked_mean((zero_masked(values, mask) - mean) ** 2, mask)


def masked_whiten(values: Tensor, mask: Tensor, eps: float = 1e-6) -> Tensor:
    """(x - mean) / (std + eps) over the masked entries; masked-out entries become 0."""
    mean = masked_mean(values, mask)
    std = masked_var(values, mask).sqrt()
    return zero_masked((values - mean) / (std + eps), mask)
