"""Reward evaluation: user functions run asynchronously, and never hang or crash a worker.

A reward function is ``fn(sample)`` or slime's ``fn(args, sample)``, sync or ``async def``;
it returns a float or a dict of named floats. Sync functions run in a thread pool so that
the worker's event loop keeps decoding; async ones are awaited. A timeout, an exception or
a non-finite value marks the trajectory FAILED with the reason in ``finish_reason`` and is
counted — the run goes on. ``RewardRunner`` is a plain class: the rollout worker uses it
in-process, and ``miles.actors.ray_actors`` wraps it as a reward-worker actor.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from miles.types import Reward, Status, Trajectory
from miles.utils.loading import load_function, positional_arity


class RewardRunner:
    """Scores finished trajectories with one user reward function."""

    def __init__(
        self,
        fn: Callable[..., Any] | str,
        *,
        timeout_s: float = 30.0,
        args: Any = None,
        max_threads: int = 8,
    ) -> None:
        self.fn = load_function(fn) if isinstance(fn, str) else fn
        self.timeout_s = timeout_s
        self.args = args
        self._takes_args = positional_arity(self.fn) >= 2
        self._is_async = inspect.iscoroutinefunction(self.fn)
        self._pool = ThreadPoolExecutor(max_workers=max_threads, thread_name_prefix="reward")
        self.counts: Counter[str] = Counter()
        self.total_time_s = 0.0

    def _call(self, sample: Trajectory) -> Any:
        return self.fn(self.args, sample) if self._takes_args else self.fn(sample)

    async def score(self, traj: Trajectory) -> Trajectory:
        """Set ``traj.reward``, or mark it FAILED with the reason. Returns the same object."""
        start = time.perf_counter()
        try:
            if self._is_async:
                value = await asyncio.wait_for(self._call(traj), self.timeout_s)
            else:
                loop = asyncio.get_running_loop()
                future = loop.run_in_executor(self._pool, self._call, traj)
                value = await asyncio.wait_for(future, self.timeout_s)
            traj.reward = check_reward(value)
            self.counts["ok"] += 1
        except asyncio.TimeoutError:
            # A hung sync function keeps its thread; the pool has spares, and the count
            # tells the operator. The trajectory is not lost: it is FAILED with a reason.
            self._fail(traj, f"reward_timeout: no result after {self.timeout_s}s")
        except RewardValueError as exc:
            self._fail(traj, f"reward_invalid: {exc}")
        except Exception as exc:  # the user's function raised
            self._fail(traj, f"reward_error: {type(exc).__name__}: {exc}")
        finally:
            self.total_time_s += time.perf_counter() - start
        return traj

    async def score_many(self, trajs: list[Trajectory]) -> list[Trajectory]:
        return list(await asyncio.gather(*(self.score(t) for t in trajs)))

    def _fail(self, traj: Trajectory, reason: str) -> None:
        self.counts[reason.split(":", 1)[0]] += 1
        traj.status = Status.FAILED
        traj.finish_reason = reason[:500]
        traj.reward = None

    def stats(self) -> dict[str, float]:
        out = {f"reward/{k}": float(v) for k, v in self.counts.items()}
        out["reward/time_s"] = self.total_time_s
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class RewardValueError(ValueError):
    """The reward function returned something that is not a finite float or dict of them."""


def check_reward(value: Any) -> Reward:
    if isinstance(value, bool) or value is None:
        raise RewardValueError(f"expected a float or dict of floats, got {value!r}")
    if isinstance(value, dict):
        if not value:
            raise RewardValueError("empty reward dict")
        out = {}
        for key, item in value.items():
            out[str(key)] = _finite(item, f"reward[{key!r}]")
        return out
    return _finite(value, "reward")


def _finite(value: Any, what: str) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise RewardValueError(f"{what} is not a number: {value!r}") from None
    if not math.isfinite(number):
        raise RewardValueError(f"{what} is not finite: {number}")
    return number
