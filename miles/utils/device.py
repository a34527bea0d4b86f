"""Host → device copies that do not stall the host."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor


def to_device(data: list | np.ndarray, dtype: torch.dtype, device: torch.device | str) -> Tensor:
    """A host list or array → device tensor without a blocking copy on CUDA (pinned
    staging): a plain ``torch.tensor(..., device="cuda")`` copies from pageable memory and
    waits for the GPU's queue, which costs a step loop its overlap of host and device work."""
    t = torch.from_numpy(data).to(dtype) if isinstance(data, np.ndarray) else torch.tensor(data, dtype=dtype)
    device = torch.device(device)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)
