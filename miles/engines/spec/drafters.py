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
single-entry steps (``decoder.py`` runs the loop). Only the catch-up advances ``draft_len``: the entries of the draft
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
from miles.utils.device import to_device
from miles.engines.spec.config import MAX_STEPS
from miles.engines.weights import WeightStager
from miles.models.draft import EagleHead
from miles.models.fused import compile_fast_path
from miles.models.model import CausalLM

CAPACITY = 2 * MAX_STEPS  # most pending entries per row before a plain step flushes them


class Drafter:
    """What both drafters share: model placement, weights and version.

    Host side (lists, per request): ``pending``, ``entries``, ``commit``, ``prefill``,
    ``flush``, ``record``, slot moves. Device side (tensors only, no host sync, so a round
    can be captured in a CUDA graph): ``catch_up`` and ``step``."""

    kind = "base"
    needs_hidden = False
    step_offset = 0  # draft step j (1..k-1) feeds its entry at position kv_len + step_offset + j
    length_aware = False  # its attention reads each row only up to its length (triton)
    # Whether plain steps must feed the draft every so often (``CAPACITY``): EAGLE keeps the
    # policy's hidden states of plain steps in a fixed buffer until they are fed. An
    # independent LM's backlog is just context tokens, fed at the next round, so while
    # speculation is off (above --speculative-max-batch-size, or not chosen) plain steps pay
    # nothing for it (benchmarks/spec_overhead.py measures what a draft costs a plain step).
    bounded_backlog = False

    def __init__(self, model: Any, config: EngineConfig, *, version: int = 0) -> None:
        self.config = config
        self.device, self.dtype = torch.device(config.device), config.torch_dtype()
        self.model = model.to(device=self.device, dtype=self.dtype).eval().requires_grad_(False)
        self.model.fuse_projections(compile_fast_path("draft") if config.use_compile() else None)
        self.stager = WeightStager(self.model, self.device, self.dtype)
        self.version = version
        self.headroom = MAX_STEPS + 2

    # ---- host side (subclasses) ------------------------------------------------------------
    def pending(self, r: Request) -> int:
        """Entries of ``r`` not yet in the draft cache (≥ 1 at the start of a round)."""
        raise NotImplementedError

    def entries(self, r: Request) -> list[int]:
        """The tokens of ``r``'s pending entries (the catch-up's inputs)."""
        raise NotImplementedError

    def commit(self, r: Request) -> None:
        """A catch-up fed all of ``r``'s pending entries."""
        raise NotImplementedError

    def prefill(self, rows: list[Request], seqs: list[list[int]], hidden: Tensor | None) -> None:
        raise NotImplementedError

    def flush(self, rows: list[Request]) -> None:
        raise NotImplementedError

    def record(self, rows: list[Request], hidden: Tensor) -> None:
        """A plain decode step ran ``rows`` at their ``kv_len`` (called before it advances)."""

    def after_verify(self, n: int, hidden: Tensor) -> None:
        """The policy verified rows 0..n-1; ``hidden`` [n, k + 1, H] at kv_len..kv_len+k."""

    def weights_changed(self, rows: list[Request]) -> None:
        """New draft weights were committed while ``rows`` are running."""

    def move_slot(self, src: int, dst: int, length: int) -> None:
        raise NotImplementedError

    def clear_slot(self, slot: int) -> None:
        raise NotImplementedError

    # ---- device side ------------------------------------------------------------------------
    def catch_up(self, tokens: Tensor, starts: Tensor, last: Tensor, L: int) -> tuple[Tensor, Any]:
        """Feed entries ``tokens`` [n, T] (right-padded) at ``starts``; returns (logits [n, V]
        after entry ``last[i]`` of each row, state for ``step``)."""
        raise NotImplementedError

    def step(self, tokens: Tensor, positions: Tensor, state: Any, L: int, *, graphs: bool) -> tuple[Tensor, Any]:
        """Feed the previous draft token of each row at ``positions``; returns (logits, state).
        ``graphs``: may replay the draft's own decode CUDA graph (not inside a round graph)."""
        raise NotImplementedError

    def _ids(self, seqs: list[list[int]], width: int | None = None) -> Tensor:
        m = width or max(max(len(s) for s in seqs), 1)
        return to_device([s + [0] * (m - len(s)) for s in seqs], torch.long, self.device)


class LMDrafter(Drafter):
    """An independent small CausalLM: entry i is context token i."""

    kind = "draft"

    def __init__(self, model: CausalLM, config: EngineConfig, *, version: int = 0) -> None:
        super().__init__(model, config, version=version)
        self.runner = ModelRunner(self.model, config, headroom=self.headroom)
        self.length_aware = self.runner.length_aware

    def pending(self, r: Request) -> int:
        return r.kv_len + 1 - r.draft_len  # the pending last token counts (it may be in flight)

    def entries(self, r: Request) -> list[int]:
        return r.context[r.draft_len :]

    def commit(self, r: Request) -> None:
        r.draft_len = len(r.context)

    def weights_changed(self, rows: list[Request]) -> None:
        for r in rows:  # the next flush or catch-up re-feeds the whole context
            r.draft_len = 0

    def prefill(self, rows: list[Request], seqs: list[list[int]], hidden: Tensor | None) -> None:
        self.runner.prefill([r.slot for r in rows], seqs, logits=False)
        for r, seq in zip(rows, seqs):
            r.draft_len = len(seq)

    def flush(self, rows: list[Request]) -> None:
        seqs = [r.context[r.draft_len : -1] or [0] for r in rows]  # [0]: a padding entry
        self.runner.verify(self._ids(seqs), [r.draft_len for r in rows], logits=False)
        for r in rows:
            r.draft_len = len(r.context) - 1

    def catch_up(self, tokens: Tensor, starts: Tensor, last: Tensor, L: int) -> tuple[Tensor, Any]:
        return self.runner.verify_eager(tokens, starts, L, logits_index=last).logits, None

    def step(self, tokens: Tensor, positions: Tensor, state: Any, L: int, *, graphs: bool) -> tuple[Tensor, Any]:
        out = self.runner.decode_at(tokens, positions, L) if graphs else self.runner.decode_eager(tokens, positions, L)
        return out.logits, None

    def move_slot(self, src: int, dst: int, length: int) -> None:
        self.runner.cache.move_slot(src, dst, min(length + self.headroom, self.runner.cache.length))

    def clear_slot(self, slot: int) -> None:
        self.runner.cache.clear_slot(slot)


class EagleDrafter(Drafter):
    """An EAGLE head over the policy's hidden states: entry i = (h_i, x_{i+1})."""

    kind = "eagle"
    needs_hidden = True
    bounded_backlog = True
    step_offset = -1

    def __init__(self, model: EagleHead, policy: CausalLM, config: EngineConfig, *, version: int = 0) -> None:
        super().__init__(model, config, version=version)
        self.policy = policy  # borrowed: embed_tokens and lm_head (updated in place with the policy)
        self.cache = KVCache(model.config, config.max_batch_size, config.max_seq_len, self.device,
                             self.dtype, headroom=self.headroom, kv_dtype=config.kv_torch_dtype())
        self.model.rotary.reserve(self.cache.length, self.device, self.dtype)
        self.attention = config.attention_mode(model.config.head_dim)
        self.length_aware = self.attention == "triton"
        self.pending_hidden = torch.zeros(config.max_batch_size, CAPACITY + MAX_STEPS + 1,
                                          model.config.hidden_size, device=self.device, dtype=self.dtype)
        self.block = config.block()

    def pending(self, r: Request) -> int:
        return r.kv_len - r.draft_len

    def entries(self, r: Request) -> list[int]:
        return r.context[r.draft_len + 1 : r.kv_len + 1]

    def commit(self, r: Request) -> None:
        r.draft_len = r.kv_len

    def _bucket(self, longest: int) -> int:
        return min(-(-longest // self.block) * self.block, self.cache.length)

    def _features(self, hidden: Tensor, ids: Tensor, positions: Tensor, backend: Any) -> Tensor:
        return self.model(hidden, ids, self.policy.model.embed_tokens, position_ids=positions, kv_cache=backend)

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
            ids = self._ids([s[1:] for s in seqs], T)
            pos = torch.arange(T, device=self.device).expand(n, T)
            self._features(hidden[:, :T], ids, pos, PrefillAttention(self.cache, slots))
        for r, m in zip(rows, lens):
            r.draft_len = m - 1

    def _feed(self, ids: Tensor, starts: Tensor, L: int) -> Tensor:
        backend = VerifyAttention(self.cache, starts, ids.shape[1], L, self.attention)
        return self._features(self.pending_hidden[: ids.shape[0], : ids.shape[1]], ids, backend.positions, backend)

    def flush(self, rows: list[Request]) -> None:
        counts = [max(self.pending(r) - 1, 0) for r in rows]
        if max(counts) == 0:
            return
        T = max(counts)
        seqs = [r.context[r.draft_len + 1 : r.draft_len + 1 + c] for r, c in zip(rows, counts)]
        self._feed(self._ids(seqs, T), to_device([r.draft_len for r in rows], torch.long, self.device),
                   self._bucket(max(r.draft_len for r in rows) + T))
        n = len(rows)
        keep = to_device(counts, torch.long, self.device)
        self.pending_hidden[:n, 0] = self.pending_hidden[torch.arange(n, device=self.device), keep]
        for r, c in zip(rows, counts):
            r.draft_len += c

    def record(self, rows: list[Request], hidden: Tensor) -> None:
        n = len(rows)
        at = to_device([min(self.pending(r), self.pending_hidden.shape[1] - 1) for r in rows], torch.long, self.device)
        self.pending_hidden[torch.arange(n, device=self.device), at] = hidden.to(self.dtype)

    def after_verify(self, n: int, hidden: Tensor) -> None:
        self.pending_hidden[:n, : hidden.shape[1]] = hidden[:n].to(self.dtype)

    def catch_up(self, tokens: Tensor, starts: Tensor, last: Tensor, L: int) -> tuple[Tensor, Any]:
        feats = self._feed(tokens, starts, L)
        f = feats[torch.arange(tokens.shape[0], device=self.device), last]
        return self.policy.lm_head(f).float(), f

    def step(self, tokens: Tensor, positions: Tensor, state: Any, L: int, *, graphs: bool) -> tuple[Tensor, Any]:
        backend = DecodeAttention(self.cache, positions, L, self.attention)
        f = self._features(state[:, None], tokens[:, None], positions[:, None], backend)[:, 0]
        return self.policy.lm_head(f).float(), f

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
