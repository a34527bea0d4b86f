"""Per-request state of the embedded engine and its stop rules.

A request's context is ``input_ids + output_ids``. Once running, the K/V of all context
tokens but the last sit in its cache slot (``kv_len``); the last sampled token is the next
decode input. Stop rules, checked after every sampled token in this order: non-finite
logits (error), a stop token id / EOS (unless ``ignore_eos``), a stop string in the decoded
tail of the response, ``max_new_tokens`` (counted from the original prompt, so a resume
with ``num_prefix_tokens`` gets the remainder), the context length.

``routed_experts[i]`` is the routing of the forward step that *produced* response token i
(the position just before it), i.e. the rows the trainer's forward uses to score token i.
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch
from torch import Tensor

from miles.types import FinishReason, GenerateOutput, GenerateRequest


class Request:
    def __init__(self, req: GenerateRequest, loop: asyncio.AbstractEventLoop | None,
                 future: asyncio.Future | None) -> None:
        self.req = req
        self.loop, self.future = loop, future
        self.sampling = req.sampling
        self.context: list[int] = list(req.input_ids)
        self.output_ids: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        # Oldest policy version among the K/V entries in the slot (-1 before the first
        # prefill): a kept cache across an in-place update holds the older version's entries.
        self.kv_version = -1
        self.kv_versions: list[int] = []  # kv_version when each output token was sampled
        self.routed: list[list[list[int]]] | None = [] if req.return_routed_experts else None
        self.hidden: list[Tensor] | None = [] if req.return_hidden_states else None
        self.budget = req.sampling.max_new_tokens - req.num_prefix_tokens
        self.slot: int = -1
        self.kv_len = 0  # context tokens whose K/V are in the slot
        self.issued = 0  # tokens sampled so far, including one still on the device
        self.needs_prefill = True
        self.draft_len = 0  # entries in the draft's cache (speculative decoding; spec/drafters.py)
        self.spec_rounds = 0  # verify steps this request took part in
        self.spec_accepted = 0  # draft tokens accepted over them
        self.aborted = False
        self.finish: FinishReason | None = None
        self.matched_stop: int | str | None = None
        self.error: str | None = None

    @property
    def rid(self) -> str:
        return self.req.rid

    @property
    def response_position(self) -> int:
        """Index of the next response token (seeded sampling's counter)."""
        return self.req.num_prefix_tokens + len(self.output_ids)

    def append(self, token: int, logprob: float, version: int, *, eos_ids: frozenset[int],
               max_seq_len: int, tokenizer: Any) -> None:
        self.output_ids.append(token)
        self.logprobs.append(logprob)
        self.versions.append(version)
        self.kv_versions.append(version if self.kv_version < 0 else min(self.kv_version, version))
        self.context.append(token)
        sp = self.sampling
        if token in sp.stop_token_ids or (not sp.ignore_eos and token in eos_ids):
            self.finish, self.matched_stop = "stop", token
        elif sp.stop and tokenizer is not None and (hit := self._stop_string(tokenizer)):
            self.finish, self.matched_stop = "stop", hit
        elif len(self.output_ids) >= self.budget or len(self.context) >= max_seq_len:
            self.finish = "length"

    def _stop_string(self, tokenizer: Any) -> str | None:
        # The request stops at the first match, so any match in the decoded tail is new.
        longest = max(len(s) for s in self.sampling.stop)
        tail = tokenizer.decode(self.output_ids[-(2 * longest + 4):])
        return next((s for s in self.sampling.stop if s and s in tail), None)

    def fail(self, message: str) -> None:
        self.finish, self.error = "error", message

    def output(self) -> GenerateOutput:
        finish: FinishReason = self.finish or "abort"  # unfinished at hand-over = aborted
        return GenerateOutput(
            rid=self.rid,
            output_ids=list(self.output_ids),
            logprobs=list(self.logprobs),
            versions=list(self.versions),
            kv_versions=list(self.kv_versions),
            finish_reason=finish,
            matched_stop=self.matched_stop,
            error=self.error,
            routed_experts=self.routed,
            spec_verify_count=self.spec_rounds,
            spec_accepted_tokens=self.spec_accepted,
        )

    def hidden_states(self) -> Tensor | None:
        if not self.hidden:
            return None
        rows = torch.cat([h.reshape(-1, h.shape[-1]) for h in self.hidden])
        # A launch-ahead step may have run once more after the last token: drop its row.
        return rows[: len(self.context) - 1].float().cpu()

    def resolve(self) -> None:
        """Hand the output to the awaiting coroutine (called from the stepping thread)."""
        if self.loop is None or self.future is None:
            return
        out = self.output()

        def _set() -> None:
            if not self.future.done():
                self.future.set_result(out)

        try:
            self.loop.call_soon_threadsafe(_set)
        except RuntimeError:  # the caller's loop is closed: nobody is waiting any more
            pass
