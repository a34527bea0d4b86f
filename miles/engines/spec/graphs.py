"""CUDA graphs for verify steps (T tokens per row), keyed by (batch bucket, context bucket, T).

The same scheme as ``miles.engines.runner.DecodeGraphs``: static input buffers (tokens
[cap, T_max], start positions [cap]) and static outputs (logits [cap, T_max, V], hidden
[cap, T_max, H]), padding rows on free slots starting at position 0, one shared memory
pool, lazy capture, and a fallback to eager verify (loudly) if a capture fails (all of
``miles.engines.runner.GraphCache``). Only the
policy's verify forward (logits at every position) goes through here; a draft's catch-up
(logits at one position per row) stays eager.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from miles.engines.runner import GraphCache, StepOut, batch_buckets



class VerifyGraphs(GraphCache):
    fallback = "verifying eagerly"

    def __init__(self, runner: Any, max_tokens: int) -> None:
        super().__init__()
        self.runner = runner
        cap = runner.config.max_batch_size
        self.buckets = batch_buckets(cap)
        dev, cfg = runner.device, runner.model.config
        self.tokens = torch.zeros(cap, max_tokens, dtype=torch.long, device=dev)
        self.starts = torch.zeros(cap, dtype=torch.long, device=dev)
        self.logits = torch.zeros(cap, max_tokens, cfg.vocab_size, dtype=torch.float32, device=dev)
        self.hidden = torch.zeros(cap, max_tokens, cfg.hidden_size, dtype=runner.dtype, device=dev)

    def _step(self, nb: int, L: int, T: int) -> None:
        out = self.runner.verify_eager(self.tokens[:nb, :T], self.starts[:nb], L)
        self.logits[:nb, :T].copy_(out.logits)
        self.hidden[:nb, :T].copy_(out.hidden)

    def run(self, tokens: Tensor, starts: list[int] | Tensor, L: int) -> StepOut | None:
        if self.failed:
            return None
        n, T = tokens.shape
        nb = self.batch_bucket(n)
        self.tokens[:n, :T].copy_(tokens)
        self.tokens[n:nb, :T].zero_()
        if isinstance(starts, Tensor):
            self.starts[:n].copy_(starts)
            self.starts[n:nb].zero_()
        else:
            self.starts[:nb].copy_(self.runner._tensor(starts + [0] * (nb - n)))
        graph = self.graph((nb, L, T), lambda: self._step(nb, L, T))
        if graph is None:
            return None
        graph.replay()
        return StepOut(self.logits[:n, :T], self.hidden[:n, :T], None)


class RoundGraphs(GraphCache):
    """A whole speculative round (catch-up, k draft steps, verify, accept) as one CUDA graph,
    keyed by (batch bucket, context bucket, k, sampling flags).

    Static inputs: the round's ``RoundParams`` tensors and ``RoundIO`` — every row seeded or
    greedy, since a graph cannot draw from the engine's generator. The catch-up width is
    ``width`` = k_max + 2 for every k: a round leaves up to k_max + 1 entries pending, and one
    plain step (a probe) adds one, so a round after a longer round (the adaptive rule
    lowered k) or after a probe replays its graph with no feed first. With the width at
    k + 1, each of those rounds first fed the draft eagerly and waited for it (a
    synchronizing forward per switch).
    Static outputs: the packed results and the policy's hidden states. Padding rows are
    greedy rows on free slots at position 0. The drafter's ``after_verify`` runs after the
    replay (outside the graph), so the capture's warm-up runs are idempotent: they write
    the same K/V at the same positions as the replay that follows. Any capture failure
    disables round graphs (rounds then run eagerly, still replaying the verify graph).

    ``all_k`` (the adaptive rule's engines): the first round met in a (batch, context,
    sampling) bucket captures the graphs of every k = 1..k_max there, the other k first.
    The rule changes k as it measures, so with lazy captures its engine kept meeting new
    (bucket, k) pairs long after the warm-up, and captures fell inside its timed runs, where
    the always-on engine met none. The other k's warm-up
    runs write K/V past the round's own entries (within the cache's k_max + 2 headroom);
    those positions lie beyond every row's length, so they are never read before a later
    step overwrites them, and the round's own capture and replay come last.
    """

    fallback = "speculative rounds run eagerly"

    def __init__(self, decoder: Any, max_steps: int, *, all_k: bool = False) -> None:
        super().__init__()
        self.decoder = decoder
        self.max_steps, self.all_k = max_steps, all_k
        runner = decoder.runner
        cap = runner.config.max_batch_size
        self.buckets = batch_buckets(cap)
        dev, T = runner.device, max_steps + 1
        self.width = max_steps + 2  # catch-up entries per row, whatever the round's k
        self.f = torch.zeros(2, cap, dtype=torch.float32, device=dev)  # temperature, top_p
        self.i = torch.zeros(7 + 4, cap, dtype=torch.long, device=dev)  # top_k greedy seeded base last kv start | seeds
        self.cu = torch.zeros(cap, self.width, dtype=torch.long, device=dev)
        self.cu_last = torch.zeros(cap, dtype=torch.long, device=dev)
        self.packed = torch.zeros(cap, 2 * T + 2, dtype=torch.float64, device=dev)
        self.hidden = torch.zeros(cap, T, runner.model.config.hidden_size, dtype=runner.dtype, device=dev)

    def _views(self, nb: int, k: int, flags: tuple[bool, bool, bool]) -> tuple[Any, Any]:
        from miles.engines.spec.decoder import RoundIO
        from miles.engines.spec.sampling import RoundParams

        f, i = self.f[:, :nb], self.i[:, :nb]
        any_greedy, all_greedy, truncated = flags
        rp = RoundParams(temperature=f[0], top_p=f[1], top_k=i[0], greedy=i[1].bool(), seeded=i[2].bool(),
                         base=i[3], seeds=i[7:11], any_greedy=any_greedy, all_greedy=all_greedy, all_seeded=True,
                         truncated=truncated)
        io = RoundIO(last=i[4], kv=i[5], cu_tokens=self.cu[:nb], cu_start=i[6], cu_last=self.cu_last[:nb])
        return rp, io

    def _step(self, nb: int, L: int, k: int, flags: tuple[bool, bool, bool]) -> None:
        rp, io = self._views(nb, k, flags)
        packed, hidden, _ = self.decoder.core(rp, io, k, L, None, captured=True)
        self.packed[:nb, : packed.shape[1]].copy_(packed)
        self.hidden[:nb, : k + 1].copy_(hidden)

    def key(self, rp: Any, n: int, k: int, L: int) -> tuple:
        nb = self.batch_bucket(n)
        flags = (rp.any_greedy or nb > n, rp.all_greedy, rp.truncated)  # padding rows are greedy
        return nb, L, k, self.decoder.mode, flags

    def captured(self, rp: Any, n: int, k: int, L: int) -> bool:
        """Whether a round of this shape replays a graph already captured."""
        return self.key(rp, n, k, L) in self.graphs

    def run(self, rp: Any, io: Any, k: int, L: int) -> tuple[Tensor, Tensor, None] | None:
        if self.failed:
            return None
        n = io.last.shape[0]
        nb, _, _, mode, flags = self.key(rp, n, k, L)
        self.f[0, :n].copy_(rp.temperature)
        self.f[1, :n].copy_(rp.top_p)
        for row, src in enumerate((rp.top_k, rp.greedy, rp.seeded, rp.base, io.last, io.kv, io.cu_start)):
            self.i[row, :n].copy_(src)
        self.i[7:11, :n].copy_(rp.seeds)
        self.cu[:n].copy_(io.cu_tokens)
        self.cu_last[:n].copy_(io.cu_last)
        if nb > n:  # padding rows: greedy, at position 0 of free slots
            self.f[:, n:nb].fill_(1.0)
            self.i[:, n:nb].zero_()
            self.i[0, n:nb].fill_(-1)
            self.i[1, n:nb].fill_(1)
            self.cu[n:nb].zero_()
            self.cu_last[n:nb].zero_()
        if self.all_k and (nb, L, k, mode, flags) not in self.graphs:
            for other in range(1, self.max_steps + 1):
                if other != k and self.graph((nb, L, other, mode, flags),
                                             lambda o=other: self._step(nb, L, o, flags)) is None:
                    return None
        graph = self.graph((nb, L, k, mode, flags), lambda: self._step(nb, L, k, flags))
        if graph is None:
            return None
        graph.replay()
        return self.packed[:n, : 2 * k + 4], self.hidden[:n, : k + 1], None
