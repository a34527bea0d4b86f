"""The staleness logic of miles, in one module: the bound, the admission budget, the modes.

Staleness of a token trained at trainer version ``v_t`` is ``v_t - v_token``; the bound
``η`` (``--max-staleness``) must hold for every loss-carrying token. It is enforced twice:

* at **admission**, by :func:`admission` / :class:`Scheduler` (AReaL's rule): the driver does
  not start more prompts than the versions the trainer can still reach would consume;
* at **consumption**, by :class:`miles.buffers.ReplayBuffer`, which calls the token-level
  helpers below (:func:`is_doomed`, :func:`mask_stale_tokens`, :func:`mask_stale`, and
  :func:`loss_version_stats`, which lives in ``miles.types`` beside the trajectory's
  validation that computes it) and never hands out a loss token older than the bound.

Wiring: the driver builds one :class:`Scheduler` from a :class:`SchedulerConfig`, builds the
buffer with ``BufferConfig(max_staleness=scheduler.staleness, ...)``, and on every loop
iteration calls ``scheduler.admit(buffer.ledger(), buffer.prompt_room())`` (``observe`` then
``capacity``) to learn how many new prompts to admit. Nothing here knows about Ray or
asyncio, so ``benchmarks/simulate.py`` runs the same decision in simulated time.

Unbounded: ``--max-staleness inf`` (or ``unbounded``) sets η to :data:`UNBOUNDED`
(``math.inf``): no token is ever too old, and admission is then held back only by the caps that
stay finite, ``max_inflight`` (running groups) and the buffer's room (its ``capacity`` in live
trajectories), which the driver always passes. :func:`check_staleness` is the one place a value
of η is checked.

Units: the scheduler counts **groups** (one prompt = one group of ``n_samples_per_prompt``
trajectories), as AReaL counts rollouts and the trainer consumes ``rollout_batch_size``
groups per step.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from typing import TYPE_CHECKING, Any, Literal

import msgspec

from miles.types import LossStats, VersionRuns, loss_version_stats, version_runs

if TYPE_CHECKING:  # the buffer imports this module; avoid the cycle at runtime
    from miles.buffers.ledger import Ledger
    from miles.types import Trajectory

Mode = Literal["sync", "one-step-off", "async"]
MODES: tuple[str, ...] = ("sync", "one-step-off", "async")
UNBOUNDED = math.inf  # η without a bound: every token may be trained, however old
_UNBOUNDED_WORDS = ("inf", "infinity", "unbounded", "∞")


def check_staleness(value: Any) -> int | float:
    """η as the runtime holds it: a whole number ≥ 0, or :data:`UNBOUNDED`. Accepts the
    words ``inf`` / ``unbounded`` (a flag or a YAML value), digits, and whole floats
    (``2.0``); anything else is a ``ValueError`` that says what is allowed."""
    eta = value
    if isinstance(eta, str):
        text = eta.strip().lower()
        eta = UNBOUNDED if text in _UNBOUNDED_WORDS else int(text) if text.lstrip("-").isdigit() else None
    elif isinstance(eta, float) and eta.is_integer():
        eta = int(eta)
    if eta == UNBOUNDED or (isinstance(eta, int) and not isinstance(eta, bool) and eta >= 0):
        return eta
    raise ValueError(f"max_staleness must be a whole number >= 0, or inf / unbounded for no bound; got {value!r}")


def staleness_keys(max_staleness: int | float) -> range:
    """The staleness values a batch's histogram always reports (``buffer/staleness_hist/<k>``):
    0..η, or only 0 under an unbounded η (larger values appear as they are met)."""
    return range(1 if max_staleness == UNBOUNDED else max_staleness + 1)


# ---- token-level bound (used by the buffer) -----------------------------------------------


def within_bound(oldest: int | None, trainer_version: int, max_staleness: int | float) -> bool:
    """True when every loss token (the oldest decides) may be trained at ``trainer_version``."""
    return oldest is None or trainer_version - oldest <= max_staleness


def is_doomed(oldest: int | None, current_version: int, max_staleness: int | float) -> bool:
    """True when a trajectory can never be trained within the bound any more.

    The trainer's version never goes below the newest published version, so once
    ``current_version - oldest > η`` no later batch can take these tokens unmasked; resuming
    or keeping such a trajectory (under the drop/recompute policies) is wasted work.
    """
    return not within_bound(oldest, current_version, max_staleness)


def mask_stale_tokens(traj: Trajectory, trainer_version: int, max_staleness: int | float) -> int:
    """Zero ``loss_mask`` on tokens older than the bound (the "mask" policy); return how many.

    Mirrors slime's ``--mask-offpolicy-in-partial-rollout``: the tokens stay in the
    sequence as context, they just carry no loss.
    """
    cutoff = trainer_version - max_staleness  # tokens with version < cutoff are stale
    mask, versions = traj.loss_mask, traj.versions
    if versions == sorted(versions):  # one trajectory's versions only grow: the stale tokens are a prefix
        end = bisect_left(versions, cutoff)
        masked = mask[:end].count(1)
        if masked:
            mask[:end] = [0] * end  # loss_mask holds 0/1 (Trajectory.validate)
        return masked
    masked = 0
    for i, (version, m) in enumerate(zip(versions, mask)):
        if m and version < cutoff:
            mask[i] = 0
            masked += 1
    return masked


def mask_stale(
    traj: Trajectory, trainer_version: int, max_staleness: int | float, stats: LossStats,
    runs: VersionRuns | None = None,
) -> tuple[int, LossStats]:
    """``mask_stale_tokens``, and the loss tokens' stats after it (``loss_version_stats``),
    given their stats before (``stats``) and, where known, the versions' runs (``runs``,
    as ``Trajectory.validate_runs`` found them when the trajectory was put).

    When every token carries loss and the versions are ascending runs (``version_runs``,
    the case of a generation that spans weight updates), the stale tokens are a prefix
    and the new stats follow from the runs: no pass over the tokens but the mask's own
    write. A pass that compares each token with a version it is not (a sort, a count of 1s
    over a mask that holds 0s too) runs the slow compare path on every token, and made the
    mask policy the buffer's largest cost at a thousand workers; finding the runs again
    (a pass that copies every run) was most of what was left."""
    versions, mask = traj.versions, traj.loss_mask
    n = len(versions)
    if not (n and stats[1] == n):
        runs = None
    elif runs is None or runs[-1][1] != n:  # unknown, or not this list's (it changed length)
        runs = version_runs(versions)
    if runs is None:
        masked = mask_stale_tokens(traj, trainer_version, max_staleness)
        return masked, loss_version_stats(versions, mask)
    cutoff = trainer_version - max_staleness  # tokens with version < cutoff are stale
    end, stale_sum, start = 0, 0, 0
    for v, run_end in runs:
        if v >= cutoff:
            break
        stale_sum += v * (run_end - start)
        end = start = run_end
    if end:
        mask[:end] = [0] * end
    return end, (versions[end] if end < n else None, n - end, stats[2] - stale_sum)


# ---- admission -------------------------------------------------------------------------


def admission(
    *,
    version: int,
    batch_size: int,
    max_staleness: int | float,
    accepted: int,
    running: int,
    over_sampling_batch_size: int | None = None,
    max_inflight: int | None = None,
    room: int | None = None,
) -> int:
    """How many new prompts (groups) may start now; never negative.

    AReaL's rule: by the time the trainer is at version ``v`` it has consumed ``v·B`` groups,
    and it may still take groups generated now until version ``v + η``; so at most
    ``quota = (η + v + 1)·B`` groups may ever be accepted, and the room left is
    ``quota − (accepted + running)``.

    * ``accepted``: groups that finished and were accepted into the buffer, cumulative over
      the run — ready ones plus trained ones. Groups rejected by a filter never count;
      accepted groups later dropped (stale, evicted) or sent back for regeneration stop
      counting (they will not consume a training slot), which is what
      ``Scheduler.observe`` reads from the buffer's group ledger.
    * ``running``: groups admitted but not yet finished — queued, in flight, partial, or
      waiting for sibling samples.
    * ``over_sampling_batch_size`` (``O ≥ B``, dynamic sampling): while the quota is not yet
      filled, up to ``O − B`` extra groups may be running, to feed filters that will reject
      some. Once ``accepted ≥ quota`` nothing new starts until the version moves — so in
      sync mode the next batch never starts on old weights.
    * ``max_inflight`` caps ``running`` (concurrency); ``room`` is the buffer's free room in
      prompts (``ReplayBuffer.prompt_room()``), so admission never overfills the buffer.

    With ``max_staleness`` :data:`UNBOUNDED` the quota is infinite and these two caps are all
    that hold admission back; without either the answer would be infinite, a ``ValueError``.
    """
    for name, value in (("version", version), ("accepted", accepted), ("running", running)):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    check_staleness(max_staleness)
    if max_staleness == UNBOUNDED and max_inflight is None and room is None:
        raise ValueError("max_staleness is unbounded: admission needs max_inflight or room to stay finite")
    over = batch_size if over_sampling_batch_size is None else over_sampling_batch_size
    if over < batch_size:
        raise ValueError(f"over_sampling_batch_size {over} is smaller than batch_size {batch_size}")
    quota = (max_staleness + version + 1) * batch_size
    if accepted >= quota:
        return 0
    capacity = quota + (over - batch_size) - (accepted + running)
    if max_inflight is not None:
        capacity = min(capacity, max_inflight - running)
    if room is not None:
        capacity = min(capacity, room)
    return int(max(0, capacity))


def mode_staleness(mode: str, max_staleness: int | float) -> int | float:
    """η for a mode: sync → 0, one-step-off → 1, async → ``max_staleness``."""
    if mode == "sync":
        return 0
    if mode == "one-step-off":
        return 1
    if mode == "async":
        return check_staleness(max_staleness)
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


class SchedulerConfig(msgspec.Struct, kw_only=True):
    """Admission knobs; field names are the CLI flags (``--rollout-batch-size`` …)."""

    mode: str = "async"  # "sync" | "one-step-off" | "async"
    # η, read in "async" mode only (sync ⇒ 0, one-step-off ⇒ 1); inf or unbounded: no bound
    max_staleness: int | float = 1
    rollout_batch_size: int = 32  # B: groups the trainer consumes per step
    over_sampling_batch_size: int | None = None  # O ≥ B, for dynamic-sampling filters
    max_inflight: int | None = None  # cap on running groups; None = only the budget

    def __post_init__(self) -> None:
        self.max_staleness = check_staleness(self.max_staleness)
        mode_staleness(self.mode, self.max_staleness)  # validates the mode
        if self.rollout_batch_size < 1:
            raise ValueError(f"rollout_batch_size must be >= 1, got {self.rollout_batch_size}")
        over = self.over_sampling_batch_size
        if over is not None and over < self.rollout_batch_size:
            raise ValueError(
                f"over_sampling_batch_size ({over}) must be >= rollout_batch_size "
                f"({self.rollout_batch_size})"
            )
        if self.max_inflight is not None and self.max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {self.max_inflight}")

    @property
    def staleness(self) -> int | float:
        """The effective bound η for this mode (give it to ``BufferConfig.max_staleness``)."""
        return mode_staleness(self.mode, self.max_staleness)


class Scheduler:
    """The driver's admission state: version, accepted and running groups.

    Counts move either by events (``on_admitted``, ``on_finished``, ``on_dropped``) or, more
    robustly, by ``observe(buffer.ledger())``, which overwrites them with the buffer's group
    ledger (``accepted = ready + trained``, ``running = open``), so recomputes, lease
    expiries and drops inside the buffer can never make them drift.
    """

    def __init__(self, config: SchedulerConfig, *, version: int = 0) -> None:
        self.config = config
        self.version = version
        self.accepted = 0
        self.running = 0
        self.admitted = 0
        self.room: int | None = None  # the buffer's room at the last ``admit``

    @property
    def staleness(self) -> int | float:
        return self.config.staleness

    # ---- events --------------------------------------------------------------------
    def on_admitted(self, n: int) -> None:
        """``n`` new prompts were added to the buffer."""
        self.admitted += n
        self.running += n

    def on_finished(self, accepted: int = 0, rejected: int = 0) -> None:
        """Groups finished generating: ``accepted`` became ready, ``rejected`` were dropped."""
        self.running = max(0, self.running - accepted - rejected)
        self.accepted += accepted

    def on_dropped(self, n: int) -> None:
        """``n`` already-accepted groups were dropped before training (stale, evicted)."""
        self.accepted = max(0, self.accepted - n)

    def on_version(self, version: int) -> None:
        """A new policy version was published to the rollout workers."""
        if version < self.version:
            raise ValueError(f"version went backwards: {version} < {self.version}")
        self.version = version

    def observe(self, ledger: Ledger) -> None:
        """Take accepted/running from the buffer's group ledger (the source of truth)."""
        groups = ledger.groups
        self.accepted = groups.ready + groups.trained
        self.running = groups.open
        self.admitted = groups.admitted

    # ---- decision ------------------------------------------------------------------
    def admit(self, ledger: Ledger, room: int | None = None) -> int:
        """The driver's admission decision after a buffer state change: take the counts from
        the buffer's ledger, then return how many new prompts may start now."""
        self.observe(ledger)
        self.room = room
        return self.capacity(room)

    def capacity(self, room: int | None = None) -> int:
        """How many new prompts may start now (``room``: buffer room in prompts)."""
        cfg = self.config
        return admission(
            version=self.version,
            batch_size=cfg.rollout_batch_size,
            max_staleness=cfg.staleness,
            accepted=self.accepted,
            running=self.running,
            over_sampling_batch_size=cfg.over_sampling_batch_size,
            max_inflight=cfg.max_inflight,
            room=room,
        )

    def stats(self) -> dict[str, float]:
        return {
            "scheduler/version": float(self.version),
            "scheduler/accepted": float(self.accepted),
            "scheduler/running": float(self.running),
            "scheduler/capacity": float(self._reported_capacity()),
        }

    def _reported_capacity(self) -> int | float:
        """The budget as the stats report it: without the buffer's room (bounded η), as
        before, or with the room of the last ``admit`` (unbounded η: else infinite)."""
        cfg = self.config
        if cfg.staleness != UNBOUNDED:
            return self.capacity()
        if cfg.max_inflight is None and self.room is None:
            return UNBOUNDED
        return self.capacity(self.room)

    def state_dict(self) -> dict[str, Any]:
        return {"version": self.version, "accepted": self.accepted, "running": self.running,
                "admitted": self.admitted}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.version = int(state["version"])
        self.accepted = int(state["accepted"])
        self.running = int(state["running"])
        self.admitted = int(state.get("admitted", 0))
