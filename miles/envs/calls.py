"""Calling into user environments safely: loading, timeouts, and checking what comes back.

Every call into an Env (its constructor, ``reset``, ``step``, ``close``) goes through
``EnvCaller.call``: a synchronous method runs in a thread pool so the worker's event loop
keeps decoding other episodes; an ``async def`` one is awaited; either way it is bounded by
``--turn-timeout-s``. Whatever goes wrong becomes an ``EnvFailure`` whose ``kind`` is one
of ``env_error`` (it raised), ``env_timeout`` (it hung) or ``env_invalid`` (it returned
something that is not what the Protocol says), and whose message says which call and why.
A hung synchronous call keeps its thread (Python cannot kill threads); the episode still
ends on time, and the pool has spare threads.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec

from miles.utils.loading import load_function


class EnvFailure(Exception):
    """An environment call failed; ``kind`` is the counted reason, str(self) the detail."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(detail)
        self.kind = kind

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:  # picklable across Ray actors
        return type(self), (self.kind, str(self))

    @property
    def reason(self) -> str:
        return f"{self.kind}: {self}"[:500]


class StepResult(msgspec.Struct, kw_only=True):
    observation: str
    reward: float
    done: bool
    truncated: bool = False
    info: dict[str, Any] = {}


def load_env_factory(env_path: str, env_kwargs: dict[str, Any] | None = None) -> Callable[[], Any]:
    """``--env-path`` + ``--env-kwargs`` → a no-argument callable that builds one Env."""
    target = load_function(env_path)  # a class is callable; LoadError names a bad path
    kwargs = dict(env_kwargs or {})

    def make_env() -> Any:
        env = target(**kwargs)
        missing = [m for m in ("reset", "step") if not callable(getattr(env, m, None))]
        if missing:
            raise EnvFailure("env_invalid", f"{env_path} built a {type(env).__name__} without {', '.join(missing)}()")
        return env

    make_env.__name__ = f"make_{getattr(target, '__name__', 'env')}"
    return make_env


class EnvCaller:
    """Runs Env methods with a timeout, sync ones in a thread pool.

    A synchronous call that times out keeps its thread until it returns, maybe never. When
    half of the pool's threads are stuck so, the pool is replaced by a fresh one (the stuck
    threads are abandoned, counted in ``pools_replaced``), so hung environments cannot
    starve the healthy ones of threads.
    """

    def __init__(self, *, timeout_s: float, threads: int) -> None:
        self.timeout_s = timeout_s
        self.threads = threads
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="miles-env")
        self.pools_replaced = 0
        self._stuck = 0  # timed-out calls still running in the current pool
        self._lock = threading.Lock()

    async def call(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        try:
            if inspect.iscoroutinefunction(fn):
                return await asyncio.wait_for(fn(*args), self.timeout_s)
            result = await self._in_thread(fn, *args)
            if inspect.isawaitable(result):  # a sync wrapper that returned a coroutine
                result = await asyncio.wait_for(result, self.timeout_s)
            return result
        except EnvFailure:
            raise
        except asyncio.TimeoutError:
            raise EnvFailure("env_timeout", f"{what} gave no result within {self.timeout_s}s") from None
        except Exception as exc:
            raise EnvFailure("env_error", f"{what} raised {type(exc).__name__}: {exc}") from exc

    async def _in_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        pool = self.pool
        job = pool.submit(fn, *args)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(job), self.timeout_s)
        except asyncio.TimeoutError:
            if not job.cancel():  # already running: its thread is stuck until it returns
                self._note_stuck(pool, job)
            raise

    def _note_stuck(self, pool: ThreadPoolExecutor, job: Any) -> None:
        with self._lock:
            if pool is not self.pool:
                return
            self._stuck += 1
            if self._stuck * 2 >= self.threads:
                self.pool = ThreadPoolExecutor(max_workers=self.threads, thread_name_prefix="miles-env")
                self._stuck = 0
                self.pools_replaced += 1
                pool.shutdown(wait=False, cancel_futures=False)
                return

        def unstuck(_: Any) -> None:
            with self._lock:
                if pool is self.pool:
                    self._stuck -= 1

        job.add_done_callback(unstuck)

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def check_reset(value: Any, *, allow_messages: bool) -> str | list[dict[str, Any]]:
    """``reset``'s return: a string (or, for chat templates, a list of chat messages)."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if allow_messages and isinstance(value, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value
    ):
        return value
    kinds = "a str or a list of {'role', 'content'} messages" if allow_messages else "a str"
    raise EnvFailure("env_invalid", f"reset returned {_describe(value)}, expected {kinds}")


def check_step(value: Any) -> StepResult:
    """``step``'s return: (observation, reward, done, info), or gymnasium's five-tuple
    (observation, reward, terminated, truncated, info)."""
    if not isinstance(value, (tuple, list)) or len(value) not in (4, 5):
        raise EnvFailure("env_invalid", f"step returned {_describe(value)}, expected (observation, reward, done, info)")
    if len(value) == 4:
        obs, reward, done, info = value
        truncated: Any = False
    else:
        obs, reward, done, truncated, info = value
    if obs is None:
        obs = ""
    if not isinstance(obs, str):
        raise EnvFailure("env_invalid", f"step returned an observation of type {type(obs).__name__}, expected str")
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(float(reward)):
        raise EnvFailure("env_invalid", f"step returned reward {reward!r}, expected a finite number")
    for name, flag in (("done", done), ("truncated", truncated)):
        if not isinstance(flag, (bool, int)) and hasattr(flag, "item"):  # numpy scalars
            flag = flag.item()
        if not isinstance(flag, (bool, int)) or isinstance(flag, float) or flag not in (0, 1):
            raise EnvFailure("env_invalid", f"step returned {name}={flag!r}, expected a bool")
    if info is not None and not isinstance(info, dict):
        raise EnvFailure("env_invalid", f"step returned info of type {type(info).__name__}, expected a dict")
    done, truncated = bool(done), bool(truncated)
    return StepResult(observation=obs, reward=float(reward), done=done or truncated,
                      truncated=truncated and not done, info=info or {})


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:80]}{'…' if len(text) > 80 else ''}"
