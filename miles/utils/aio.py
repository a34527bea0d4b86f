"""The event loop miles runs on: uvloop where it is installed, asyncio's own loop otherwise.

Why: the driver and every actor spend their time in small awaits (buffer calls, weight
buckets, engine hand-offs, HTTP round trips), and uvloop's loop runs each of them at a
fraction of the default loop's cost. The driver's loop is made here (``run``). The actors'
loops are Ray's: an async actor's loop comes from Ray's ``get_new_event_loop``, which builds
a uvloop loop where uvloop imports (and ``RAY_USE_UVLOOP`` is not 0). ``loop_name`` says which
loop a coroutine is on (tests/unit/ and tests/integration/test_event_loop.py check both)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop constructor, or None (asyncio's default) where uvloop is missing or
    ``MILES_UVLOOP=0`` turns it off."""
    if os.environ.get("MILES_UVLOOP", "1") == "0":
        return None
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def run(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` on the loop ``loop_factory`` gives."""
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(main)


def loop_name(loop: asyncio.AbstractEventLoop | None = None) -> str:
    """"uvloop" or "asyncio": the implementation of ``loop`` (default: the running loop)."""
    loop = loop or asyncio.get_running_loop()
    return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"
