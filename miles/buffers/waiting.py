"""Waiting leases: a rollout worker that finds nothing to lease waits in the buffer for work
instead of polling for it.

A starved worker's empty leases would otherwise be most of the buffer's calls: under a
binding staleness bound a thousand workers polling every few tens of milliseconds make
hundreds of thousands of calls a training step, each one finding nothing. Here a lease that
finds nothing registers how many trajectories it asks for and a ``wake`` callable; when work
becomes leasable the buffer (``BufferCore._notify``) wakes the waiters oldest first until
their asks cover that work. A waiter woken and not yet served still counts against it, so
a burst of puts after an admission wakes about as many workers as the admitted work can
serve, not all of them, and a buffer with nothing leasable wakes nobody at O(1) cost.

``ReplayBuffer.lease_async`` waits on an asyncio future through this (the path of the Ray
actor and of every rollout worker); ``benchmarks/simulate.py`` wakes its modelled workers
through it in simulated time. A worker has at most one waiting lease: registering again
replaces the previous one.
"""

from __future__ import annotations

from collections.abc import Callable


class Waiter:
    """One worker's waiting lease: how many it asks for, how to wake it, whether it was."""

    __slots__ = ("need", "wake", "woken")

    def __init__(self, need: int, wake: Callable[[], None]) -> None:
        self.need = need
        self.wake = wake
        self.woken = False


class LeaseWaiters:
    """The waiting leases in registration order (oldest first).

    Waking goes oldest first and stops once the asks cover the work, and a new waiter goes
    last, so the woken waiters are always the oldest ones: a wake skips them by the sum of
    their asks (``_woken_need``) and walks only the sleeping ones (``_asleep``, in order).
    A walk over the woken ones instead ran on every buffer change while work was leasable,
    over every woken worker that had not leased yet: at a thousand workers, after an
    admission, hundreds of them on each put."""

    def __init__(self) -> None:
        self._by_worker: dict[str, Waiter] = {}
        self._asleep: dict[str, Waiter] = {}  # the ones not woken yet, oldest first
        self._woken_need = 0  # the asks of the woken ones

    def __bool__(self) -> bool:
        return bool(self._by_worker)

    def __len__(self) -> int:
        return len(self._by_worker)

    def get(self, worker_id: str) -> Waiter | None:
        return self._by_worker.get(worker_id)

    def add(self, worker_id: str, need: int, wake: Callable[[], None]) -> Waiter:
        """Register the worker's waiting lease, last in line (replacing one it had).
        ``need`` must be >= 1 (a lease asks for something)."""
        if need < 1:
            raise ValueError(f"need must be >= 1, got {need}")
        self.remove(worker_id)
        waiter = self._by_worker[worker_id] = self._asleep[worker_id] = Waiter(need, wake)
        return waiter

    def remove(self, worker_id: str) -> Waiter | None:
        waiter = self._by_worker.pop(worker_id, None)
        if waiter is not None:
            if waiter.woken:
                self._woken_need -= waiter.need
            else:
                del self._asleep[worker_id]
        return waiter

    def wake(self, leasable: int) -> None:
        """Wake waiters, oldest first, until their asks cover ``leasable`` trajectories.
        ``wake`` callables must not call back into the buffer: they only schedule the
        waiter's next lease."""
        leasable -= self._woken_need
        if leasable <= 0 or not self._asleep:
            return
        woken = []
        for wid, waiter in self._asleep.items():
            if leasable <= 0:
                break
            leasable -= waiter.need
            woken.append(wid)
        asleep = self._asleep
        for wid in woken:
            waiter = asleep.pop(wid)
            waiter.woken = True
            self._woken_need += waiter.need
            waiter.wake()
