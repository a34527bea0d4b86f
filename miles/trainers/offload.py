"""``--offload-train``: the trainer's AdamW state lives in pinned host memory between steps.

Colocated, the engines generate while the trainer waits, and on the GPU the trainer's
optimizer state is the largest thing it holds (two float32 moments: 8 bytes a trainable
parameter, 64 GB for an 8B model). ``EmbeddedTrainer.train_step`` calls ``reload`` before
its first optimizer step and ``offload`` after its last, so the moments are on the GPU only
while the trainer runs; gradients are already freed after each step (``zero_grad(set_to_none)``).

The host copies are pinned buffers allocated once and reused, so a move is one
device-to-host (or host-to-device) copy per tensor and nothing is allocated per step; the
values round-trip bit for bit (a copy, no cast). After the moments leave, the caching
allocator's free blocks (theirs, and the step's activations) go back to the device, where a
colocated engine in another process can take them. Seconds spent moving are reported as
``mem/offload_train_s``.
"""

from __future__ import annotations

import time

import torch
from torch import Tensor


class OptimizerOffloader:
    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
        self.optimizer, self.device = optimizer, torch.device(device)
        self.host: dict[tuple[int, str], Tensor] = {}  # (param id, state key) -> pinned host buffer
        self.offloaded = False
        self.seconds = 0.0  # time spent moving, over the run

    def _tensors(self):
        for p, state in self.optimizer.state.items():
            for key, t in state.items():
                if isinstance(t, Tensor) and t.numel() > 1:  # moments; AdamW's scalar step stays
                    yield id(p), key, state, t

    @torch.no_grad()
    def offload(self) -> None:
        if self.offloaded:
            return
        start = time.perf_counter()
        pin = self.device.type == "cuda"
        for pid, key, state, t in self._tensors():
            buf = self.host.get((pid, key))
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                buf = self.host[(pid, key)] = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
            buf.copy_(t, non_blocking=pin)
            state[key] = buf
        if pin:
            torch.cuda.synchronize(self.device)  # the buffers hold the values before the GPU copies go
            torch.cuda.empty_cache()  # the moments' and the step's freed blocks go back to the engines' process
        self.offloaded = True
        self.seconds += time.perf_counter() - start

    @torch.no_grad()
    def reload(self) -> None:
        if not self.offloaded:
            return
        start = time.perf_counter()
        pin = self.device.type == "cuda"
        for _, key, state, t in self._tensors():
            state[key] = t.to(self.device, non_blocking=pin, copy=True)
        if pin:
            torch.cuda.synchronize(self.device)
        self.offloaded = False
        self.seconds += time.perf_counter() - start

    def host_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.host.values())
