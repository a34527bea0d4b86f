"""One thread for an actor's model work (train steps, weight export and packing).

Why not ``asyncio.to_thread``: it lands on whichever thread of asyncio's pool is free, and
each thread that runs torch ops gets its own OpenMP team; with more OpenMP threads than cores
libgomp wakes its workers through the kernel for every parallel region (miles.utils.blas says
more). On the CPU (2 cores, the countdown model) a policy train step's median was 277 / 254 /
298 ms on one compute thread against 289 / 298 / 320 ms through ``to_thread``, in three runs
(benchmarks/RESULTS.md, trainer compute thread 2026-12-01). One thread also keeps the steps of
one model in order, and on the thread that compiled or captured them.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any


class ComputeThread:
    """Runs calls one at a time on one named thread, awaited from the event loop."""

    def __init__(self, name: str) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    async def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))
