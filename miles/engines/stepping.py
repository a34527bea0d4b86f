"""The stepping thread's side of the EmbeddedEngine: its loop and everything only that thread runs.

Wiring: ``EmbeddedEngine`` (``embedded.py``) inherits ``SteppingLoop`` and starts ``_run`` on
its own thread (``start``); the asyncio side only queues requests and control messages
under ``_cv`` and awaits the futures this side resolves. So ``embedded.py`` holds what
callers see (construction, ``generate``, weight staging, stats) and this module holds how
the engine steps: control between steps (aborts, pauses, weight commits), admission,
prefill and decode through the ``Stepper``, recovery from out-of-memory steps, and what the
thread does while idle (the switch to compiled step functions, ``warmup``; decode graphs
captured one at a time, ``IDLE_CAPTURE_S`` after the last work). A mixin rather than a
helper object, because the loop reads and writes the engine's queues and flags under one
lock; the attributes below are the ones the engine provides.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any

import torch

from miles.engines.warmup import POLL_S
from miles.engines.weights import WeightError
from miles.models import quant

if TYPE_CHECKING:
    from miles.engines.config import EngineConfig
    from miles.engines.offload import EngineOffloader
    from miles.engines.oom import EngineOOM
    from miles.engines.requests import Request
    from miles.engines.runner import ModelRunner
    from miles.engines.stepper import EngineStats, Stepper
    from miles.engines.warmup import CompileSwitch
    from miles.engines.weights import WeightStager
    from miles.models.quant_io import WireDecoder

log = logging.getLogger(__name__)
IDLE_CAPTURE_S = 0.25  # nothing to step for this long, and a missing decode graph is captured (``_capture_due``)


class SteppingLoop:
    """The stepping thread's loop and helpers, mixed into ``EmbeddedEngine``, which sets
    every attribute annotated here in its ``__init__``."""

    config: EngineConfig
    model: torch.nn.Module
    quant: Any
    runner: ModelRunner
    spec: Any
    stager: WeightStager
    offloader: EngineOffloader
    wire: WireDecoder
    stepper: Stepper
    oom: EngineOOM
    stats_: EngineStats
    swap_pauses: deque[float]
    compile_inline: bool
    compile_stats: dict[str, float]
    _compile: CompileSwitch | None
    _hidden: dict[str, torch.Tensor]
    _cv: threading.Condition
    _stage_lock: threading.Lock
    _waiting: deque[Request]
    _deferred_steps: int
    _abort_rids: set[str]
    _abort_all: bool
    _commits: deque[tuple[int, bool, asyncio.AbstractEventLoop, asyncio.Future]]
    _draft_commits: deque[tuple[int, asyncio.AbstractEventLoop, asyncio.Future]]
    _pause_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]]
    _pause_requested: bool
    _paused: bool
    _closed: bool
    _last_work: float

    def _run(self) -> None:
        """The stepping thread's body: control, admission and one step per pass until closed;
        idle, it sleeps on ``_cv`` and wakes for work, the compile switch or a due capture."""
        with step_mode(self.runner.device):
            if self.compile_inline:  # before thread_start: start-up, not busy time
                start = time.perf_counter()
                self.runner.warm_compiled()
                self.stats_.warm_s = time.perf_counter() - start
            st = self.stats_
            if st.thread_start is None:
                st.thread_start = time.perf_counter()
            committed = False
            self._last_work = time.perf_counter()
            while True:
                if self._compile is not None:
                    self._maybe_switch(committed)
                if self._capture_while_idle():
                    continue
                with self._cv:
                    if not self._has_work():
                        st.idle_since = time.perf_counter()
                        while not self._has_work() and not self._switch_waits() and not self._capture_due():
                            self._cv.wait(self._idle_wait())
                        st.idle_s += time.perf_counter() - st.idle_since
                        st.idle_since = None
                        if not self._has_work():  # woken to switch to the compiled step functions, or to capture
                            continue
                    if self._closed and not self._waiting and not self.stepper.running:
                        self.stepper.drain()
                        return
                committed = self._control()
                self._last_work = time.perf_counter()
                if self._paused:
                    continue
                new: list[Request] = []
                phase = "prefill"
                try:
                    new = self._take_waiting() if self._admit_now() else []
                    if new or any(r.needs_prefill for r in self.stepper.running):
                        self.oom.tick()
                        self.stepper.admit(new)
                    if self.stepper.running:
                        phase = "decode"
                        self.oom.tick()
                        self.stepper.decode()
                    else:
                        self.stepper.drain()
                except torch.OutOfMemoryError as exc:  # a slowdown: park the step's rows (``oom``)
                    self._out_of_memory(exc, phase, new)
                except Exception as exc:  # keep serving: fail what was in the step
                    log.exception("engine step failed")
                    self.stepper.fail_all(f"engine step failed: {type(exc).__name__}: {exc}")
                self._last_work = time.perf_counter()

    def _capture_in(self) -> float | None:
        """Seconds until a missing decode graph is due (0 or less: now), counted from the last
        work; None where none may be captured while idle (``capture_graphs_when_idle`` off, none
        missing, paused for a weight update, or the engine's memory released). The requests of
        one batch arrive milliseconds apart (a worker's leases) and must not wait for captures
        in between; a sync run's train step leaves the engine idle for seconds."""
        graphs = self.runner.graphs
        if (graphs is None or not self.config.capture_graphs_when_idle or self.offloader.released
                or self._paused or not graphs.missing()):
            return None
        return self._last_work + IDLE_CAPTURE_S - time.perf_counter()

    def _capture_due(self) -> bool:
        """Nothing to step, and a missing graph is due (``_capture_in``)."""
        return not self._has_work() and (left := self._capture_in()) is not None and left <= 0

    def _idle_wait(self) -> float | None:
        """How long the idle stepping thread sleeps before it looks again (None: until
        notified): the compile child's poll, the time left to a due capture."""
        waits = [POLL_S] if self._compile is not None else []
        if (left := self._capture_in()) is not None:
            waits.append(max(0.0, left) + 1e-3)
        return min(waits, default=None)

    def _capture_while_idle(self) -> bool:
        """Capture one missing decode graph when one is due (``_capture_due``): the graphs come
        between requests, one bucket at a time, so a request that arrives meanwhile waits for
        one capture at most, and the first batch does not wait for all of them (the time to
        the first trained step). Returns whether one was captured."""
        with self._cv:
            if not self._capture_due():
                return False
        return self.runner.graphs.capture_next()

    def _switch_waits(self) -> bool:
        """An idle engine (no row in it, its memory held) whose compile child is done: the
        switch is due (``warmup``)."""
        return (self._compile is not None and not self.offloader.released and not self.stepper.running
                and self._compile.child.done())

    def _maybe_switch(self, committed: bool) -> None:
        """Switch to the compiled step functions where it costs least (``warmup``): with no
        request in the engine, at a weight commit, or after enough steps. Never while the
        engine's memory is released (``offload``): the warm-up writes into the KV cache."""
        switch = self._compile
        assert switch is not None
        if self.offloader.released:
            return
        with self._cv:
            idle = not self.stepper.running and not self._waiting
        if not switch.due(idle=idle, committed=committed):
            return
        self.stepper.drain()
        start = time.perf_counter()
        switch.switch()
        self.stats_.phase_s["compile"] += time.perf_counter() - start
        with self._cv:
            self.compile_stats, self._compile = switch.stats, None

    def _out_of_memory(self, exc: BaseException, phase: str, new: list[Request]) -> None:
        """Park every row of the failed step as an abort (a PARTIAL trajectory for the
        worker) and shrink the admission limits; with one row, fail it and what waits."""
        try:  # what the last good step sampled is kept where it can still be read back
            self.stepper.drain()
        except Exception:
            self.stepper.inflight = None
        unadmitted = [r for r in new if r.slot < 0 and r.finish is None and not r.aborted]
        rows = [*self.stepper.running, *unadmitted]
        longest = max((len(r.context) for r in rows), default=0)
        if self.oom.recover(len(rows), longest, phase, exc):
            self.stepper.prefill_tokens = self.oom.prefill_limit
            for r in unadmitted:  # taken from the queue but never admitted
                r.aborted = True
                self.stats_.counters["requests_aborted"] += 1
                r.resolve()
            for r in list(self.stepper.running):
                r.aborted = True
                self.stepper.release(r)
            return
        for r in unadmitted:
            r.fail(self.oom.fatal)
            self.stats_.counters["requests_failed"] += 1
            r.resolve()
        self.stepper.fail_all(self.oom.fatal)
        with self._cv:
            waiting, self._waiting = self._waiting, deque()
        for r in waiting:
            r.fail(self.oom.fatal)
            self.stats_.counters["requests_failed"] += 1
            r.resolve()

    def _has_work(self) -> bool:
        if self._closed or self._commits or self._draft_commits or self._abort_all or self._abort_rids:
            return True
        if self._pause_requested != self._paused:
            return True
        return not self._paused and (bool(self._waiting) or self.stepper.busy)

    def _control(self) -> bool:
        """Apply aborts, pauses and weight commits; returns whether a commit was applied."""
        with self._cv:
            aborts, abort_all = self._abort_rids, self._abort_all
            self._abort_rids, self._abort_all = set(), False
            commits, self._commits = self._commits, deque()
            draft_commits, self._draft_commits = self._draft_commits, deque()
            pause = self._pause_requested and not self._paused
            if pause or aborts or abort_all or commits or draft_commits:
                self.stepper.drain()  # act on a settled state
            if pause:
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
        for version, loop, fut in draft_commits:
            try:
                self._commit_draft(version)
                _set_soon(loop, fut, None)
            except Exception as exc:
                _set_soon(loop, fut, exc)
        for r in list(self.stepper.running):
            if abort_all or r.rid in aborts:
                r.aborted = True
                self.stepper.release(r)
        return bool(commits)

    def _commit(self, version: int, keep_kv_cache: bool) -> None:
        start = time.perf_counter()
        woke = False
        with self._stage_lock:
            if self.offloader.released:  # --offload-rollout: the memory comes back first
                missing = self.offloader.missing(set(self.stager.staged))
                if missing:
                    raise WeightError(f"--offload-rollout released the engine's weights, and this update does not "
                                      f"refill them ({len(missing)} missing, e.g. {missing[0]!r})")
                self.offloader.reacquire()
                woke = True
            self.stager.apply()  # waits for its copies on CUDA: the pause is all in here
            exact = self.wire.take_exact()  # this update's quantized layers as the trainer stored them
            if self.quant is not None:
                quant.refresh(self.model, exact)  # in place: captured graphs keep reading the same buffers
        self.swap_pauses.append(time.perf_counter() - start)
        self.stepper.version = version
        self.stats_.counters["weight_updates"] += 1
        if not keep_kv_cache:
            for r in self.stepper.running:
                r.needs_prefill = True
        if self.stager.adapters.layout_changed:  # new unmerged-adapter buffers
            self.stager.adapters.layout_changed = False
            self.offloader.drop_graphs()  # re-captured with them when next needed
        if woke:  # generate again
            with self._cv:
                self._pause_requested = self._paused = False
                self._cv.notify()

    def _commit_draft(self, version: int) -> None:
        with self._stage_lock:
            self.spec.drafter.stager.apply()
        self.spec.drafter.version = version
        self.spec.drafter.weights_changed(self.stepper.running)
        self.stats_.counters["draft_updates"] += 1

    def _admit_now(self) -> bool:
        """Whether this step admits the waiting requests (``EngineConfig.admit_min``): at
        once when nothing decodes, else once the admission would take ``admit_min`` of them
        (enough waiting and enough free slots: a full engine whose requests finish one by one
        must not admit one by one either) or the oldest waited long enough."""
        waiting = len(self._waiting)
        free = self.oom.batch_limit - len(self.stepper.running)
        if not waiting or free <= 0:
            return False
        running = self.stepper.running
        if (not running or min(waiting, free) >= self.config.admit_threshold()
                or self._deferred_steps >= self.config.admit_max_wait_steps
                or any(r.needs_prefill for r in running)):  # a prefill runs anyway: join it
            self._deferred_steps = 0
            return True
        self._deferred_steps += 1
        return False

    def _take_waiting(self) -> list[Request]:
        """Waiting requests that fit the free slots and the prefill token budget."""
        recompute = [r for r in self.stepper.running if r.needs_prefill]
        longest = max((len(r.context) for r in recompute), default=0)
        rows, new = len(recompute), []
        free = self.oom.batch_limit - len(self.stepper.running)
        with self._cv:
            while self._waiting and len(new) < free:
                nxt = self._waiting[0]
                new_longest = max(longest, len(nxt.context))
                if rows and new_longest * (rows + 1) > self.oom.prefill_limit:
                    break
                new.append(self._waiting.popleft())
                rows, longest = rows + 1, new_longest
        return new

    def _done(self, req: Request) -> None:
        if req.hidden is not None:
            hidden = req.hidden_states()
            if hidden is not None:
                self._hidden[req.rid] = hidden
        req.resolve()


def step_mode(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """The autograd mode the stepping thread runs in. On the CPU, inference_mode rather than
    no_grad: no version counters or view tracking on its tensors (13% of a tiny-model decode
    step); tensors made there are then inference tensors, and the ones handed out (hidden
    states) are cloned on the way out. CUDA keeps no_grad: its graphs and compiled steps were
    verified under it. Compiled graphs depend on the mode, so a compile child warms under it too."""
    return torch.inference_mode() if device.type == "cpu" else torch.no_grad()


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
