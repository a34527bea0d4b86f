"""LoRA weight updates in the engine: adapters merged into the engine's own weights, in place.

A LoRA trainer ships ``<module>.lora_A.weight`` [r, in] and ``<module>.lora_B.weight`` [out, r]
with α/r already folded into B (``miles.trainers.lora.adapter_update``). ``WeightStager``
stages them like any tensor and, at the commit, ``merge`` adds ``B·A − B_prev·A_prev`` to
``<module>.weight`` in float32 and stores the result in the weight's own storage.

Merged rather than applied as ``x W^T + (x A^T) B^T`` in each linear: the engine keeps
exactly one copy of the base weights (no second base, no extra buffers beyond the previous
adapters, which are r·(in+out) numbers a module), its decode path is unchanged — the fused
q/k/v and gate/up GEMMs and captured CUDA graphs read the same storage, so a LoRA policy
decodes as fast as the base model — and an update touches only the targeted weights. The
cost: a bf16 engine re-rounds the targeted weights at every update (one rounding of
``W + ΔW`` each time, not an accumulating float32 sum), which the trainer's
rollout-vs-train log-prob mismatch metrics see like any other bf16 rounding.
"""

from __future__ import annotations

import torch
from torch import Tensor

SUFFIXES = (".lora_A.weight", ".lora_B.weight")


def split(name: str) -> tuple[str, str] | None:
    """(``<module>.weight``, "A" or "B") for an adapter tensor's name, else None."""
    for suffix in SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)] + ".weight", suffix[6]
    return None


def check(name: str, shape: tuple[int, ...], params: dict[str, Tensor]) -> str | None:
    """Why an adapter tensor does not fit the model, or None."""
    base, which = split(name)  # type: ignore[misc]
    param = params.get(base)
    if param is None or param.ndim != 2:
        return f"weight update names {name!r}, but {base!r} is not a linear weight of this model"
    out_f, in_f = param.shape
    ok = len(shape) == 2 and (shape[1] == in_f if which == "A" else shape[0] == out_f)
    if not ok:
        want = f"[r, {in_f}]" if which == "A" else f"[{out_f}, r]"
        return f"weight update {name!r} has shape {tuple(shape)}, expected {want} for {base!r}"
    return None


class AdapterMerger:
    """Remembers the adapters merged so far, to replace them at the next update."""

    def __init__(self) -> None:
        self.merged: dict[str, tuple[Tensor, Tensor]] = {}  # "<module>.weight" -> (A, B), float32

    @property
    def num_modules(self) -> int:
        return len(self.merged)

    @torch.no_grad()
    def merge(self, staged: dict[str, Tensor], params: dict[str, Tensor]) -> int:
        """Merge the staged adapter tensors into ``params``; returns how many weights changed."""
        new: dict[str, dict[str, Tensor]] = {}
        for name, t in staged.items():
            base, which = split(name)  # type: ignore[misc]
            new.setdefault(base, {})[which] = t.float()
        for base, parts in new.items():
            prev = self.merged.get(base)
            a = parts.get("A", prev[0] if prev else None)
            b = parts.get("B", prev[1] if prev else None)
            if a is None or b is None or a.shape[0] != b.shape[1]:
                raise ValueError(f"a LoRA update of {base!r} needs lora_A and lora_B of one rank")
        for base, parts in new.items():
            param, prev = params[base], self.merged.get(base)
            a = parts.get("A", prev[0] if prev else None)
            b = parts.get("B", prev[1] if prev else None)
            w = param.float()
            w.addmm_(b.to(w.device), a.to(w.device))
            if prev is not None:
                w.addmm_(prev[1].to(w.device), prev[0].to(w.device), alpha=-1.0)
            param.copy_(w)  # in place: fused views and CUDA graphs keep this storage
            self.merged[base] = (a, b)
        return len(new)
