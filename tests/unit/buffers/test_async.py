"""The async variants wait on one event loop (as in a Ray async actor); no threads."""

import asyncio

import pytest

from miles.buffers import BufferFull

from tests.unit.buffers.helpers import generate, make_buffer, prompts, run_groups


def test_get_batch_async_waits_for_enough_groups() -> None:
    async def main():
        buf = make_buffer()
        buf.add_prompts(prompts(3))
        waiter = asyncio.create_task(buf.get_batch_async(2, 0))
        for t in buf.lease("w", 3):
            await asyncio.sleep(0)
            assert not waiter.done()
            buf.put(generate(t, 0), "w")
            if buf.ledger().groups.ready >= 2:
                break
        batch = await asyncio.wait_for(waiter, 1.0)
        assert len(batch) == 2

    asyncio.run(main())


def test_get_batch_async_timeout_returns_empty() -> None:
    async def main():
        buf = make_buffer()
        run_groups(buf, 1)
        assert await buf.get_batch_async(2, 0, timeout=0.01) == []
        assert buf.ledger().groups.ready == 1

    asyncio.run(main())


def test_add_prompts_async_waits_for_room() -> None:
    async def main():
        buf = make_buffer(capacity=2)
        run_groups(buf, 2)
        adder = asyncio.create_task(buf.add_prompts_async(prompts(1, start=9)))
        await asyncio.sleep(0.01)
        assert not adder.done()
        buf.get_batch(1, 0)  # frees one slot
        gids = await asyncio.wait_for(adder, 1.0)
        assert len(gids) == 1 and buf.ledger().queued == 1
        with pytest.raises(BufferFull):
            await buf.add_prompts_async(prompts(1, start=20), timeout=0.01)
        with pytest.raises(BufferFull):  # can never fit: refused at once
            await buf.add_prompts_async(prompts(3, start=30))
        (t,) = buf.lease("w", 1)
        await buf.put_async(generate(t, 0), "w")
        assert buf.ledger().ready == 2

    asyncio.run(main())


def test_buffer_outlives_an_event_loop() -> None:
    """Waiters hold their own futures, so a buffer may be awaited from a later loop."""
    buf = make_buffer()
    assert asyncio.run(buf.get_batch_async(1, 0, timeout=0.01)) == []
    run_groups(buf, 1)
    assert len(asyncio.run(buf.get_batch_async(1, 0, timeout=1.0))) == 1
