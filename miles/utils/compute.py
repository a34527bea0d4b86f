"""One thread for an actor's model work (train steps, weight export and packing).

Why not ``asyncio.to_thread``: it lands on whichever thread of asyncio's pool is free, and
each thread that runs torch ops gets its own OpenMP team; with more OpenMP threads than cores
libgomp wakes its workers through the kernel for every parallel region (miles.utils.blas says
more). On a 2-core CPU a policy train step is faster on one compute thread than through
``to_thread`` (benchmarks/log/history.md, trainer compute thread). One thread also keeps the steps of
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
