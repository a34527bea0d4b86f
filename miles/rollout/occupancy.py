"""Occupancy: how much of a rollout worker's active window its episodes fill.

Both multi-turn generate functions, ``EnvRollout`` (``env/``) and ``miles.agent.AgentRollout``
(``agent/``), call ``change(+1)`` when an episode starts on the worker and ``change(-1)``
when it ends. ``stats(prefix)`` gives the integrals the worker reports:

- ``<prefix>/window_s``: from the first episode's start to now (the active window);
- ``<prefix>/busy_s``: the part of it with at least one episode in flight;
- ``<prefix>/episode_s``: ∫ episodes in flight dt over it.

So busy_s / window_s is the fraction of the window the worker had work, and
episode_s / (window_s · --max-inflight-per-worker) its mean slot occupancy
(``benchmarks/agentic.py`` reports both).
"""

from __future__ import annotations

import time
from collections.abc import Callable


class Occupancy:
    """Episodes in flight over time, integrated at every change."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.active = 0
        self.busy_s = 0.0
        self.episode_s = 0.0
        self._since: float | None = None
        self._last = 0.0

    def change(self, delta: int) -> None:
        """``delta`` episodes started (+) or ended (-) now; 0 brings the integrals up to now."""
        now = self.clock()
        if self._since is None:
            self._since = self._last = now
        dt = now - self._last
        self.episode_s += self.active * dt
        self.busy_s += dt if self.active else 0.0
        self.active += delta
        self._last = now

    def stats(self, prefix: str) -> dict[str, float]:
        """The integrals up to now (none before the first episode)."""
        if self._since is None:
            return {}
        self.change(0)
        return {f"{prefix}/episode_s": self.episode_s, f"{prefix}/busy_s": self.busy_s,
                f"{prefix}/window_s": self._last - self._since}
