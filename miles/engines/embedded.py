"""EmbeddedEngine: the pure-PyTorch rollout engine (a ``miles.protocols.RolloutEngine``).

Wiring: a RolloutWorker builds one engine around a CausalLM and awaits
``engine.generate(request)`` for many requests at once; the WeightBroadcaster's deliveries
arrive as ``update_weights`` (or ``stage_weights`` + ``commit_weights``); partial rollouts
use ``abort``.

Threading: all model work runs on one dedicated *stepping thread*; the asyncio side only
enqueues requests and control messages and awaits futures that the thread resolves with
``loop.call_soon_threadsafe``. So ``await engine.generate(...)`` never blocks the worker's
event loop — rewards, environment steps and other coroutines interleave with decoding
(torch kernels release the GIL; the thread's Python overhead is shared at the interpreter's
switch interval). The thread loops: apply control (aborts, weight commits, pause) → admit
waiting requests and prefill them (batched, right-padded) → one decode step for every
running request (continuous batching: requests join and leave between steps) → sample →
hand finished requests back. Model and cache state are touched by that thread only.

Weight updates: ``stage_weights`` copies tensors into a staging area while decoding goes on;
``commit_weights`` is applied between two decode steps, all at once, and the version flips
after every staged tensor is in. Tokens sampled after the swap record the new version. With
``keep_kv_cache=False`` every in-flight request re-prefills its context with the new weights
first (AReaL); with ``True`` it keeps the cache computed by the old ones (PipelineRL).

Hidden states (``return_hidden_states``) come back through ``pop_hidden_states(rid)``:
``[len(context) - 1, H]`` float32, row p = final-norm hidden state at context position p
(the feature that predicted token p + 1) — what an EAGLE draft head trains on.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from typing import Any

import torch

from miles.engines.config import EngineConfig
from miles.engines.requests import Request
from miles.engines.runner import ModelRunner, StepOut
from miles.engines.sampling import SamplingBatch, sample
from miles.engines.weights import WeightStager
from miles.models.model import CausalLM
from miles.protocols import NamedTensors
from miles.types import GenerateOutput, GenerateRequest

log = logging.getLogger(__name__)


class EmbeddedEngine:
    def __init__(self, model: CausalLM, *, config: EngineConfig | None = None,
                 tokenizer: Any = None, version: int = 0) -> None:
        """Takes ownership of ``model``: moves it to ``config.device`` / dtype, freezes grads."""
        self.config = config = config or EngineConfig()
        config.validate(model.config.max_position_embeddings)
        self.device, self.dtype = torch.device(config.device), config.torch_dtype()
        self.model = model.to(device=self.device, dtype=self.dtype).eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.runner = ModelRunner(self.model, config)
        self.stager = WeightStager(self.model, self.device, self.dtype)
        self._version = version
        eos = set(model.config.eos_token_ids)
        if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_ids = frozenset(eos)
        self._gen = torch.Generator(device=self.device).manual_seed(config.seed)
        self._cv = threading.Condition()  # guards queues and control flags
        self._stage_lock = threading.Lock()  # staging vs applying weights, not decoding
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []  # request i holds KV slot i
        self._abort_rids: set[str] = set()
        self._abort_all = False
        self._commits: deque[tuple[int, bool, asyncio.AbstractEventLoop, asyncio.Future]] = deque()
        self._pause_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._pause_requested = self._paused = self._closed = False
        self._thread: threading.Thread | None = None
        self._hidden: dict[str, torch.Tensor] = {}
        self._counters = dict.fromkeys(
            ("tokens_generated", "decode_steps", "prefill_tokens", "weight_updates",
             "requests_finished", "requests_aborted", "requests_failed"), 0)
        self._occupancy: deque[float] = deque(maxlen=256)
        self._rate: deque[tuple[float, int]] = deque(maxlen=512)

    # ---- public API ------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self._version

    def start(self) -> None:
        with self._cv:
            if self._closed:
                raise RuntimeError("engine is closed")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="miles-engine", daemon=True)
                self._thread.start()

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        error = self._validate(request)
        if error is not None:
            return GenerateOutput(rid=request.rid, finish_reason="error", error=error)
        if request.sampling.max_new_tokens - request.num_prefix_tokens <= 0:
            return GenerateOutput(rid=request.rid, finish_reason="length")
        self.start()
        loop = asyncio.get_running_loop()
        req = Request(request, loop, loop.create_future())
        with self._cv:
            if any(r.rid == request.rid for r in (*self._waiting, *self._running)):
                return GenerateOutput(rid=request.rid, finish_reason="error",
                                      error=f"request id {request.rid!r} is already in flight")
            self._waiting.append(req)
            self._cv.notify()
        try:
            return await req.future
        except asyncio.CancelledError:
            await self.abort(request.rid)
            raise

    async def abort(self, rid: str | None = None) -> None:
        with self._cv:
            keep: deque[Request] = deque()
            for r in self._waiting:
                if rid is None or r.rid == rid:
                    r.aborted = True
                    self._counters["requests_aborted"] += 1
                    r.resolve()
                else:
                    keep.append(r)
            self._waiting = keep
            if rid is None:
                self._abort_all = True
            else:
                self._abort_rids.add(rid)
            self._cv.notify()

    async def pause(self) -> None:
        """Stop stepping at the next step boundary (requests stay in the batch)."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._cv:
            if self._thread is None or self._paused:
                self._paused = self._pause_requested = True
                return
            self._pause_requested = True
            self._pause_waiters.append((loop, fut))
            self._cv.notify()
        await fut

    async def resume(self) -> None:
        with self._cv:
            self._pause_requested = self._paused = False
            self._cv.notify()

    def stage_weights(self, named_tensors: NamedTensors) -> int:
        """Validate and stage tensors (HF names) while decoding continues; returns how many."""
        with self._stage_lock:  # never held by a decode step: decoding goes on meanwhile
            return self.stager.stage(named_tensors)

    async def commit_weights(self, version: int, *, keep_kv_cache: bool | None = None) -> None:
        """Swap the staged tensors in between two decode steps; ``version`` flips after all."""
        keep = self.config.keep_kv_cache_on_update if keep_kv_cache is None else keep_kv_cache
        if version < self._version:
            raise ValueError(f"weight version {version} is older than the engine's {self._version}")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._cv:
            idle = self._thread is None
            if not idle:
                self._commits.append((version, keep, loop, fut))
                self._cv.notify()
        if idle:  # nothing decoding: apply right here
            self._commit(version, keep)
            return
        await fut

    async def update_weights(self, named_tensors: NamedTensors, version: int, *,
                             keep_kv_cache: bool | None = None) -> None:
        """Full state dict or one bucket list of (HF name, tensor); staged, then committed."""
        await asyncio.to_thread(self.stage_weights, named_tensors)
        await self.commit_weights(version, keep_kv_cache=keep_kv_cache)

    def pop_hidden_states(self, rid: str) -> torch.Tensor | None:
        return self._hidden.pop(rid, None)

    def progress(self, rid: str) -> int | None:
        """Tokens generated so far by an in-flight request (None if not in flight)."""
        with self._cv:
            for r in (*self._running, *self._waiting):
                if r.rid == rid:
                    return len(r.output_ids)
        return None

    def snapshot(self, rid: str) -> tuple[list[int], list[float], list[int]] | None:
        """(output_ids, logprobs, versions) an in-flight request has so far (None if not in
        flight); for streaming. Copies taken while the stepping thread may be appending, so
        cut to the shortest of the three."""
        with self._cv:
            for r in (*self._running, *self._waiting):
                if r.rid == rid:
                    ids, lps, vs = list(r.output_ids), list(r.logprobs), list(r.versions)
                    n = min(len(ids), len(lps), len(vs))
                    return ids[:n], lps[:n], vs[:n]
        return None

    def stats(self) -> dict[str, float]:
        now = time.monotonic()
        rate = 0.0
        recent = [(t, n) for t, n in self._rate if now - t <= 10.0]
        if len(recent) >= 2 and recent[-1][0] > recent[0][0]:
            rate = (recent[-1][1] - recent[0][1]) / (recent[-1][0] - recent[0][0])
        occ = sum(self._occupancy) / len(self._occupancy) if self._occupancy else 0.0
        out = {f"engine/{k}": float(v) for k, v in self._counters.items()}
        out.update({
            "rollout/tokens_generated": float(self._counters["tokens_generated"]),
            "rollout/tokens_per_s": rate,
            "engine/batch_occupancy": occ,
            "engine/num_running": float(len(self._running)),
            "engine/num_waiting": float(len(self._waiting)),
            "engine/version": float(self._version),
            "engine/kv_cache_bytes": float(self.runner.cache.nbytes),
        })
        return out

    async def close(self) -> None:
        await self.abort()
        with self._cv:
            self._closed = True
            self._cv.notify()
            thread = self._thread
        if thread is not None:
            await asyncio.to_thread(thread.join)

    # ---- validation ------------------------------------------------------------------
    def _validate(self, request: GenerateRequest) -> str | None:
        ids, sp, V = request.input_ids, request.sampling, self.model.config.vocab_size
        if not ids:
            return "input_ids is empty"
        bad = next((t for t in ids if not 0 <= t < V), None)
        if bad is not None:
            return f"token id {bad} outside the vocabulary [0, {V})"
        if len(ids) >= self.config.max_seq_len:
            return (f"prompt of {len(ids)} tokens does not fit the context "
                    f"(max_seq_len={self.config.max_seq_len}, one new token at least)")
        if sp.temperature < 0 or not 0 < sp.top_p <= 1 or sp.top_k == 0 or sp.top_k < -1:
            return (f"invalid sampling params: temperature={sp.temperature} (>= 0), "
                    f"top_p={sp.top_p} (in (0, 1]), top_k={sp.top_k} (-1 or >= 1)")
        if sp.stop and self.tokenizer is None:
            return "stop strings need an engine built with a tokenizer"
        if request.num_prefix_tokens < 0:
            return f"num_prefix_tokens must be >= 0, got {request.num_prefix_tokens}"
        return None

    # ---- stepping thread -------------------------------------------------------------
    def _run(self) -> None:
        with torch.no_grad():
            while True:
                with self._cv:
                    while not self._has_work():
                        self._cv.wait()
                    if self._closed and not self._running and not self._waiting:
                        return
                self._control()
                if self._paused:
                    continue
                try:
                    self._admit()
                    if self._running:
                        self._decode()
                except Exception as exc:  # keep serving: fail what was in the step
                    log.exception("engine step failed")
                    self._fail_all(f"engine step failed: {type(exc).__name__}: {exc}")

    def _has_work(self) -> bool:
        if self._closed or self._commits or self._abort_all or self._abort_rids:
            return True
        if self._pause_requested != self._paused:
            return True
        return not self._paused and bool(self._waiting or self._running)

    def _control(self) -> None:
        with self._cv:
            aborts, abort_all = self._abort_rids, self._abort_all
            self._abort_rids, self._abort_all = set(), False
            commits, self._commits = self._commits, deque()
            if self._pause_requested and not self._paused:
                self._paused = True
                for loop, fut in self._pause_waiters:
                    _set_soon(loop, fut, None)
                self._pause_waiters = []
            elif not self._pause_requested:
                self._paused = False
        for version, keep, loop, fut in commits:
            try:
                self._commit(version, keep)
                _set_soon(loop, fut, None)
            except Exception as exc:
                _set_soon(loop, fut, exc)
        for r in list(self._running):
            if abort_all or r.rid in aborts:
                r.aborted = True
                self._release(r)

    def _commit(self, version: int, keep_kv_cache: bool) -> None:
        with self._stage_lock:
            self.stager.apply()
        self._version = version
        self._counters["weight_updates"] += 1
        if not keep_kv_cache:
            for r in self._running:
                r.needs_prefill = True

    def _admit(self) -> None:
        """Prefill: in-flight requests whose cache must be recomputed, then waiting ones."""
        rows: list[Request] = [r for r in self._running if r.needs_prefill]
        budget = self.config.max_prefill_tokens
        longest = max((len(r.context) for r in rows), default=0)
        with self._cv:
            while self._waiting and len(self._running) < self.config.max_batch_size:
                nxt = self._waiting[0]
                new_longest = max(longest, len(nxt.context))
                if rows and new_longest * (len(rows) + 1) > budget:
                    break
                self._waiting.popleft()
                nxt.slot = len(self._running)
                self._running.append(nxt)
                rows.append(nxt)
                longest = new_longest
        if rows:
            self._prefill(rows)

    def _prefill(self, rows: list[Request]) -> None:
        # A fresh request prefills its whole context and samples; a recomputed one
        # re-prefills all but its pending last token and samples nothing.
        seqs = [r.context if r.kv_len == 0 else r.context[:-1] for r in rows]
        fresh = [r.kv_len == 0 for r in rows]
        want_hidden = any(r.hidden is not None for r in rows)
        want_routing = any(r.routed is not None for r in rows)
        out = self.runner.prefill([r.slot for r in rows], seqs, logits=any(fresh),
                                  hidden=want_hidden, routing=want_routing)
        self._counters["prefill_tokens"] += sum(len(s) for s in seqs)
        for i, (r, seq) in enumerate(zip(rows, seqs)):
            r.needs_prefill = False
            r.kv_len = len(seq)
            if r.hidden is not None and fresh[i]:
                r.hidden.append(out.hidden[i, : len(seq)])
        sample_rows = [i for i, f in enumerate(fresh) if f]
        if sample_rows:
            idx = torch.tensor(sample_rows, device=self.device)
            routing = None if out.routing is None else out.routing[idx, [len(seqs[i]) - 1 for i in sample_rows]]
            sub = StepOut(out.logits[idx], None, routing)
            self._sample_and_append([rows[i] for i in sample_rows], sub)

    def _decode(self) -> None:
        reqs = list(self._running)
        out = self.runner.decode([r.context[-1] for r in reqs], [r.kv_len for r in reqs])
        for i, r in enumerate(reqs):
            r.kv_len += 1
            if r.hidden is not None:
                r.hidden.append(out.hidden[i][None])
        self._counters["decode_steps"] += 1
        self._occupancy.append(len(reqs) / self.config.max_batch_size)
        self._sample_and_append(reqs, out)

    def _sample_and_append(self, reqs: list[Request], out: StepOut) -> None:
        batch = SamplingBatch.build([r.sampling for r in reqs], [r.response_position for r in reqs])
        tokens, logprobs = sample(out.logits, batch, self._gen)
        finite = torch.isfinite(out.logits).all(dim=-1)
        host = torch.stack([tokens.double(), logprobs.double(), finite.double()]).cpu().tolist()
        routing = out.routing.cpu().tolist() if any(r.routed is not None for r in reqs) else None
        version, max_len = self._version, self.config.max_seq_len
        for i, r in enumerate(reqs):
            if not host[2][i]:
                r.fail(f"non-finite logits at response position {r.response_position}")
            else:
                r.append(int(host[0][i]), host[1][i], version, eos_ids=self.eos_ids,
                         max_seq_len=max_len, tokenizer=self.tokenizer)
                if r.routed is not None and routing is not None:
                    r.routed.append(routing[i])
        self._counters["tokens_generated"] += len(reqs)
        self._rate.append((time.monotonic(), self._counters["tokens_generated"]))
        for r in reqs:
            if r.finish is not None:
                self._release(r)

    def _release(self, req: Request) -> None:
        """Hand a request back and keep slots 0..n-1 dense (the last one fills the hole)."""
        slot = req.slot
        if req.finish == "error":  # non-finite K/V must not linger (0 · NaN poisons attention)
            self.runner.cache.clear_slot(slot)
        last = self._running.pop()
        if last is not req:
            self._running[slot] = last
            self.runner.cache.move_slot(last.slot, slot, last.kv_len)
            last.slot = slot
        req.slot = -1
        key = {"error": "requests_failed", "abort": "requests_aborted"}.get(req.finish or "abort")
        self._counters[key or "requests_finished"] += 1
        if req.hidden is not None:
            hidden = req.hidden_states()
            if hidden is not None:
                self._hidden[req.rid] = hidden
        req.resolve()

    def _fail_all(self, message: str) -> None:
        for r in list(self._running):
            r.fail(message)
            self._release(r)


def _set_soon(loop: asyncio.AbstractEventLoop, fut: asyncio.Future, value: Any) -> None:
    def _set() -> None:
        if fut.done():
            return
        if isinstance(value, BaseException):
            fut.set_exception(value)
        else:
            fut.set_result(value)

    try:
        loop.call_soon_threadsafe(_set)
    except RuntimeError:
        pass
