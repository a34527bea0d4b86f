"""Staged weight updates: tensors land in a staging area while decoding goes on; a commit
copies them into the parameters between two decode steps (the only pause), all or nothing.

``stage`` checks every tensor of a call (known HF name, shape) before keeping any of them,
so a bad bucket leaves the staging area as it was. A tensor is either copied to the engine's
device and dtype (on CUDA on a side stream, so the copy overlaps decoding) — then its values
are checked for non-finite numbers right away — or, with ``borrow=True`` when it already has
the parameter's device and dtype, kept by reference: the transport's receive buffer *is* the
staging area (an NCCL receive buffer, a mapped CUDA IPC buffer of the trainer, a zero-copy
object-store view on the CPU), so no byte is copied or read twice. Borrowed tensors are
checked at the commit, in the same pass that would otherwise be a separate read (one
multi-tensor norm per dtype, read back once; a non-finite norm is confirmed element-wise
to name the tensor): a bad update is refused before any parameter changes and its version
never flips. ``stage`` returns once its work on the device is done, so the caller may reuse
or release what it passed (borrowed tensors excepted: they stay referenced until the commit).

``apply`` (the stepping thread, between steps) copies every staged tensor into its parameter
with one multi-tensor copy per dtype and — on CUDA — waits for it, so the pause it causes is
what it measures. The parameters are updated in place (same storage), which keeps CUDA
graphs valid. Staging holds at most one tensor per parameter (a re-staged name replaces the
older one).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from miles.engines import lora


class WeightError(ValueError):
    """A staged tensor does not fit the engine's model; the message names it."""


class WeightStager:
    def __init__(self, model: nn.Module | Mapping[str, Tensor], device: torch.device, dtype: torch.dtype, *,
                 shared: frozenset[str] = frozenset()) -> None:
        """``shared``: parameters that are a colocated trainer's frozen base (``miles.engines.shared``):
        never written; LoRA updates then stay unmerged (``lora.UnmergedAdapters``)."""
        params = model.state_dict(keep_vars=True) if isinstance(model, nn.Module) else model
        self.params: dict[str, Tensor] = dict(params)
        self.device, self.dtype = torch.device(device), dtype
        self.staged: dict[str, Tensor] = {}
        self.unchecked: set[str] = set()  # borrowed, so not yet checked for non-finite values
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.shared = shared
        # LoRA updates: merged into the weights, or kept apart over a shared base (miles.engines.lora)
        self.adapters: lora.AdapterMerger | lora.UnmergedAdapters = (
            lora.UnmergedAdapters(model, self.device, dtype) if shared else lora.AdapterMerger(self.params))

    def stage(self, named_tensors: Any, *, borrow: bool = False) -> int:
        items = [(name, t if isinstance(t, Tensor) else torch.as_tensor(t)) for name, t in named_tensors]
        for name, t in items:
            if lora.split(name) is not None:
                problem = lora.check(name, tuple(t.shape), self.params) or self.adapters.problem(name)
                if problem:
                    raise WeightError(problem)
                continue
            param = self.params.get(name)
            if param is None:
                raise WeightError(f"weight update names {name!r}, which is not a parameter of this model")
            if name in self.shared:
                raise WeightError(f"weight update names {name!r}, which this engine serves from the colocated "
                                  f"trainer's frozen base (shared, read-only): updates carry the adapters alone")
            if tuple(t.shape) != tuple(param.shape):
                raise WeightError(f"weight update {name!r} has shape {tuple(t.shape)}, "
                                  f"the model's is {tuple(param.shape)}")
        if not items:
            return 0
        if self.stream is None:
            incoming = [(name, self._take(name, t, borrow)) for name, t in items]
            bad = nonfinite([(n, t) for (n, t), (_, src) in zip(incoming, items) if t is not src])
        else:
            incoming, bad = self._stage_cuda(items, borrow)
        if bad:
            raise WeightError(f"weight update {bad[0]!r} holds non-finite values")
        for (name, t), (_, src) in zip(incoming, items):
            if t is src:
                self.unchecked.add(name)
            else:
                self.unchecked.discard(name)
            self.staged[name] = t
        return len(items)

    def _take(self, name: str, t: Tensor, borrow: bool) -> Tensor:
        adapter = lora.split(name)
        if adapter is not None:  # kept in float32: the merge sums in float32
            return t.to(self.params[adapter[0]].device, torch.float32, copy=True)
        param = self.params[name]
        if borrow and t.device == param.device and t.dtype == param.dtype:
            return t
        return t.to(param.device, param.dtype, non_blocking=t.device.type == "cuda", copy=True)

    def _stage_cuda(self, items: list[tuple[str, Tensor]], borrow: bool) -> tuple[list[tuple[str, Tensor]], list[str]]:
        # Order after whatever produced the inputs on the caller's stream (an NCCL receive,
        # an IPC event wait); host inputs need no ordering.
        if any(t.is_cuda for _, t in items):
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            incoming = [(name, self._take(name, t, borrow)) for name, t in items]
            bad = nonfinite([(n, t) for (n, t), (_, src) in zip(incoming, items) if t is not src])
        self.stream.synchronize()  # done on the device: the caller may release its inputs
        return incoming, bad

    @property
    def num_staged(self) -> int:
        return len(self.staged)

    @property
    def staged_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.staged.values())

    def clear(self) -> None:
        self.staged.clear()
        self.unchecked.clear()

    @torch.no_grad()
    def apply(self) -> int:
        """Copy every staged tensor into its parameter (stepping thread, between steps)."""
        staged, self.staged = self.staged, {}
        unchecked, self.unchecked = self.unchecked, set()
        if not staged:
            return 0
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
        bad = nonfinite([(n, staged[n]) for n in unchecked if n in staged])
        if bad:  # refused before any parameter changes
            raise WeightError(f"weight update {bad[0]!r} holds non-finite values")
        adapters = {n: t for n, t in staged.items() if lora.split(n) is not None}
        if adapters:
            try:
                self.adapters.apply(adapters)
            except ValueError as exc:
                raise WeightError(str(exc)) from None
            staged = {n: t for n, t in staged.items() if n not in adapters}
        groups: dict[tuple[torch.dtype, torch.device], tuple[list[Tensor], list[Tensor]]] = {}
        for name, t in staged.items():
            param = self.params[name]
            dst, src = groups.setdefault((param.dtype, param.device), ([], []))
            dst.append(param)
            src.append(t)
        for dst, src in groups.values():
            torch._foreach_copy_(dst, src)
        if self.stream is not None and (groups or adapters):
            # Borrowed tensors are freed (or unmapped) once ``staged`` goes; the copies that
            # read them must be done by then — and the wait is the pause the swap costs.
            torch.cuda.current_stream(self.device).synchronize()
        return len(staged) + len(adapters)


def nonfinite(items: list[tuple[str, Tensor]]) -> list[str]:
    """Names of the floating tensors holding a NaN or an infinity: one multi-tensor 2-norm
    per (device, dtype) and one read-back; a non-finite norm (a bad value, or — never for
    weights — an overflow) is then confirmed element by element."""
    groups: dict[tuple[torch.device, torch.dtype], list[tuple[str, Tensor]]] = {}
    for name, t in items:
        if t.is_floating_point() and t.numel():
            groups.setdefault((t.device, t.dtype), []).append((name, t))
    bad = []
    for group in groups.values():
        norms = torch._foreach_norm([t for _, t in group], 2, dtype=torch.float32)
        ok = torch.stack(norms).isfinite().tolist()
        bad += [name for (name, t), good in zip(group, ok) if not good and not bool(torch.isfinite(t).all())]
    return bad
