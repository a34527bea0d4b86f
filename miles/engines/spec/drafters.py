"""Drafters: the device side of a draft model inside the engine.

A drafter keeps its own KV cache, slot-aligned with the policy's (request i holds slot i in
both), and a per-request count ``Request.draft_len`` of the *entries* whose K/V are in it:

- ``LMDrafter`` (independent small LM): entry i is context token i;
- ``EagleDrafter`` (EAGLE head): entry i is ``(h_i, x_{i+1})`` — the policy's hidden state at
  position i and the next token — so it needs the policy's hidden states. They come from
  the policy's prefill, from each verify step (positions of the accepted tokens) and from
  plain decode steps, and wait in ``pending_hidden[slot]`` until the head consumes them.

Entries not yet in the draft cache are *pending*. A round (``propose``) first feeds every
pending entry in one multi-token forward (the catch-up: 1..k+1 entries after a round; more
after plain steps), whose last output predicts the first draft token, then runs k - 1
single-entry steps. Only the catch-up advances ``draft_len``: the entries of the draft
steps themselves sit past it and are simply overwritten next round (rejected or not), so a
rejection never needs undoing. Plain decode steps leave the draft behind; ``flush`` feeds
pending entries when a row has ``capacity`` of them, so the catch-up stays bounded.

After a policy weight update the draft's cache keeps K/V computed from older hidden states
(EAGLE), and after a draft update an EAGLE head keeps K/V of its older weights (recomputing
them would need the policy's hidden states of the whole context again); the independent
LM recomputes its whole cache lazily at the next catch-up (``weights_changed``). Stale
entries only affect how often drafts are accepted, never what the policy samples.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from miles.engines.config import EngineConfig
from miles.engines.kv_cache import DecodeAttention, KVCache, PrefillAttention, VerifyAttention
from miles.engines.requests import Request
from miles.engines.runner import ModelRunner
from miles.engines.sampling import to_device
from miles.engines.spec.config import MAX_STEPS
from miles.engines.spec.sampling import RoundParams, draft_pick, processed_logprobs
from miles.engines.weights import WeightStager
from miles.models.draft import EagleHead
from miles.models.fused import compile_fast_path
from miles.models.model import CausalLM

CAPACITY = 2 * MAX_STEPS  # most pending entries per row before a plain step flushes them


class Proposal:
    def __init__(self, tokens: Tensor, logq: Tensor, noise: list[Tensor] | None) -> None:
        self.tokens, self.logq, self.noise = tokens, logq, noise  # [n, k], [n, k, V], k × [n, V]


class Drafter:
    """What both drafters share: model placement, weights, version, the proposal loop."""

    kind = "base"
    needs_hidden = False

    def __init__(self, model: Any, config: EngineConfig, *, version: int = 0) -> None:
        self.config = config
        self.device, self.dtype = torch.device(config.device), config.torch_dtype()
        self.model = model.to(device=self.device, dtype=self.dtype).eval().requires_grad_(False)
        self.model.fuse_projections(compile_fast_path() if config.use_compile() else None)
        self.stager = WeightStager(self.model, self.device, self.dtype)
        self.version = version
        self.headroom = MAX_STEPS + 2

    # ---- per-row bookkeeping (subclasses) -------------------------------------------------
    def pending(self, r: Request) -> int:
        raise NotImplementedError

    def prefill(self, rows: list[Request], seqs: list[list[int]], hidden: Tensor | None) -> None:
        raise NotImplementedError

    def flush(self, rows: list[Request]) -> None:
        raise NotImplementedError

    def record(self, rows: list[Request], hidden: Tensor) -> None:
        """A plain decode step ran ``rows`` at their ``kv_len`` (called before it advances)."""

    def weights_changed(self, rows: list[Request]) -> None:
        """New draft weights were committed while ``rows`` are running."""

    def after_verify(self, rows: list[Request], hidden: Tensor) -> None:
        """The policy verified ``rows``; ``hidden`` [n, k + 1, H] at positions kv_len..kv_len+k."""

    def move_slot(self, src: int, dst: int, length: int) -> None:
        raise NotImplementedError

    def clear_slot(self, slot: int) -> None:
        raise NotImplementedError

    # ---- drafting ---------------------------------------------------------------------
    def catch_up(self, rows: list[Request]) -> tuple[Tensor, Any]:
        """Feed every row's pending entries; returns (logits [n, V] after the last, state)."""
        raise NotImplementedError

    def step(self, rows: list[Request], tokens: Tensor, j: int, state: Any) -> tuple[Tensor, Any]:
        """Draft step j >= 1: feed the previous draft token; returns (logits [n, V], state)."""
        raise NotImplementedError

    def propose(self, rows: list[Request], k: int, rp: RoundParams, mode: str,
                generator: torch.Generator | None) -> Proposal:
        logits, state = self.catch_up(rows)
        tokens, logqs, noise = [], [], []
        for j in range(k):
            if j:
                logits, state = self.step(rows, tokens[-1], j, state)
            logits = torch.where(torch.isfinite(logits), logits, 0.0)  # a broken draft stays a distribution
            logq = processed_logprobs(logits, rp)
            tok, g = draft_pick(logq, rp, j, mode, generator)
            tokens.append(tok)
            logqs.append(logq)
            if g is not None:
                noise.append(g)
        return Proposal(torch.stack(tokens, dim=1), torch.stack(logqs, dim=1), noise or None)

    def _pad(self, seqs: list[list[int]]) -> tuple[Tensor, Tensor]:
        m = max(len(s) for s in seqs)
        ids = to_device([s + [0] * (m - len(s)) for s in seqs], torch.long, self.device)
        last = to_device([max(len(s) - 1, 0) for s in seqs], torch.long, self.device)
        return ids, last


class LMDrafter(Drafter):
    """An independent small CausalLM: entry i = context token i."""

    kind = "draft"

    def __init__(self, model: CausalLM, config: EngineConfig, *, version: int = 0) -> None:
        super().__init__(model, config, version=version)
        self.runner = ModelRunner(self.model, config, headroom=self.headroom)

    def pending(self, r: Request) -> int:
        return r.kv_len + 1 - r.draft_len  # the pending last token counts (it may be in flight)

    def weights_changed(self, rows: list[Request]) -> None:
        for r in rows:  # the next flush or catch-up re-feeds the whole context
            r.draft_len = 0

    def prefill(self, rows: list[Request], seqs: list[list[int]], hidden: Tensor | None) -> None:
        self.runner.prefill([r.slot for r in rows], seqs, logits=False)
        for r, seq in zip(rows, seqs):
            r.draft_len = len(seq)

    def flush(self, rows: list[Request]) -> None:
        seqs = [r.context[r.draft_len : -1] or [0] for r in rows]  # [0]: a padding entry
        ids, _ = self._pad(seqs)
        self.runner.verify(ids, [r.draft_len for r in rows], logits=False)
        for r in rows:
            r.draft_len = len(r.context) - 1

    def catch_up(self, rows: list[Request]) -> tuple[Tensor, Any]:
        ids, last = self._pad([r.context[r.draft_len :] for r in rows])
        out = self.runner.verify(ids, [r.draft_len for r in rows], logits_index=last)
        for r in rows:
            r.draft_len = len(r.context)
        return out.logits, None

    def step(self, rows: list[Request], tokens: Tensor, j: int, state: Any) -> tuple[Tensor, Any]:
        out = self.runner.decode(tokens, [len(r.context) + j - 1 for r in rows])
        return out.logits, None

    def move_slot(self, src: int, dst: int, length: int) -> None:
        self.runner.cache.move_slot(src, dst, min(length + self.headroom, self.runner.cache.length))

    def clear_slot(self, slot: int) -> None:
        self.runner.cache.clear_slot(slot)


class EagleDrafter(Drafter):
    """An EAGLE head over the policy's hidden states: entry i = (h_i, x_{i+1})."""

    kind = "eagle"
    needs_hidden = True

    def __init__(self, model: EagleHead, policy: CausalLM, config: EngineConfig, *, version: int = 0) -> None:
        super().__init__(model, config, version=version)
        self.policy = policy  # borrowed: embed_tokens and lm_head (updated in place with the policy)
        self.cache = KVCache(model.config, config.max_batch_size, config.max_seq_len, self.device,
                             self.dtype, headroom=self.headroom)
        self.model.rotary.reserve(self.cache.length, self.device)
        self.pending_hidden = torch.zeros(config.max_batch_size, CAPACITY + MAX_STEPS + 1,
                                          model.config.hidden_size, device=self.device, dtype=self.dtype)
        self.block = config.block()

    def pending(self, r: Request) -> int:
        return r.kv_len - r.draft_len

    def _bucket(self, longest: int) -> int:
        return min(-(-longest // self.block) * self.block, self.cache.length)

    def _features(self, hidden: Tensor, ids: Tensor, positions: Tensor, backend: Any) -> Tensor:
        return self.model(hidden, ids, self.policy.model.embed_tokens, position_ids=positions, kv_cache=backend)

    def _logits(self, features: Tensor) -> Tensor:
        return self.policy.lm_head(features).float()

    def prefill(self, rows: list[Request], seqs: list[list[int]], hidden: Tensor | None) -> None:
        assert hidden is not None, "the EAGLE drafter needs the policy's prefill hidden states"
        n = len(rows)
        lens = [len(s) for s in seqs]
        idx = torch.arange(n, device=self.device)
        last = to_device([m - 1 for m in lens], torch.long, self.device)
        slots = to_device([r.slot for r in rows], torch.long, self.device)
        self.pending_hidden[slots, 0] = hidden[idx, last].to(self.dtype)
        T = max(lens) - 1
        if T > 0:
            ids = to_device([s[1:] + [0] * (T - len(s) + 1) for s in seqs], torch.long, self.device)
            pos = torch.arange(T, device=self.device).expand(n, T)
            self._features(hidden[:, :T], ids, pos, PrefillAttention(self.cache, slots))
        for r, m in zip(rows, lens):
            r.draft_len = m - 1

    def _feed(self, rows: list[Request], counts: list[int], *, want_logits: bool) -> Tensor | None:
        """Feed ``counts[i]`` pending entries of each row (padding the rest); logits after each
        row's last fed entry when ``want_logits``."""
        n, T = len(rows), max(max(counts), 1)
        seqs = [r.context[r.draft_len + 1 : r.draft_len + 1 + c] for r, c in zip(rows, counts)]
        ids = to_device([s + [0] * (T - len(s)) for s in seqs], torch.long, self.device)
        starts = to_device([r.draft_len for r in rows], torch.long, self.device)
        backend = VerifyAttention(self.cache, starts, T, self._bucket(max(r.draft_len for r in rows) + T),
                                  self.config.decode_attention)
        feats = self._features(self.pending_hidden[:n, :T], ids, backend.positions, backend)
        if not want_logits:
            return None
        last = to_device([max(c - 1, 0) for c in counts], torch.long, self.device)
        return feats[torch.arange(n, device=self.device), last]

    def flush(self, rows: list[Request]) -> None:
        counts = [max(self.pending(r) - 1, 0) for r in rows]
        if max(counts) == 0:
            return
        self._feed(rows, counts, want_logits=False)
        n = len(rows)
        keep = to_device(counts, torch.long, self.device)
        self.pending_hidden[:n, 0] = self.pending_hidden[torch.arange(n, device=self.device), keep]
        for r, c in zip(rows, counts):
            r.draft_len += c

    def record(self, rows: list[Request], hidden: Tensor) -> None:
        n = len(rows)
        at = to_device([min(self.pending(r), self.pending_hidden.shape[1] - 1) for r in rows], torch.long, self.device)
        self.pending_hidden[torch.arange(n, device=self.device), at] = hidden.to(self.dtype)

    def after_verify(self, rows: list[Request], hidden: Tensor) -> None:
        self.pending_hidden[: len(rows), : hidden.shape[1]] = hidden.to(self.dtype)

    def catch_up(self, rows: list[Request]) -> tuple[Tensor, Any]:
        feats = self._feed(rows, [self.pending(r) for r in rows], want_logits=True)
        for r in rows:
            r.draft_len = r.kv_len
        return self._logits(feats), feats

    def step(self, rows: list[Request], tokens: Tensor, j: int, state: Any) -> tuple[Tensor, Any]:
        positions = to_device([r.kv_len + j - 1 for r in rows], torch.long, self.device)
        backend = DecodeAttention(self.cache, positions, self._bucket(max(r.kv_len for r in rows) + j),
                                  self.config.decode_attention)
        feats = self._features(state[:, None], tokens[:, None], positions[:, None], backend)[:, 0]
        return self._logits(feats), feats

    def move_slot(self, src: int, dst: int, length: int) -> None:
        self.cache.move_slot(src, dst, min(length + self.headroom, self.cache.length))
        self.pending_hidden[dst] = self.pending_hidden[src]

    def clear_slot(self, slot: int) -> None:
        self.cache.clear_slot(slot)


def make_drafter(draft: Any, policy: CausalLM, config: EngineConfig, *, version: int = 0) -> Drafter:
    if isinstance(draft, EagleHead):
        return EagleDrafter(draft, policy, config, version=version)
    if isinstance(draft, CausalLM):
        return LMDrafter(draft, config, version=version)
    raise TypeError(f"a draft is a CausalLM or an EagleHead, got {type(draft).__name__}")
