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
    """The waiting leases in registration order (oldest first)."""

    def __init__(self) -> None:
        self._by_worker: dict[str, Waiter] = {}

    def __bool__(self) -> bool:
        return bool(self._by_worker)

    def __len__(self) -> int:
        return len(self._by_worker)

    def get(self, worker_id: str) -> Waiter | None:
        return self._by_worker.get(worker_id)

    def add(self, worker_id: str, need: int, wake: Callable[[], None]) -> Waiter:
        """Register the worker's waiting lease, last in line (replacing one it had)."""
        self._by_worker.pop(worker_id, None)
        waiter = self._by_worker[worker_id] = Waiter(need, wake)
        return waiter

    def remove(self, worker_id: str) -> Waiter | None:
        return self._by_worker.pop(worker_id, None)

    def wake(self, leasable: int) -> None:
        """Wake waiters, oldest first, until their asks cover ``leasable`` trajectories.
        ``wake`` callables must not call back into the buffer: they only schedule the
        waiter's next lease."""
        if leasable <= 0:
            return
        for waiter in self._by_worker.values():
            if leasable <= 0:
                break
            leasable -= waiter.need
            if not waiter.woken:
                waiter.woken = True
                waiter.wake()
