"""Environments for the agentic integration tests (loaded in Ray workers by file path).

The prompt's label says how the episode behaves, so one run mixes kinds of episodes.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any


class LongShortEnv:
    """``label == "long"``: turns (each step a little slow) until the episode's model tokens
    come from ``span`` policy versions, or ``max_turns``; otherwise one turn. It reads the
    versions from the trajectory it was reset with (the runtime appends to that object)."""

    def __init__(self, span: int = 3, max_turns: int = 200, step_s: float = 0.05) -> None:
        self.span, self.max_turns, self.step_s = span, max_turns, step_s
        self.sample: Any = None
        self.n = 0

    def reset(self, sample: Any) -> str:
        self.sample = sample
        return ""

    def _spanned(self) -> int:
        return len({v for v, m in zip(self.sample.versions, self.sample.loss_mask) if m})

    async def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        self.n += 1
        done = True
        if self.sample.label == "long":
            await asyncio.sleep(self.step_s)
            done = self._spanned() >= self.span or self.n >= self.max_turns
        return f"turn {self.n}", float(len(action) % 2), done, {"n": self.n}


class FlakyEnv:
    """Misbehaves as the label says: "raise", "hang" (a blocking step, run in a thread),
    "hang_async" (the step's awaitable never finishes), "garbage"; else two good turns."""

    def __init__(self) -> None:
        self.kind = "ok"
        self.n = 0

    def reset(self, sample: Any) -> str:
        self.kind = str(sample.label)
        return ""

    def step(self, action: str) -> Any:
        self.n += 1
        if self.kind == "raise":
            raise RuntimeError("the sandbox crashed")
        if self.kind == "hang":
            time.sleep(2.0)
        if self.kind == "hang_async":
            return asyncio.sleep(30)  # awaited by the runtime on the worker's loop
        if self.kind == "garbage":
            return "oops"
        return "fine", float(len(action) % 2), self.n >= 2, {}
