"""CUDA graphs for verify steps (T tokens per row), keyed by (batch bucket, context bucket, T).

The same scheme as ``miles.engines.runner.DecodeGraphs``: static input buffers (tokens
[cap, T_max], start positions [cap]) and static outputs (logits [cap, T_max, V], hidden
[cap, T_max, H]), padding rows on free slots starting at position 0, one shared memory
pool, lazy capture, and a fallback to eager verify (loudly) if a capture fails. Only the
policy's verify forward (logits at every position) goes through here; a draft's catch-up
(logits at one position per row) stays eager.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import Tensor

from miles.engines.runner import _BATCH_BUCKETS, StepOut

log = logging.getLogger(__name__)


class VerifyGraphs:
    def __init__(self, runner: Any, max_tokens: int) -> None:
        self.runner = runner
        cap = runner.config.max_batch_size
        self.buckets = [b for b in _BATCH_BUCKETS if b < cap] + [cap]
        dev, cfg = runner.device, runner.model.config
        self.tokens = torch.zeros(cap, max_tokens, dtype=torch.long, device=dev)
        self.starts = torch.zeros(cap, dtype=torch.long, device=dev)
        self.logits = torch.zeros(cap, max_tokens, cfg.vocab_size, dtype=torch.float32, device=dev)
        self.hidden = torch.zeros(cap, max_tokens, cfg.hidden_size, dtype=runner.dtype, device=dev)
        self.graphs: dict[tuple[int, int, int], Any] = {}
        self.pool: Any = None
        self.failed = False

    def _step(self, nb: int, L: int, T: int) -> None:
        out = self.runner.verify_eager(self.tokens[:nb, :T], self.starts[:nb], L)
        self.logits[:nb, :T].copy_(out.logits)
        self.hidden[:nb, :T].copy_(out.hidden)

    def run(self, tokens: Tensor, starts: list[int], L: int) -> StepOut | None:
        if self.failed:
            return None
        n, T = tokens.shape
        nb = next(b for b in self.buckets if b >= n)
        self.tokens[:n, :T].copy_(tokens)
        self.tokens[n:nb, :T].zero_()
        self.starts[:nb].copy_(self.runner._tensor(starts + [0] * (nb - n)))
        graph = self.graphs.get((nb, L, T))
        if graph is None:
            try:
                graph = self._capture(nb, L, T)
            except Exception as exc:  # an optimisation: fall back, loudly
                log.warning("verify CUDA graph capture failed (%s); verifying eagerly from now on", exc)
                self.failed = True
                return None
        graph.replay()
        return StepOut(self.logits[:n, :T], self.hidden[:n, :T], None)

    def _capture(self, nb: int, L: int, T: int) -> Any:
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._step(nb, L, T)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            self._step(nb, L, T)
        self.graphs[(nb, L, T)] = graph
        return graph
