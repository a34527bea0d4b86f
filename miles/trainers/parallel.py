"""Micro-batches side by side on a CPU trainer: each core its own micro-batch, no barriers.

A CPU trainer runs its ops on one thread (``configure_process`` gives each actor process
its share of the cores), and splitting one small op over two threads does not pay on a
shared host: an OpenMP team waits at every op's barrier for a thread the rollout engine may
hold. Whole micro-batches have no barrier to wait at. ``MicroBatchPool.run`` hands each
micro-batch to the first free thread: the calling thread at its own priority and helper
threads at the lowest (SCHED_IDLE), so a helper takes the CPU time that nothing else on the
host (the rollout engine beside the trainer) wants. When the caller has run out of
micro-batches it waits on its own core, where the scheduler moves a starved helper.
``EmbeddedTrainer`` builds one for a CPU trainer with a core to spare (``cpu_helpers``).

Each micro-batch's gradients come back from ``torch.autograd.grad`` and are added to the
parameters' ``.grad`` in micro-batch order, the sums ``backward()`` one micro-batch after
another makes: the gradients, the loss and its metrics are bitwise those of the serial
loop, whichever thread ran which micro-batch.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import torch
from torch import Tensor

from miles.trainers.config import TrainerConfig

Work = Callable[[int], Tensor | None]  # micro-batch i → its loss (the forward and loss run inside); None: no gradient


def cpu_helpers(device: torch.device) -> int:
    """How many helper threads a trainer on ``device`` gets: one per core of the process's
    affinity beyond the one it computes on, when its ops run on one thread (a GPU trainer,
    or one given several intra-op threads, gets none)."""
    if device.type != "cpu" or torch.get_num_threads() != 1 or not hasattr(os, "sched_getaffinity"):
        return 0
    return len(os.sched_getaffinity(0)) - 1


def _lowest_priority() -> None:
    """This thread runs only on a core nothing else wants: SCHED_IDLE (Linux; a weight of 3
    against nice 19's 15, so the helper barely slows a niced actor, as Ray's are, beside it),
    else nice 19. Both are per thread on Linux."""
    tid = threading.get_native_id()
    try:
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        return
    except (AttributeError, OSError):
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, tid, 19)
    except (AttributeError, OSError):
        pass


def finer_limits(limits: TrainerConfig, tokens: int, threads: int) -> TrainerConfig:
    """``limits`` with a token cap that cuts ``tokens`` into about two micro-batches per
    thread: a thread that gets less CPU time (a helper beside a busy engine) then takes fewer
    of them, where with one micro-batch each the step waits for the slower thread's."""
    cap = max(1, -(-tokens // (2 * threads)))
    if limits.max_tokens_per_micro_batch is not None and limits.max_tokens_per_micro_batch <= cap:
        return limits
    return msgspec.structs.replace(limits, max_tokens_per_micro_batch=cap)


class MicroBatchPool:
    """Helper threads that run micro-batches' forward, loss and backward beside the caller."""

    def __init__(self, helpers: int) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._serve, name=f"miles-microbatch-{i}", daemon=True)
                         for i in range(helpers)]
        for t in self._threads:
            t.start()

    def _serve(self) -> None:
        _lowest_priority()
        torch.set_num_threads(1)  # no-op on a one-thread process; keeps a helper from fanning out
        while (job := self._jobs.get()) is not None:
            job()

    @property
    def threads(self) -> int:
        """The caller and its helpers."""
        return len(self._threads) + 1

    def close(self) -> None:
        for _ in self._threads:
            self._jobs.put(None)

    def run(self, n: int, work: Work, params: Sequence[Tensor], context: Callable[[], Any]) -> None:
        """Run ``work(i)`` for i < n on the caller and the helpers, each micro-batch's backward
        on the thread that ran its forward, and add the gradients to ``params``' ``.grad`` in
        order i = 0, 1, … (a ``work`` that returns None ran without autograd: it adds nothing).
        ``context()`` is entered around each micro-batch on its thread
        (thread-local state, such as ``deferred_finite_checks``). The first error raised by a
        micro-batch is raised here, after every running one has finished."""
        grads: list[tuple[Tensor | None, ...] | None] = [None] * n
        errors: list[BaseException] = []
        lock = threading.Lock()
        todo = iter(range(n))
        done = threading.Semaphore(0)

        def take() -> int | None:
            with lock:
                return None if errors else next(todo, None)

        def drain() -> None:
            while (i := take()) is not None:
                try:
                    with context():
                        value = work(i)
                        grads[i] = None if value is None else torch.autograd.grad(value, params, allow_unused=True)
                except BaseException as exc:  # noqa: BLE001 (re-raised by the caller below)
                    with lock:
                        errors.append(exc)

        def helper() -> None:
            try:
                drain()
            finally:
                done.release()

        started = min(len(self._threads), n - 1)
        for _ in range(started):
            self._jobs.put(helper)
        drain()
        for _ in range(started):
            done.acquire()
        if errors:
            raise errors[0]
        for j, p in enumerate(params):
            parts = [g[j] for g in grads if g is not None and g[j] is not None]
            if not parts:
                continue
            total = parts[0].clone() if p.grad is None else p.grad.add_(parts[0])
            for part in parts[1:]:
                total = total.add_(part)
            p.grad = total
