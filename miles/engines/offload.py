"""``--offload-rollout``: the engine gives its memory back while a colocated trainer runs.

Where rollout and training take turns on one GPU (``--colocate``), the driver asks every
engine to ``offload`` before a train step: the KV cache and, unless a weight update will not
refill them, the weights are released, and the caching allocator's free blocks go back to the
device (``torch.cuda.empty_cache``), so the trainer can use them. The next weight commit
re-allocates everything before it copies the new weights in; the engine then generates again.

Released means the tensors' storages are resized to zero bytes (and later back), as FSDP2
frees its unsharded parameters: every tensor object stays — the fused q/k/v and gate/up
weights and their per-projection views, the cache's K and V — so nothing that holds them
has to be rebuilt. What does depend on the addresses is dropped: the captured CUDA graphs
(re-captured when next needed, ``engine/graph_captures`` counts them) and the CPU decode
kernel's pointer tables (rebuilt).

``weights``:

- ``"discard"``: the next update refills every weight (a full-parameter trainer's update);
  its commit checks that it does, or refuses.
- ``"host"``: a pinned host copy restores them (LoRA updates carry adapters only, and
  changed-only updates the changed tensors).
- ``"keep"``: the KV cache alone is released (a quantized engine always: its derived
  buffers stay). Speculative engines are refused (their verify graphs and drafter read the cache).

Seconds spent releasing and re-allocating are ``mem/offload_rollout_s``; the bytes released
last time ``mem/offload_rollout_bytes``.
"""

from __future__ import annotations

import time
from typing import Literal

import torch
from torch import Tensor

WeightsMode = Literal["discard", "host", "keep"]


def _storages(tensors: list[Tensor]) -> list[torch.UntypedStorage]:
    seen: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        s = t.untyped_storage()
        if s.nbytes():
            seen.setdefault(s.data_ptr(), s)
    return list(seen.values())


class EngineOffloader:
    def __init__(self, runner, params: dict[str, Tensor]) -> None:
        self.runner = runner
        self.params = params  # HF name -> the engine's tensor (the weight stager's map)
        self.released = False
        self.weights: WeightsMode = "keep"
        self.seconds = 0.0
        self.released_bytes = 0
        self._kv: list[tuple[torch.UntypedStorage, int]] = []
        self._weights: list[tuple[torch.UntypedStorage, int]] = []
        self._host: list[Tensor] = []  # pinned copies, by storage, allocated once
        self._aliases: list[set[str]] = []  # names sharing one tensor: an update must carry one of each

    def _kv_tensors(self) -> list[Tensor]:
        cache = self.runner.cache
        return [cache.k, cache.v]

    @torch.no_grad()
    def release(self, weights: WeightsMode) -> int:
        """Free the KV cache (and the weights); returns the bytes released."""
        if self.released:
            return 0
        start = time.perf_counter()
        self.drop_graphs()
        device = self.runner.device
        cuda = device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(device)
        self._kv = [(s, s.nbytes()) for s in _storages(self._kv_tensors())]
        self._weights = []
        if weights != "keep":
            self._weights = [(s, s.nbytes()) for s in _storages(list(self.params.values()))]
            groups: dict[tuple[int, int, tuple[int, ...]], set[str]] = {}
            for name, t in self.params.items():
                groups.setdefault((t.data_ptr(), t.numel(), tuple(t.shape)), set()).add(name)
            self._aliases = list(groups.values())
            if weights == "host":
                if len(self._host) != len(self._weights):
                    self._host = [torch.empty(n, dtype=torch.uint8, pin_memory=cuda) for _, n in self._weights]
                for (s, n), h in zip(self._weights, self._host):
                    h.copy_(torch.empty(0, dtype=torch.uint8, device=device).set_(s, 0, (n,), (1,)),
                            non_blocking=cuda)
                if cuda:
                    torch.cuda.synchronize(device)
        for s, _ in [*self._kv, *self._weights]:
            s.resize_(0)
        if cuda:
            torch.cuda.empty_cache()
        self.weights, self.released = weights, True
        self.released_bytes = sum(n for _, n in [*self._kv, *self._weights])
        self.seconds += time.perf_counter() - start
        return self.released_bytes

    def missing(self, staged: set[str]) -> list[str]:
        """Weights a commit after a ``"discard"`` release would leave unfilled."""
        if not self.released or self.weights != "discard":
            return []
        return [sorted(group)[0] for group in self._aliases if not group & staged]

    @torch.no_grad()
    def reacquire(self) -> None:
        """Allocate everything again (before a commit copies the weights in)."""
        if not self.released:
            return
        start = time.perf_counter()
        device = self.runner.device
        for s, n in [*self._kv, *self._weights]:
            s.resize_(n)
        for s, n in self._kv:  # a fresh cache, as at start (free slots must hold finite values)
            torch.empty(0, dtype=torch.uint8, device=device).set_(s, 0, (n,), (1,)).zero_()
        if self.weights == "host":
            cuda = device.type == "cuda"
            for (s, n), h in zip(self._weights, self._host):
                torch.empty(0, dtype=torch.uint8, device=device).set_(s, 0, (n,), (1,)).copy_(h, non_blocking=cuda)
            if cuda:
                torch.cuda.synchronize(device)
        if self.runner.cpu_kernel is not None:  # its tables hold the old addresses
            self.runner.cpu_kernel = type(self.runner.cpu_kernel)(self.runner.model, self.runner.cache,
                                                                 self.runner.config.max_batch_size)
        self.released = False
        self.seconds += time.perf_counter() - start

    def drop_graphs(self) -> None:
        """Forget the captured CUDA graphs (re-captured when next needed): after addresses or
        the tensors a step reads change."""
        for graphs in (self.runner.graphs, self.runner.prefill_graphs):
            if graphs is not None:
                graphs.graphs.clear()
                graphs.pool = None
