"""The driver's loops beside the steps (admission, health checks): one that fails ends the
run with its error instead of leaving the steps waiting for data that never comes."""

from __future__ import annotations

import asyncio
import types

from miles.driver import Driver


def test_a_failed_loop_beside_the_steps_ends_the_run_with_its_error() -> None:
    async def go() -> Driver:
        d = Driver.__new__(Driver)
        d.stop, d.failure, d.ckpt = asyncio.Event(), None, None

        async def broken() -> None:
            raise RuntimeError("the buffer answered nonsense")

        task = asyncio.create_task(broken(), name="admission")
        task.add_done_callback(d._background_done)
        cancelled = asyncio.create_task(asyncio.sleep(10), name="health check")
        cancelled.add_done_callback(d._background_done)
        await asyncio.gather(task, return_exceptions=True)
        cancelled.cancel()
        await asyncio.gather(cancelled, return_exceptions=True)
        return d

    d = asyncio.run(go())
    assert d.stop.is_set()
    assert d.failure == ("the driver's admission loop failed: RuntimeError: the buffer answered nonsense"
                         "; no checkpoint was configured (--save)")


def test_a_cancelled_loop_is_no_failure() -> None:
    async def go() -> Driver:
        d = Driver.__new__(Driver)
        d.stop, d.failure, d.ckpt = asyncio.Event(), None, types.SimpleNamespace()
        task = asyncio.create_task(asyncio.sleep(10), name="admission")
        task.add_done_callback(d._background_done)
        await asyncio.sleep(0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return d

    d = asyncio.run(go())
    assert not d.stop.is_set() and d.failure is None
