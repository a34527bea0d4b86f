"""Reward evaluation: user functions run asynchronously, and never hang or crash a worker.

A reward function is ``fn(sample)`` or slime's ``fn(args, sample)``, sync or ``async def``;
it returns a float or a dict of named floats. Sync functions run on threads of their own so that
the worker's event loop keeps decoding (an idle thread is reused, or a new one starts: a call
never queues behind another); async ones are awaited. A timeout, an exception or
a non-finite value marks the trajectory FAILED with the reason in ``finish_reason`` and is
counted — the run goes on. ``RewardRunner`` is a plain class: the rollout worker uses it
in-process, and ``miles.actors.ray_actors`` wraps it as a reward-worker actor.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
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
    ) -> None:
        self.fn = load_function(fn) if isinstance(fn, str) else fn
        self.timeout_s = timeout_s
        self.args = args
        self._takes_args = positional_arity(self.fn) >= 2
        self._is_async = inspect.iscoroutinefunction(self.fn)
        self._threads = 0  # sync calls running now (hung ones included)
        self._pool = _Threads()
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
                value = await asyncio.wait_for(self._in_thread(traj), self.timeout_s)
            traj.reward = check_reward(value)
            self.counts["ok"] += 1
        except asyncio.TimeoutError:
            # The trajectory is not lost: it is FAILED with a reason. A hung sync function
            # keeps its own thread (Python cannot kill it) but blocks no other call.
            self._fail(traj, f"reward_timeout: no result after {self.timeout_s}s")
        except RewardValueError as exc:
            self._fail(traj, f"reward_invalid: {exc}")
        except Exception as exc:  # the user's function raised
            self._fail(traj, f"reward_error: {type(exc).__name__}: {exc}")
        finally:
            self.total_time_s += time.perf_counter() - start
        return traj

    def _in_thread(self, traj: Trajectory) -> asyncio.Future[Any]:
        """Run the sync function on a thread of its own (``_Threads``): unlike a fixed pool,
        calls that hang forever cannot starve the next ones."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()

        def settle(value: Any, error: BaseException | None) -> None:
            if not future.done():
                future.set_exception(error) if error is not None else future.set_result(value)

        def target() -> None:
            self._threads += 1
            try:
                value, error = self._call(traj), None
            except BaseException as exc:  # delivered to the awaiting coroutine
                value, error = None, exc
            finally:
                self._threads -= 1
            if not loop.is_closed():
                loop.call_soon_threadsafe(settle, value, error)

        self._pool.submit(target)
        return future

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
        out["reward/threads_running"] = float(self._threads)
        return out

    def close(self) -> None:
        """Let the idle threads end (busy ones are daemons and end with the process)."""
        self._pool.close()


class _Threads:
    """Daemon threads for sync calls, each running one call at a time: a call goes to an
    idle thread, or to a new one when none is idle, so it never waits behind a running (or
    hung) call. Reusing threads matters on a busy worker: starting one per call waits for
    the new thread to be scheduled while the engine's stepping thread holds the GIL."""

    KEEP = 64  # idle threads kept for the next calls; more end

    def __init__(self) -> None:
        self._idle: list[queue.SimpleQueue[Callable[[], None] | None]] = []
        self._lock = threading.Lock()

    def submit(self, call: Callable[[], None]) -> None:
        with self._lock:
            inbox = self._idle.pop() if self._idle else None
        if inbox is None:
            inbox = queue.SimpleQueue()
            threading.Thread(target=self._serve, args=(inbox,), name="reward", daemon=True).start()
        inbox.put(call)

    def _serve(self, inbox: queue.SimpleQueue[Callable[[], None] | None]) -> None:
        while (call := inbox.get()) is not None:
            call()  # never raises: the caller's function catches and delivers its errors
            with self._lock:
                if len(self._idle) >= self.KEEP:
                    return
                self._idle.append(inbox)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for inbox in idle:
            inbox.put(None)


class RewardValueError(ValueError):
    """The reward function returned something that is not a finite float or dict of them."""


def check_reward(value: Any) -> Reward:
    """A reward as the trainer takes it: a finite float, or a non-empty dict of them. Numbers of
    any numeric type pass (ints, numpy and 0-d torch scalars); booleans, strings and None do not:
    ``"1.0"`` or ``True`` is almost always a reward function's bug (a parsed label returned
    unconverted, a comparison returned as is), which a silent ``float()`` would hide."""
    if value is None:
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
    if isinstance(value, (str, bytes)) or type(value).__name__ in ("bool", "bool_"):  # numpy's bools too
        raise RewardValueError(f"{what} is not a number: {value!r} ({type(value).__name__}); "
                               "return a float (e.g. float(correct))")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise RewardValueError(f"{what} is not a number: {value!r}") from None
    if not math.isfinite(number):
        raise RewardValueError(f"{what} is not finite: {number}")
    return number
