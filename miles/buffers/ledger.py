"""The accounting ledger: where every admitted trajectory (and group) is right now.

``ReplayBuffer.ledger()`` returns one :class:`Ledger`; the driver prints its ``summary()`` at
the end of a run, checkpoints carry the counters, and the scheduler reads ``groups`` to
learn how many groups are accepted and running. The invariant (docs/design.md, "Accounting"):
every admitted trajectory is exactly one of queued, in flight, partial, waiting, ready,
trained or dropped-with-reason, so the states always sum to ``admitted`` — ``check()``
raises otherwise.
"""

from __future__ import annotations

import msgspec


class LedgerError(AssertionError):
    """The ledger does not balance: something was lost or counted twice."""


class GroupLedger(msgspec.Struct, kw_only=True):
    """Groups (prompts): ``open`` = some member not finished yet (queued, in flight,
    partial, or finished and waiting for siblings); a dropped group may still have members
    in flight, which are dropped with the group's reason when they come back."""

    admitted: int = 0
    open: int = 0
    ready: int = 0
    trained: int = 0
    dropped: dict[str, int] = {}

    def check(self) -> None:
        total = self.open + self.ready + self.trained + sum(self.dropped.values())
        if total != self.admitted:
            raise LedgerError(f"groups: states sum to {total}, admitted {self.admitted}: {self}")


class Ledger(msgspec.Struct, kw_only=True):
    """Trajectory (sample) counts by state, plus event counters that are not states.

    States: ``queued`` (PENDING, not leased), ``in_flight`` (leased to a worker),
    ``partial`` (PARTIAL, in the unfinished queue), ``waiting`` (finished, its group not
    complete), ``ready`` (in a complete group not yet handed out), ``trained`` (handed out
    by ``get_batch``), ``dropped`` (by reason: ``stale``, ``failed``, ``evicted``, or a
    group filter's name).

    Events: ``recomputed`` (reset to PENDING by the "recompute" policy), ``recycled``
    (PARTIAL puts: unfinished trajectories sent back for resumption), ``masked_tokens``
    (loss zeroed by the "mask" policy), ``expired`` / ``released`` (leases returned to the
    queue because a worker timed out or was declared dead).
    """

    admitted: int = 0
    queued: int = 0
    in_flight: int = 0
    partial: int = 0
    waiting: int = 0
    ready: int = 0
    trained: int = 0
    dropped: dict[str, int] = {}
    recomputed: int = 0
    recycled: int = 0
    masked_tokens: int = 0
    expired: int = 0
    released: int = 0
    capacity: int = 0
    groups: GroupLedger = msgspec.field(default_factory=GroupLedger)

    @property
    def live(self) -> int:
        """Trajectories the buffer holds (counts against ``capacity``)."""
        return self.queued + self.in_flight + self.partial + self.waiting + self.ready

    @property
    def dropped_total(self) -> int:
        return sum(self.dropped.values())

    def check(self) -> None:
        """Raise LedgerError unless every admitted trajectory is in exactly one state."""
        counts = (self.queued, self.in_flight, self.partial, self.waiting, self.ready, self.trained)
        if min(counts) < 0 or any(v < 0 for v in self.dropped.values()):
            raise LedgerError(f"negative count: {self}")
        total = self.live + self.trained + self.dropped_total
        if total != self.admitted:
            raise LedgerError(f"states sum to {total}, admitted {self.admitted}: {self}")
        self.groups.check()

    def summary(self) -> str:
        """One human-readable block for the end-of-run report."""
        drops = ", ".join(f"{k}={v}" for k, v in sorted(self.dropped.items())) or "none"
        g = self.groups
        gdrops = ", ".join(f"{k}={v}" for k, v in sorted(g.dropped.items())) or "none"
        return (
            f"trajectories: admitted={self.admitted} trained={self.trained} "
            f"ready={self.ready} waiting={self.waiting} partial={self.partial} "
            f"in_flight={self.in_flight} queued={self.queued} dropped[{drops}]\n"
            f"events: recycled={self.recycled} recomputed={self.recomputed} "
            f"masked_tokens={self.masked_tokens} expired={self.expired} released={self.released}\n"
            f"groups: admitted={g.admitted} trained={g.trained} ready={g.ready} open={g.open} "
            f"dropped[{gdrops}]"
        )
