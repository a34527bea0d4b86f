"""Small named policies the buffer takes as callables: sampling, eviction, group filters.

* A **sampling policy** orders the ready groups for ``get_batch``: it receives them (as
  :class:`~miles.buffers.records.Group`) in the order they became ready and returns an
  iterable in hand-out order. ``fifo`` returns its input untouched, so ``get_batch`` stays
  O(batch) however many groups wait.
* An **eviction policy** orders ready groups for eviction when ``add_prompts`` needs room
  (only with ``eviction_policy`` set; without one the buffer refuses instead). Every
  eviction is a drop counted under ``"evicted"``.
* A **group filter** (dynamic sampling) sees one finished group's trajectories and returns
  True to keep it; a rejected group is dropped whole, counted under the filter's name
  (``filter_name``).

The config layer turns ``"pkg.mod:fn"`` strings into these (``miles.utils.loading``);
``priority`` builds a policy from a key.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from miles.buffers.records import Group
from miles.protocols import GroupFilter
from miles.types import Status, Trajectory

SamplingPolicy = Callable[[Iterable[Group]], Iterable[Group]]
EvictionPolicy = Callable[[Iterable[Group]], Iterable[Group]]

__all__ = ["EvictionPolicy", "GroupFilter", "SamplingPolicy", "drop_aborted", "drop_truncated",
           "drop_uniform_rewards", "evict_fifo", "evict_oldest", "fifo", "filter_name",
           "oldest_first", "priority"]

_NEWEST = float("inf")  # a group without loss tokens is never stale: it sorts as newest


def _oldest_key(group: Group) -> tuple[float, int]:
    oldest = group.oldest_version
    return (_NEWEST if oldest is None else oldest, group.ready_seq)


# ---- sampling ---------------------------------------------------------------------------


def fifo(groups: Iterable[Group]) -> Iterable[Group]:
    """Hand out groups in the order they became ready (the default)."""
    return groups


def oldest_first(groups: Iterable[Group]) -> Iterable[Group]:
    """Hand out the groups with the oldest loss tokens first (they go stale soonest)."""
    return sorted(groups, key=_oldest_key)


def priority(key: Callable[[Group], float], *, name: str | None = None) -> SamplingPolicy:
    """A policy handing out the highest ``key(group)`` first (ties: ready order)."""

    def by_priority(groups: Iterable[Group]) -> Iterable[Group]:
        return sorted(groups, key=lambda g: (-key(g), g.ready_seq))

    by_priority.__name__ = name or f"priority_{getattr(key, '__name__', 'key')}"
    return by_priority


# ---- eviction ---------------------------------------------------------------------------


def evict_oldest(groups: Iterable[Group]) -> Iterable[Group]:
    """Evict the groups with the oldest loss tokens first."""
    return sorted(groups, key=_oldest_key)


def evict_fifo(groups: Iterable[Group]) -> Iterable[Group]:
    """Evict the groups that have been ready longest first."""
    return groups


# ---- group filters ----------------------------------------------------------------------


def drop_uniform_rewards(group: Sequence[Trajectory], reward_key: str | None = None) -> bool:
    """Keep a group only if its rewards differ (DAPO's dynamic sampling): with equal
    rewards every GRPO advantage is zero, so the group only costs compute. Groups of one
    sample are kept (there is nothing to compare). ``reward_key``: the dict entry the
    trainer uses (the run binds ``--reward-key`` to any filter that takes this keyword)."""
    if len(group) < 2:
        return True
    first = group[0].scalar_reward(reward_key)
    return any(t.scalar_reward(reward_key) != first for t in group[1:])


def drop_aborted(group: Sequence[Trajectory]) -> bool:
    """Keep a group only if no member ended ABORTED (cut off without partial rollout)."""
    aborted = Status.ABORTED  # once: a member looked up on an enum class is slow
    return all(t.status is not aborted for t in group)


def drop_truncated(group: Sequence[Trajectory]) -> bool:
    """Keep a group only if no member hit the length limit (TRUNCATED)."""
    truncated = Status.TRUNCATED
    return all(t.status is not truncated for t in group)


def filter_name(fn: Callable[..., object]) -> str:
    """The reason a filter's drops are counted under: ``fn.name``, else ``fn.__name__``."""
    name = getattr(fn, "name", None) or getattr(fn, "__name__", None)
    return str(name) if name and name != "<lambda>" else type(fn).__name__
