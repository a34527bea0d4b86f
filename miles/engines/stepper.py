"""Stepper: what the engine's stepping thread does — prefill, decode, sample, hand results back.

Only the stepping thread calls into a Stepper (see ``embedded.py`` for the threading model).
It owns the requests in flight (request i holds KV slot i, kept dense by moving the last
request into a freed slot) and the step that is on the device but not yet read back.

One step = ``runner.decode`` → ``sample`` → an asynchronous copy of (token, log-prob,
finite) to the host → ``_process`` (append, stop rules, release). On CUDA (``overlap``)
the host launches decode step k+1 — its input tokens gathered on the device from
step k's samples — *before* it reads back and processes step k, so host bookkeeping runs
while the device computes. A request that step k finished still occupies a row of step
k+1; that row's token is discarded. Anything that needs a settled state — admitting or
re-prefilling requests, aborts, weight commits, pause — calls ``drain`` first.

With a ``SpecDecoder`` each step is either a plain decode step or, when its controller says
so, a speculative round (``spec/decoder.py``): synchronous, up to k + 1 tokens per row, all
of them carrying the policy's log-probs and the current policy version. Plain steps are
timed for the controller; the drafter sees every prefill, slot move and plain step.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from miles.engines.config import EngineConfig
from miles.engines.requests import Request
from miles.engines.runner import GRAPH_CAPTURES, ModelRunner, StepOut, compile_seconds
from miles.engines.sampling import SamplingBatch, fused_sample, recorded_logprobs, sample
from miles.models import invariant
from miles.utils.cuts import cut_by_length
from miles.utils.device import to_device

if TYPE_CHECKING:
    from miles.engines.spec.decoder import SpecDecoder

# A prefill forward's fixed cost in padded tokens' worth: a batch of prompts is cut into
# several prefills where that saves more padding (resumed partial rollouts re-prefill long
# contexts next to short fresh prompts).
PREFILL_COST = 512


@dataclass
class _InFlight:
    reqs: list[Request]  # row i → request
    tokens: Tensor  # [n] sampled ids on the device (next step's inputs)
    host: Tensor  # [3, n] float64: token, log-prob, finite — on the host once ``event`` fired
    routing: Tensor | None  # [n, L_moe, k] (host copy in flight)
    event: Any  # torch.cuda.Event or None
    version: int


class EngineStats:
    def __init__(self) -> None:
        self.counters = dict.fromkeys(
            ("tokens_generated", "decode_steps", "decode_rows", "prefill_tokens", "prefill_tokens_fresh",
             "prefill_tokens_resumed", "prefill_tokens_recompute", "prefill_tokens_shared", "prefill_forwards", "weight_updates",
             "requests_finished", "requests_aborted", "requests_failed", "spec_rounds",
             "draft_updates"), 0)
        self.occupancy: deque[float] = deque(maxlen=256)
        self.rate: deque[tuple[float, int]] = deque(maxlen=512)
        # Where the stepping thread's time goes: waiting with nothing to do (idle: no request
        # in the engine, so the worker did not feed it; or paused for a weight update, when the
        # worker drains it) or running admissions, steps and control (busy). An engine idle
        # while its device is too points upstream (leases, admission); one busy while its
        # device idles is bound by host work per step.
        self.thread_start: float | None = None  # perf_counter when the stepping thread started
        self.idle_s = 0.0  # finished idle stretches
        self.idle_since: float | None = None  # the current idle stretch's start
        # The busy time by phase (seconds, CUDA graph captures and torch.compile's compiles of
        # new shape variants counted apart): where a slow
        # run went. A speculative engine's wall time that its measured options do not
        # explain (an adaptive rule slower than plain while its plain steps and rounds measure
        # near plain) is in ``flush`` (draft backlog feeds, which
        # the rule's rates leave out), ``prefill`` or ``capture``.
        self.phase_s = dict.fromkeys(("prefill", "plain", "round", "flush", "capture", "compile"), 0.0)
        # Of the busy time, the seconds spent blocked on a step's results (the device still
        # running it). With overlap, a decode loop bound by its device waits here most of a
        # step; one that hardly waits is bound by its host work (``benchmarks/profile_decode.py``).
        self.device_wait_s = 0.0
        # Seconds the stepping thread spent at start compiling every shape class of the
        # compiled step functions (``ModelRunner.warm_compiled``), before serving.
        self.warm_s = 0.0

    def seconds(self) -> dict[str, float]:
        """Cumulative idle and busy seconds of the stepping thread (0 before it starts)."""
        if self.thread_start is None:
            return {"idle_s": 0.0, "busy_s": 0.0}
        now = time.perf_counter()
        idle = self.idle_s + (now - self.idle_since if self.idle_since is not None else 0.0)
        return {"idle_s": idle, "busy_s": now - self.thread_start - idle}

    def tokens(self, n: int) -> None:
        self.counters["tokens_generated"] += n
        self.rate.append((time.monotonic(), self.counters["tokens_generated"]))

    def tokens_per_s(self, window: float = 10.0) -> float:
        now = time.monotonic()
        recent = [(t, n) for t, n in list(self.rate) if now - t <= window]
        if len(recent) < 2 or recent[-1][0] <= recent[0][0]:
            return 0.0
        return (recent[-1][1] - recent[0][1]) / (recent[-1][0] - recent[0][0])


class Stepper:
    def __init__(self, runner: ModelRunner, config: EngineConfig, *, eos_ids: frozenset[int],
                 tokenizer: Any, generator: torch.Generator, stats: EngineStats,
                 on_done: Callable[[Request], None], spec: SpecDecoder | None = None) -> None:
        self.runner, self.config, self.spec = runner, config, spec
        self.eos_ids, self.tokenizer, self.generator = eos_ids, tokenizer, generator
        self.stats, self.on_done = stats, on_done
        self.device = runner.device
        # launch-ahead on CUDA; on the CPU the host computes the step itself: nothing to overlap
        self.overlap = self.device.type == "cuda"
        self.fused_sampling = config.use_fused_sampling()
        self.running: list[Request] = []
        self.inflight: _InFlight | None = None
        self.prefill_tokens = config.max_prefill_tokens  # a prefill group's budget (lowered on an OOM)
        # dynamo's compile timers, read where something may compile (two reads a step)
        self._compile_seconds: Callable[[], float] = compile_seconds if config.use_compile() else float
        self.version = 0

    @property
    def busy(self) -> bool:
        return bool(self.running) or self.inflight is not None

    # ---- admission / prefill -----------------------------------------------------------
    def admit(self, new: list[Request]) -> None:
        """Re-prefill requests whose cache was invalidated and prefill ``new`` ones (sync)."""
        self.drain()
        rows = [r for r in self.running if r.needs_prefill]
        for r in new:
            r.slot = len(self.running)
            self.running.append(r)
            rows.append(r)
        if rows:
            start, captures = time.perf_counter(), self._clocks()
            self._prefill(rows)
            self._account("prefill", start, captures)

    def _prefill(self, rows: list[Request]) -> None:
        if self.spec is not None:
            return self._prefill_spec(rows)
        # A fresh request prefills its whole context and samples its first token; a
        # recomputed one re-prefills all but its pending last token and samples nothing.
        seqs = [r.context if r.kv_len == 0 else r.context[:-1] for r in rows]
        # Rows with the same tokens (a group's samples of one prompt, admitted together)
        # prefill once: the others copy its K/V and sample from its logits.
        first: dict[tuple[int, ...], int] = {}
        source = [first.setdefault(tuple(s), i) for i, s in enumerate(seqs)]
        unique = list(first.values())
        copies: dict[int, list[int]] = {i: [] for i in unique}
        for i, src in enumerate(source):
            if src != i:
                copies[src].append(i)
        if self.config.deterministic:
            groups = [[i] for i in unique]  # alone: its padded length never depends on its neighbours
        else:  # resumed long contexts among fresh prompts: not all padded to one
            groups = [[unique[j] for j in g]
                      for g in cut_by_length(range(len(unique)), [len(seqs[i]) for i in unique], max_rows=None,
                                             max_tokens=self.prefill_tokens, cost=PREFILL_COST)]
        for g in groups:
            self._prefill_group([rows[i] for i in g], [seqs[i] for i in g],
                                [[rows[j] for j in copies[i]] for i in g])

    def _prefill_group(self, rows: list[Request], seqs: list[list[int]], copies: list[list[Request]]) -> None:
        """Prefill ``rows``; ``copies[i]`` are requests whose context is ``seqs[i]`` too: they
        take row i's K/V (a slot copy) and, when fresh, sample from row i's logits."""
        everyone = [*enumerate(rows), *((i, c) for i, cs in enumerate(copies) for c in cs)]
        fresh = [(i, q) for i, q in everyone if q.kv_len == 0]
        out = self.runner.prefill([r.slot for r in rows], seqs, logits=bool(fresh),
                                  hidden=any(q.hidden is not None for _, q in everyone),
                                  routing=any(q.routed is not None for _, q in everyone))
        self._count_prefill(rows, seqs, copies)
        for i, (r, seq) in enumerate(zip(rows, seqs)):
            for c in copies[i]:
                self.runner.cache.move_slot(r.slot, c.slot, len(seq))
            for q in (r, *copies[i]):
                q.needs_prefill = False
                q.kv_version = self.version
                if q.kv_len == 0 and q.hidden is not None:
                    q.hidden.append(out.hidden[i, : len(seq)].clone())
                q.kv_len = len(seq)
        if fresh:
            idx = to_device([i for i, _ in fresh], torch.long, self.device)
            last = to_device([len(seqs[i]) - 1 for i, _ in fresh], torch.long, self.device)
            routing = None if out.routing is None else out.routing[idx, last]
            self._process(self._launch_sample([r for _, r in fresh], StepOut(out.logits[idx], None, routing)))

    def _prefill_spec(self, rows: list[Request]) -> None:
        """With speculation every row prefills all but its last context token and samples
        nothing: every token then comes from a step (plain or a round), so a resumed request
        restarts at a step boundary exactly as the uninterrupted one went on."""
        drafter = self.spec.drafter
        work = [r for r in rows if len(r.context) > 1]
        fresh = [i for i, r in enumerate(work) if r.kv_len == 0]
        if work:
            seqs = [r.context[:-1] for r in work]
            out = self.runner.prefill([r.slot for r in work], seqs, logits=False,
                                      hidden=drafter.needs_hidden or any(r.hidden is not None for r in work))
            self._count_prefill(work, seqs)
            for i, r in enumerate(work):
                if r.kv_len == 0 and r.hidden is not None:
                    r.hidden.append(out.hidden[i, : len(seqs[i])].clone())
            if fresh:  # a recomputed request keeps its draft cache
                hidden = out.hidden[to_device(fresh, torch.long, self.device)] if drafter.needs_hidden else None
                drafter.prefill([work[i] for i in fresh], [seqs[i] for i in fresh], hidden)
        for r in rows:
            r.needs_prefill = False
            r.kv_len = len(r.context) - 1
            r.kv_version = self.version

    def _count_prefill(self, rows: list[Request], seqs: list[list[int]],
                       copies: list[list[Request]] | None = None) -> None:
        """Prefill tokens by cause: a fresh prompt, a resumed partial rollout (its earlier
        response comes back as context), or a running row recomputing its cache after a
        weight update that did not keep it; and the tokens that rows of the same context
        took by a slot copy instead (``prefill_tokens_shared``, not in the total)."""
        c = self.stats.counters
        c["prefill_forwards"] += 1  # a prefill's cost is mostly per forward when its rows are short
        for i, (r, seq) in enumerate(zip(rows, seqs)):
            n = len(seq)
            c["prefill_tokens"] += n
            cause = "recompute" if r.kv_len else ("resumed" if r.req.num_prefix_tokens else "fresh")
            c[f"prefill_tokens_{cause}"] += n
            if copies is not None:
                c["prefill_tokens_shared"] += n * len(copies[i])

    # ---- decode ------------------------------------------------------------------------
    def decode(self) -> None:
        """Launch one decode step for every running request (then, with overlap, process
        the previous step while this one runs) — or run one speculative round."""
        if self.spec is not None:
            k = self.spec.plan(len(self.running))
            if k or self.spec.needs_flush(self.running):
                self.drain()  # a settled state: every sampled token is in its context
                if not self.running:
                    return
                if k:
                    self._spec_round(k)
                    return
                start, captures = time.perf_counter(), self._clocks()
                self.spec.drafter.flush(list(self.running))
                if self.device.type == "cuda":  # the pipeline is drained: this waits for the feed alone
                    torch.cuda.synchronize(self.device)
                self._account("flush", start, captures)
        start, captures = time.perf_counter(), self._clocks()
        prev = self.inflight  # stays in place if this launch raises (fail_all drains it)
        reqs = list(self.running)
        if prev is None:
            tokens: Tensor | list[int] = [r.context[-1] for r in reqs]
        else:
            row = {id(r): i for i, r in enumerate(prev.reqs)}
            tokens = prev.tokens[to_device([row[id(r)] for r in reqs], torch.long, self.device)]
        top = self.config.max_seq_len - 1  # a finished-but-unprocessed row must stay in bounds
        out = self.runner.decode(tokens, [min(r.kv_len, top) for r in reqs], native_logits=self.fused_sampling)
        if self.spec is not None:
            self.spec.drafter.record(reqs, out.hidden)
        for i, r in enumerate(reqs):
            r.kv_len += 1
            if r.hidden is not None:
                r.hidden.append(out.hidden[i : i + 1].clone())  # graph outputs are reused
        self.stats.counters["decode_steps"] += 1
        self.stats.counters["decode_rows"] += len(reqs)
        self.stats.occupancy.append(len(reqs) / self.config.max_batch_size)
        self.inflight = self._launch_sample(reqs, out)
        if prev is not None:
            self._process(prev)
        if not self.overlap:
            self.drain()
        seconds = self._account("plain", start, captures)
        if self.spec is not None:
            self.spec.controller.observe_plain(len(reqs), seconds, len(reqs))

    def _clocks(self) -> tuple[float, float]:
        """This process's capture and compile seconds so far (what a phase leaves out)."""
        return GRAPH_CAPTURES["seconds"], self._compile_seconds()

    def _account(self, phase: str, start: float, captures: tuple[float, float]) -> float:
        """Add the seconds since ``start`` to ``phase`` and return them, less the CUDA graph
        captures and the compiles made meanwhile (added to ``capture`` and ``compile``): a
        capture is a one-time cost of a new shape, not the option's rate. Counted in, it made
        a rarely used option (met at each new context bucket) look several times slower than
        it is, and the adaptive rule never chose it again (GRAPH_CAPTURES is per process: one
        engine per process, as a rollout worker runs it). A compile of a new shape variant
        likewise (``compile_seconds``): counted in, it read as prefill time."""
        capture, compiled = self._clocks()
        capture -= captures[0]
        compiled -= captures[1]
        seconds = time.perf_counter() - start - capture - compiled
        self.stats.phase_s[phase] += seconds
        self.stats.phase_s["capture"] += capture
        self.stats.phase_s["compile"] += compiled
        return seconds

    def _spec_round(self, k: int) -> None:
        start, captures = time.perf_counter(), self._clocks()
        reqs = list(self.running)
        res = self.spec.run(reqs, k, self.generator, probe=self.spec.controller.is_probe)
        eos, max_len, tok = self.eos_ids, self.config.max_seq_len, self.tokenizer
        done, total, outcomes = [], 0, []
        for i, r in enumerate(reqs):
            if not res.finite[i]:
                r.fail(f"non-finite logits at response position {r.response_position}")
                done.append(r)
                continue
            room = min(r.budget - len(r.output_ids), max_len - len(r.context))
            k_eff = max(min(k, room - 1), 0)  # drafts that could have been kept
            a = res.accepted[i]
            emitted = 0
            for j in range(a + 1):
                r.append(int(res.tokens[i][j]), res.logprobs[i][j], self.version, eos_ids=eos,
                         max_seq_len=max_len, tokenizer=tok)
                if r.routed is not None and res.routing is not None:
                    r.routed.append(res.routing[i][j])
                emitted += 1
                if r.finish is not None:
                    break
            if r.hidden is not None:
                r.hidden.append(res.hidden[i, :emitted].clone())
            r.kv_len += emitted  # the accepted drafts' K/V are in place; the last token is pending
            r.issued += emitted
            r.spec_rounds += 1
            r.spec_accepted += min(a, k_eff)
            total += emitted
            outcomes.append((k_eff, min(a, k_eff)))
            if r.finish is not None:
                done.append(r)
        self.stats.tokens(total)
        self.stats.counters["decode_steps"] += 1
        self.stats.counters["decode_rows"] += len(reqs)
        self.stats.counters["spec_rounds"] += 1
        self.stats.occupancy.append(len(reqs) / self.config.max_batch_size)
        seconds = self._account("round", start, captures) - self.spec.flush_s  # a backlog feed is the switch's cost
        self.stats.phase_s["round"] -= self.spec.flush_s
        self.stats.phase_s["flush"] += self.spec.flush_s
        self.spec.controller.observe_round(len(reqs), k, seconds if res.timed else None, self.version,
                                           outcomes, total)
        for r in done:
            self.release(r)

    def drain(self) -> None:
        """Read back and process the step in flight, if any."""
        pending, self.inflight = self.inflight, None
        if pending is not None:
            self._process(pending)

    def _launch_sample(self, reqs: list[Request], out: StepOut) -> _InFlight:
        positions = []
        for r in reqs:
            positions.append(r.req.num_prefix_tokens + r.issued)
            r.issued += 1
        batch = SamplingBatch.build([r.sampling for r in reqs], positions)
        kernel = self.runner.cpu_kernel
        fused = kernel.sample(out.logits, batch, self.generator) if kernel is not None else None
        if fused is None and self.fused_sampling:  # the same in one Triton pass (CUDA)
            fused = fused_sample(out.logits, batch, self.generator)
            if fused is not None and invariant.on(out.logits):  # --true-on-policy: the trainer's log-probs
                fused[1][1] = recorded_logprobs(out.logits, batch, fused[0])
        if fused is not None:  # the same draw and checks in one C call (CPU)
            tokens, stacked = fused
        else:
            tokens, logprobs = sample(out.logits.float(), batch, self.generator)
            finite = torch.isfinite(out.logits).all(dim=-1)
            stacked = torch.stack([tokens.double(), logprobs.double(), finite.double()])
        routing = out.routing if any(r.routed is not None for r in reqs) else None
        event = None
        if self.device.type == "cuda":
            host = torch.empty(stacked.shape, dtype=stacked.dtype, pin_memory=True)
            host.copy_(stacked, non_blocking=True)
            if routing is not None:
                routing = routing.to("cpu", non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        else:
            host = stacked
        return _InFlight(reqs, tokens, host, routing, event, self.version)

    def _process(self, step: _InFlight) -> None:
        if step.event is not None:
            t = time.perf_counter()
            step.event.synchronize()
            self.stats.device_wait_s += time.perf_counter() - t
        token, logprob, finite = step.host.tolist()
        routing = step.routing.tolist() if step.routing is not None else None
        eos, max_len, tok = self.eos_ids, self.config.max_seq_len, self.tokenizer
        done, n = [], 0
        for i, r in enumerate(step.reqs):
            if r.finish is not None or r.slot < 0:
                continue  # finished (or aborted) at an earlier step: this row is discarded
            if not finite[i]:
                r.fail(f"non-finite logits at response position {r.response_position}")
            else:
                r.append(int(token[i]), logprob[i], step.version, eos_ids=eos, max_seq_len=max_len,
                         tokenizer=tok)
                if r.routed is not None and routing is not None:
                    r.routed.append(routing[i])
                n += 1
            if r.finish is not None:
                done.append(r)
        self.stats.tokens(n)
        for r in done:
            self.release(r)

    # ---- leaving ---------------------------------------------------------------------
    def release(self, req: Request) -> None:
        """Hand a request back; the last running request moves into its slot."""
        slot = req.slot
        drafter = self.spec.drafter if self.spec is not None else None
        if req.finish == "error":  # non-finite K/V must not linger (0 · NaN poisons attention)
            self.runner.cache.clear_slot(slot)
            if drafter is not None:
                drafter.clear_slot(slot)
        last = self.running.pop()
        if last is not req:
            self.running[slot] = last
            self.runner.cache.move_slot(last.slot, slot, min(last.kv_len, self.config.max_seq_len))
            if drafter is not None:
                drafter.move_slot(last.slot, slot, min(last.kv_len + 1, self.config.max_seq_len))
            last.slot = slot
        req.slot = -1
        key = {"error": "requests_failed", None: "requests_aborted"}.get(req.finish, "requests_finished")
        self.stats.counters[key] += 1
        self.on_done(req)

    def fail_all(self, message: str) -> None:
        try:  # keep what the last good step produced, if it can still be read back
            self.drain()
        except Exception:
            self.inflight = None
        for r in list(self.running):
            r.fail(message)
            self.release(r)
