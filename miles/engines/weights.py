"""Staged weight updates: tensors land in a staging area while decoding goes on; a commit
copies them into the parameters between two decode steps (the only pause), all or nothing.

``stage`` validates every tensor of a call (known HF name, shape) before keeping any of
them, so a bad bucket leaves the staging area as it was. Tensors are copied to the
engine's device and dtype at staging time (on CUDA on a side stream, so the copy overlaps
decoding); ``apply`` first makes the stepping thread's stream wait for those copies. The
parameters are updated with ``copy_`` (same storage), which keeps CUDA graphs valid.
Staging holds at most one copy of each parameter (a re-staged name replaces the older one).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from miles.models.model import CausalLM


class WeightError(ValueError):
    """A staged tensor does not fit the engine's model; the message names it."""


class WeightStager:
    def __init__(self, model: CausalLM, device: torch.device, dtype: torch.dtype) -> None:
        self.params: dict[str, Tensor] = dict(model.state_dict(keep_vars=True))
        self.device, self.dtype = device, dtype
        self.staged: dict[str, Tensor] = {}
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def stage(self, named_tensors: Any) -> int:
        items = [(name, t if isinstance(t, Tensor) else torch.as_tensor(t)) for name, t in named_tensors]
        for name, t in items:
            param = self.params.get(name)
            if param is None:
                raise WeightError(f"weight update names {name!r}, which is not a parameter of this model")
            if tuple(t.shape) != tuple(param.shape):
                raise WeightError(f"weight update {name!r} has shape {tuple(t.shape)}, "
                                  f"the model's is {tuple(param.shape)}")
            if t.is_floating_point() and not torch.isfinite(t).all():
                raise WeightError(f"weight update {name!r} holds non-finite values")
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                for name, t in items:
                    self.staged[name] = t.to(self.device, self.dtype, non_blocking=True, copy=True)
        else:
            for name, t in items:
                self.staged[name] = t.to(self.device, self.dtype, copy=True)
        return len(items)

    @property
    def num_staged(self) -> int:
        return len(self.staged)

    def clear(self) -> None:
        self.staged.clear()

    @torch.no_grad()
    def apply(self) -> int:
        """Copy every staged tensor into its parameter (stepping thread, between steps)."""
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
        staged, self.staged = self.staged, {}
        for name, t in staged.items():
            self.params[name].copy_(t)
        return len(staged)
