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

An engine that serves a colocated trainer's frozen base (``miles.engines.shared``) must not
write into it, so it keeps the adapters apart instead (``UnmergedAdapters``) and its fused
step functions add ``B(A(x))`` after each base GEMM (``miles.models.fused.plus_lora``): one base
copy on the GPU for trainer and engine, a few small GEMMs a layer more.
"""

from __future__ import annotations

from typing import Any

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
    """Merges adapters into ``params`` (the engine's weights by name), remembering those merged
    so far, to replace them at the next update. ``UnmergedAdapters`` answers the same calls
    (``problem``, ``apply``) for an engine that must not write its weights."""

    layout_changed = False  # merging writes the weights in place: no new buffers for graphs to see

    def __init__(self, params: dict[str, Tensor]) -> None:
        self.params = params
        self.merged: dict[str, tuple[Tensor, Tensor]] = {}  # "<module>.weight" -> (A, B), float32

    @property
    def num_modules(self) -> int:
        return len(self.merged)

    def problem(self, name: str) -> str | None:
        """Why the adapter tensor ``name`` cannot be merged beyond ``check``'s reasons: none."""
        return None

    @torch.no_grad()
    def apply(self, staged: dict[str, Tensor]) -> int:
        """Merge the staged adapter tensors into the weights; returns how many weights changed."""
        params = self.params
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


# The engine's fused projection groups (``CausalLM.fuse_projections``), in ``lora_args`` order.
GROUPS = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("self_attn", ("o_proj",)),
          ("mlp", ("gate_proj", "up_proj")), ("mlp", ("down_proj",)))


class UnmergedAdapters:
    """Adapters kept beside the base weights, laid out as the fused GEMMs' outputs.

    For each layer and fused group (q/k/v, o, gate/up, down) that an update names: A stacked
    over the group's parts [G·r, in] and B block-diagonal [Σ out, G·r] (part j's B in rows of
    its output slice, columns j·r..), so ``B(A(x))`` is every part's delta, laid out as the fused
    output (``miles.models.fused.plus_lora``); a part without an adapter keeps zero blocks. The
    buffers are made at the first update that names a group (``layout_changed`` then tells the
    engine to drop captured graphs) and later updates copy into them in place, so graphs
    captured with them stay valid. Dense layers only (an engine over MoE layers merges)."""

    def __init__(self, model: Any, device: torch.device, dtype: torch.dtype) -> None:
        self.device, self.dtype = device, dtype
        self.layers = list(model.model.layers)
        self.rank: int | None = None
        self.layout_changed = False
        # "<module>.weight" -> (layer index, group index, part index, output row offset)
        self.where: dict[str, tuple[int, int, int, int]] = {}
        self.sizes: dict[tuple[int, int], tuple[int, list[int]]] = {}  # (layer, group) -> (in, outs)
        for i, layer in enumerate(self.layers):
            if getattr(layer, "is_moe", False):
                continue
            for g, (parent, leaves) in enumerate(GROUPS):
                mods = [getattr(getattr(layer, parent), leaf) for leaf in leaves]
                outs = [m.out_features for m in mods]
                self.sizes[(i, g)] = (mods[0].in_features, outs)
                off = 0
                for j, leaf in enumerate(leaves):
                    self.where[f"model.layers.{i}.{parent}.{leaf}.weight"] = (i, g, j, off)
                    off += outs[j]
        self.buffers: dict[tuple[int, int], tuple[Tensor, Tensor]] = {}
        self.names: set[str] = set()  # modules that got an adapter

    @property
    def num_modules(self) -> int:
        return len(self.names)

    def problem(self, name: str) -> str | None:
        """Why the adapter tensor ``name`` cannot be applied unmerged, or None."""
        base, _ = split(name)  # type: ignore[misc]
        if base not in self.where:
            return (f"weight update {name!r}: this engine serves a colocated trainer's base weights and applies "
                    f"adapters unmerged, which it does for the dense q/k/v/o/gate/up/down projections only")
        return None

    @torch.no_grad()
    def apply(self, staged: dict[str, Tensor]) -> int:
        """Copy the staged adapters into their slots; returns how many modules changed."""
        ranks = {t.shape[0] if split(n)[1] == "A" else t.shape[1] for n, t in staged.items()}  # type: ignore[index]
        if self.rank is not None:
            ranks.add(self.rank)
        if len(ranks) > 1:
            raise ValueError(f"a LoRA update needs lora_A and lora_B of one rank (got {sorted(ranks)})")
        bad = next((p for p in map(self.problem, staged) if p), None)
        if bad:
            raise ValueError(bad)
        r = self.rank = ranks.pop()
        for name, t in staged.items():
            base, which = split(name)  # type: ignore[misc]
            i, g, j, off = self.where[base]
            key = (i, g)
            if key not in self.buffers:
                fan_in, outs = self.sizes[key]
                G = len(outs)
                a = torch.zeros(G * r, fan_in, device=self.device, dtype=self.dtype)
                b = torch.zeros(sum(outs), G * r, device=self.device, dtype=self.dtype)
                self.buffers[key] = (a, b)
                self.layout_changed = True
            a, b = self.buffers[key]
            if which == "A":
                a[j * r:(j + 1) * r].copy_(t)
            else:
                b[off:off + t.shape[0], j * r:(j + 1) * r].copy_(t)
            self.names.add(base)
        if self.layout_changed:
            for i, layer in enumerate(self.layers):
                if (i, 0) in self.sizes:
                    layer.lora_args = tuple(self.buffers.get((i, g)) for g in range(len(GROUPS)))
        return len({split(n)[0] for n in staged})  # type: ignore[index]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for ab in self.buffers.values() for t in ab)
