"""SpecDecoder: one speculative round for the whole running batch, on the stepping thread.

A round (``Stepper`` calls ``run``, after ``drain``; requests are in slots 0..n-1):

1. the drafter catches up on each row's pending entries and proposes k tokens per row
   (``drafters.py``; draft draws per ``sampling.py``);
2. the policy verifies ``[last token, d_1..d_k]`` of every row in ONE forward against its
   KV cache (``ModelRunner.verify``: T = k + 1 queries per row, causal among themselves);
3. ``sampling.verify`` accepts a prefix of each row's drafts and adds the correction or
   bonus token — rows accept different numbers, which continuous batching absorbs: each
   row's ``kv_len`` advances by what it emitted, and the K/V of its rejected drafts stay
   past ``kv_len``, masked and later overwritten (no copy, no cache surgery);
4. one host read-back of (tokens, log-probs, accepted counts, finiteness).

Steps 1-3 are ``core``: a function of device tensors only (``RoundIO`` + ``RoundParams``),
with no host round trip. On CUDA, when every row is seeded (or greedy) and has at most
k + 1 pending draft entries, the whole core is replayed from a CUDA graph
(``graphs.RoundGraphs``); otherwise it runs eagerly (the policy's verify and the draft
LM's steps still replay their own graphs).

The stepper then appends the tokens with the policy's log-probs and the current policy
version, applies stop rules token by token, and reports the round to the controller.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor

from miles.engines.requests import Request
from miles.engines.runner import ModelRunner
from miles.utils.device import to_device
from miles.engines.spec.config import SpeculativeConfig
from miles.engines.spec.controller import SpecController
from miles.engines.spec.drafters import CAPACITY, Drafter
from miles.engines.spec.sampling import RoundParams, draft_noise, draft_pick, processed_logprobs, verify


@dataclass
class RoundIO:
    """A round's per-row inputs on the device."""

    last: Tensor  # [n] the last context token (the verify step's first input)
    kv: Tensor  # [n] the policy's kv_len (where that token goes)
    cu_tokens: Tensor  # [n, T] the drafter's pending entries, right-padded
    cu_start: Tensor  # [n] the draft's draft_len (where they go)
    cu_last: Tensor  # [n] index of each row's last real pending entry


@dataclass
class RoundResult:
    tokens: list[list[float]]  # [n][k + 1]
    logprobs: list[list[float]]
    accepted: list[int]
    finite: list[bool]
    hidden: Tensor  # [n, k + 1, H] device (a view that the next round may overwrite)
    routing: list | None  # [n][k + 1][L_moe][top_k] when some row records routing
    timed: bool = True  # False: an eager probe, whose time says nothing of the option's rate


def pack(tokens: Tensor, logprobs: Tensor, accepted: Tensor, finite: Tensor) -> Tensor:
    """[n, 2T + 2] float64: one device→host copy per round (token ids are exact in float64)."""
    return torch.cat([tokens.double(), logprobs.double(), accepted[:, None].double(), finite[:, None].double()], 1)


class SpecDecoder:
    def __init__(self, runner: ModelRunner, drafter: Drafter, cfg: SpeculativeConfig) -> None:
        self.runner, self.drafter, self.cfg = runner, drafter, cfg
        self.mode = cfg.speculative_sampling
        self.controller = SpecController(cfg)
        self.device = runner.device
        self.round_graphs = None  # graphs.RoundGraphs, set by the engine on CUDA
        self.graph_rounds = 0  # rounds that replayed (or captured) a round graph
        self.backlog_flushes = 0  # plain-step backlogs fed to the draft before a round
        self.eager_probes = 0  # probes run eagerly rather than capture a new shape's graphs
        self.flush_s = 0.0  # the last round's backlog feed, in seconds (not the round's cost)

    def plan(self, batch: int) -> int:
        return self.controller.choose(batch)

    def needs_flush(self, reqs: list[Request]) -> bool:
        return self.drafter.bounded_backlog and any(self.drafter.pending(r) >= CAPACITY - 1 for r in reqs)

    def context_bucket(self, reqs: list[Request], k: int) -> int:
        """The context every forward of the round passes to attention (policy and draft): the
        whole cache where both read only each row's own length (one round graph per batch
        bucket and k), else the longest context rounded up."""
        longest = max(r.kv_len for r in reqs) + k + 2
        if self.drafter.length_aware:
            return self.runner.read_length(longest)
        return self.runner.context_bucket(longest)

    def core(self, rp: RoundParams, io: RoundIO, k: int, L: int, generator: torch.Generator | None, *,
             captured: bool = False) -> tuple[Tensor, Tensor, Tensor | None]:
        """Draft k tokens per row, verify them in one policy forward, accept / correct.
        Returns (packed results [n, 2k + 4], the policy's hidden states [n, k + 1, H], MoE
        routing or None). ``captured``: running inside a round graph (no nested graphs)."""
        d = self.drafter
        logits, state = d.catch_up(io.cu_tokens, io.cu_start, io.cu_last, L)
        noise = draft_noise(rp, k, logits.shape[-1], self.mode, generator)
        tokens, logqs = [], []
        for j in range(k):
            if j:
                logits, state = d.step(tokens[-1], io.kv + (d.step_offset + j), state, L, graphs=not captured)
            logits = torch.where(torch.isfinite(logits), logits, 0.0)  # a broken draft stays a distribution
            logq = processed_logprobs(logits, rp)
            tokens.append(draft_pick(logq, None if noise is None else noise[j]))
            logqs.append(logq)
        draft = torch.stack(tokens, dim=1)
        inputs = torch.cat([io.last[:, None], draft], dim=1)
        if captured:
            out = self.runner.verify_eager(inputs, io.kv, L)
        else:
            out = self.runner.verify(inputs, io.kv, L=L)
        v = verify(out.logits, draft, torch.stack(logqs, dim=1), rp, self.mode, noise=noise, generator=generator)
        return pack(v.tokens, v.logprobs, v.accepted, v.finite), out.hidden, out.routing

    def run(self, reqs: list[Request], k: int, generator: torch.Generator | None, *,
            probe: bool = False) -> RoundResult:
        """One round of ``k`` drafts for ``reqs``. ``probe``: the adaptive rule only samples
        this option (it decodes otherwise): where its round graphs are not captured yet, the
        round runs eagerly, with no graph at all, and comes back untimed. Capturing a shape's
        graphs (every k at once) for one probe costs more than the probes save: at batch 64,
        where the rule decodes plainly, the captures would take a large share of a short run.
        A probe's acceptance still counts; its time would not be the
        option's (an eager round is several times slower than its graph)."""
        d, n, T = self.drafter, len(reqs), k + 1
        rp = RoundParams.build([r.sampling for r in reqs], [r.response_position for r in reqs], self.device)
        entries = [d.entries(r) for r in reqs]  # empty only for an EAGLE row with a 1-token prompt
        width = max(max(len(e) for e in entries), 1)
        graphs = self.round_graphs
        W = graphs.width if graphs is not None else T  # entries a round takes without a feed first
        self.flush_s = 0.0
        if width > W:
            # A plain stretch left more than W entries (the adaptive rule switched speculation
            # back on): feed them to the draft first, so that this round can replay its CUDA
            # graph instead of running the draft and the verify eagerly (several times slower
            # on a GPU).
            # Timed apart (``flush_s``, device work included): it is the cost of the switch,
            # not of a round, and counted in the round it made a probe look slower than
            # speculation is (the 1024-step backlog of an LM draft costs several rounds).
            start = time.perf_counter()
            d.flush(reqs)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.flush_s = time.perf_counter() - start
            entries = [d.entries(r) for r in reqs]
            width = max(max(len(e) for e in entries), 1)
            self.backlog_flushes += 1
        use_graph = graphs is not None and rp.all_seeded and width <= W
        L = self.context_bucket(reqs, max(k, W if use_graph else width))
        eager = use_graph and probe and not graphs.captured(rp, n, k, L)
        if eager:
            use_graph = False
            self.eager_probes += 1
            L = self.context_bucket(reqs, max(k, width))
        host = [[r.context[-1] for r in reqs], [r.kv_len for r in reqs], [r.draft_len for r in reqs],
                [max(len(e) - 1, 0) for e in entries]]
        cu = [e + [0] * ((W if use_graph else width) - len(e)) for e in entries]
        meta = to_device(host, torch.long, self.device)
        io = RoundIO(last=meta[0], kv=meta[1], cu_tokens=to_device(cu, torch.long, self.device),
                     cu_start=meta[2], cu_last=meta[3])
        result = graphs.run(rp, io, k, L) if use_graph else None
        self.graph_rounds += result is not None
        if result is None:  # eager: no graph for a probe (captured=True: no nested graphs either)
            result = self.core(rp, io, k, L, generator, captured=eager)
        packed, hidden, routing = result
        for r in reqs:
            d.commit(r)
        if d.needs_hidden:
            d.after_verify(n, hidden)
        routing = routing if routing is not None and any(r.routed is not None for r in reqs) else None
        rows = packed.cpu().tolist()
        return RoundResult(
            tokens=[row[:T] for row in rows],
            logprobs=[row[T : 2 * T] for row in rows],
            accepted=[int(row[2 * T]) for row in rows],
            finite=[bool(row[2 * T + 1]) for row in rows],
            hidden=hidden,
            routing=routing.cpu().tolist() if routing is not None else None,
            timed=not eager,
        )
