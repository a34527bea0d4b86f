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

The stepper then appends the tokens with the policy's log-probs and the current policy
version, applies stop rules token by token, and reports the round to the controller.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from miles.engines.requests import Request
from miles.engines.runner import ModelRunner
from miles.engines.sampling import to_device
from miles.engines.spec.config import SpeculativeConfig
from miles.engines.spec.controller import SpecController
from miles.engines.spec.drafters import CAPACITY, Drafter
from miles.engines.spec.sampling import RoundParams, verify


@dataclass
class RoundResult:
    tokens: list[list[float]]  # [n][k + 1]
    logprobs: list[list[float]]
    accepted: list[int]
    finite: list[bool]
    hidden: Tensor  # [n, k + 1, H] device (a view that the next verify may overwrite)
    routing: list | None  # [n][k + 1][L_moe][top_k] when some row records routing


class SpecDecoder:
    def __init__(self, runner: ModelRunner, drafter: Drafter, cfg: SpeculativeConfig) -> None:
        self.runner, self.drafter, self.cfg = runner, drafter, cfg
        self.mode = cfg.speculative_sampling
        self.controller = SpecController(cfg)
        self.device = runner.device

    def plan(self, batch: int) -> int:
        return self.controller.choose(batch)

    def needs_flush(self, reqs: list[Request]) -> bool:
        return any(self.drafter.pending(r) >= CAPACITY - 1 for r in reqs)

    def run(self, reqs: list[Request], k: int, generator: torch.Generator | None) -> RoundResult:
        rp = RoundParams.build([r.sampling for r in reqs], [r.response_position for r in reqs], self.device)
        prop = self.drafter.propose(reqs, k, rp, self.mode, generator)
        last = to_device([r.context[-1] for r in reqs], torch.long, self.device)
        inputs = torch.cat([last[:, None], prop.tokens], dim=1)
        out = self.runner.verify(inputs, [r.kv_len for r in reqs])
        v = verify(out.logits, prop.tokens, prop.logq, rp, self.mode, noise=prop.noise, generator=generator)
        if self.drafter.needs_hidden:
            self.drafter.after_verify(reqs, out.hidden)
        T = k + 1
        packed = torch.cat([v.tokens.double(), v.logprobs.double(), v.accepted[:, None].double(),
                            v.finite[:, None].double()], dim=1)
        routing = out.routing if out.routing is not None and any(r.routed is not None for r in reqs) else None
        host = packed.cpu().tolist()
        return RoundResult(
            tokens=[row[:T] for row in host],
            logprobs=[row[T : 2 * T] for row in host],
            accepted=[int(row[2 * T]) for row in host],
            finite=[bool(row[2 * T + 1]) for row in host],
            hidden=out.hidden,
            routing=routing.cpu().tolist() if routing is not None else None,
        )
