"""Waiting leases: a lease that finds nothing waits in the buffer and answers when work
arrives, wakes no more workers than the work serves, and loses nothing."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from miles.types import Status

from tests.unit.buffers.helpers import FakeClock, generate, make_buffer, prompts


def _wakes(log: list[str], name: str):
    return lambda: log.append(name)


def test_a_waiting_lease_answers_as_soon_as_prompts_arrive() -> None:
    async def main():
        buf = make_buffer(n_samples_per_prompt=2)
        waiting = asyncio.create_task(buf.lease_async("w", 4, wait_s=60.0))
        for _ in range(5):
            await asyncio.sleep(0)
        assert not waiting.done() and buf.ledger().in_flight == 0
        buf.add_prompts(prompts(1))
        got = await asyncio.wait_for(waiting, 10.0)  # woken, not left to its 60 s deadline
        assert sorted(t.id for t in got) == ["p0#0/0", "p0#0/1"]
        assert buf.leased("w") == [t.id for t in got] and not buf._lease_waiters

    asyncio.run(main())


def test_a_waiting_lease_returns_nothing_at_its_deadline_and_leaves_nothing_behind() -> None:
    async def main():
        buf = make_buffer()
        assert await buf.lease_async("w", 4, wait_s=0.01) == []
        assert not buf._lease_waiters and buf.leased("w") == []
        buf.add_prompts(prompts(1))  # nobody is woken for it: the next lease takes it
        assert [t.id for t in await buf.lease_async("v", 4, wait_s=0.01)] == ["p0#0/0"]

    asyncio.run(main())


def test_work_wakes_the_oldest_waiters_and_no_more_than_it_serves() -> None:
    buf = make_buffer(n_samples_per_prompt=2)
    woken: list[str] = []
    for name in ("a", "b", "c"):
        assert buf.lease_or_wait(name, 2, _wakes(woken, name)) == []
    buf.add_prompts(prompts(1))  # two trajectories: a's ask
    assert woken == ["a"]
    buf.put_many([])  # another change before a leases: a still counts, nobody else wakes
    assert woken == ["a"]
    buf.add_prompts(prompts(1, start=1))
    assert woken == ["a", "b"]
    assert len(buf.lease_or_wait("a", 2, _wakes(woken, "a"))) == 2
    assert len(buf.lease_or_wait("b", 2, _wakes(woken, "b"))) == 2
    assert woken == ["a", "b"] and list(buf._lease_waiters._by_worker) == ["c"]


def test_a_woken_waiter_that_goes_hands_its_work_on() -> None:
    buf = make_buffer()
    woken: list[str] = []
    buf.lease_or_wait("a", 1, _wakes(woken, "a"))
    buf.lease_or_wait("b", 1, _wakes(woken, "b"))
    buf.add_prompts(prompts(1))
    assert woken == ["a"]
    assert buf.cancel_wait("a")  # a stops before it leases
    assert woken == ["a", "b"]
    assert [t.id for t in buf.lease_or_wait("b", 1, _wakes(woken, "b"))] == ["p0#0/0"]


def test_returned_partials_and_expired_leases_wake_waiters() -> None:
    clock = FakeClock()
    buf = make_buffer(clock, lease_timeout_s=10.0)
    buf.add_prompts(prompts(2))
    first, second = buf.lease("x", 2)
    woken: list[str] = []
    buf.lease_or_wait("w", 1, _wakes(woken, "w"))
    buf.put(generate(first, 0, status=Status.PARTIAL), "x")  # recycled: leasable again
    assert woken == ["w"]
    assert [t.id for t in buf.lease_or_wait("w", 1, _wakes(woken, "w"))] == [first.id]
    buf.lease_or_wait("v", 1, _wakes(woken, "v"))
    clock.now = 11.0
    assert buf.expire_leases() == 2  # x's lease of ``second`` and w's of ``first`` lapse
    assert woken == ["w", "v"]
    assert buf.lease_or_wait("v", 1, _wakes(woken, "v"))[0].id in {first.id, second.id}


def test_cancel_wait_and_release_end_a_waiting_lease_without_leasing() -> None:
    async def main():
        buf = make_buffer()
        cancelled = asyncio.create_task(buf.lease_async("w", 4, wait_s=60.0))
        released = asyncio.create_task(buf.lease_async("v", 4, wait_s=60.0))
        await asyncio.sleep(0)
        assert buf.cancel_wait("w") and not buf.cancel_wait("nobody")
        buf.release_worker("v")  # the worker is gone: its waiting lease must not lease for it
        buf.add_prompts(prompts(2))
        assert await asyncio.wait_for(cancelled, 10.0) == []
        assert await asyncio.wait_for(released, 10.0) == []
        assert buf.ledger().queued == 2 and buf.ledger().in_flight == 0

    asyncio.run(main())


def test_unlease_gives_back_unstarted_work_as_it_was_leased() -> None:
    buf = make_buffer(n_samples_per_prompt=2)
    buf.add_prompts(prompts(1))
    a, b = buf.lease("x", 2)
    buf.put(generate(a, 0, status=Status.PARTIAL), "x")
    (again,) = buf.lease("w", 1)  # the partial, with its tokens
    assert again.id == a.id
    assert buf.unlease("w", [again.id]) == 1 and buf.unlease("w", [again.id]) == 0
    ledger = buf.ledger()
    ledger.check()
    assert ledger.partial == 1 and ledger.in_flight == 1 and ledger.released == 0 and ledger.expired == 0
    assert buf.leased("w") == [] and buf.leased("x") == [b.id]
    (back,) = buf.lease("w", 1)
    assert back.id == a.id and len(back.response_tokens) == 2 and back.status is Status.RUNNING


def test_concurrent_waiting_leases_lose_and_duplicate_nothing() -> None:
    async def main():
        buf = make_buffer(n_samples_per_prompt=3, capacity=1000)
        got: dict[str, list[str]] = {}

        async def worker(name: str) -> None:
            while True:
                leased = await buf.lease_async(name, 2, wait_s=60.0)
                if not leased:
                    return
                got.setdefault(name, []).extend(t.id for t in leased)
                buf.put_many([generate(t, 0) for t in leased], name)

        tasks = [asyncio.create_task(worker(f"w{i}")) for i in range(8)]
        for k in range(10):
            buf.add_prompts(prompts(k + 1, start=100 * k))  # 55 prompts, 165 trajectories
            for _ in range(3):
                await asyncio.sleep(0)
        while buf.ledger().waiting + buf.ledger().ready < 165:
            await asyncio.sleep(0.001)
        for i in range(8):
            buf.cancel_wait(f"w{i}")
        await asyncio.wait_for(asyncio.gather(*tasks), 10.0)
        ids = [tid for names in got.values() for tid in names]
        assert len(ids) == len(set(ids)) == 165
        ledger = buf.ledger()
        ledger.check()
        assert ledger.ready == 165 and ledger.in_flight == 0 and not buf._lease_waiters

    asyncio.run(main())


class _WalkingWaiters:
    """The reference: the waiter list walked from its oldest entry on every wake."""

    def __init__(self) -> None:
        self.by_worker: dict[str, list] = {}  # worker -> [need, woken]

    def add(self, wid: str, need: int) -> None:
        self.by_worker.pop(wid, None)
        self.by_worker[wid] = [need, False]

    def remove(self, wid: str) -> None:
        self.by_worker.pop(wid, None)

    def wake(self, leasable: int, log: list[str]) -> None:
        if leasable <= 0:
            return
        for wid, waiter in self.by_worker.items():
            if leasable <= 0:
                break
            leasable -= waiter[0]
            if not waiter[1]:
                waiter[1] = True
                log.append(wid)


@given(st.lists(st.tuples(st.sampled_from(["add", "remove", "wake"]), st.integers(0, 5),
                          st.integers(-3, 40)), max_size=80))
def test_waking_skips_the_woken_by_their_asks_as_a_walk_over_them_would(ops: list[tuple[str, int, int]]) -> None:
    """The woken waiters are always the oldest ones, so skipping them by the sum of their asks
    wakes exactly whom a walk over every waiter from the oldest wakes, in the same order."""
    from miles.buffers.waiting import LeaseWaiters

    fast, ref = LeaseWaiters(), _WalkingWaiters()
    got: list[str] = []
    want: list[str] = []
    for op, worker, arg in ops:
        wid = f"w{worker}"
        if op == "add":
            need = max(1, arg % 17)
            fast.add(wid, need, lambda w=wid: got.append(w))
            ref.add(wid, need)
        elif op == "remove":
            fast.remove(wid)
            ref.remove(wid)
        else:
            fast.wake(arg)
            ref.wake(arg, want)
        assert got == want
        assert list(fast._by_worker) == list(ref.by_worker)
        assert [w.woken for w in fast._by_worker.values()] == [v[1] for v in ref.by_worker.values()]


def test_a_waiting_lease_must_ask_for_something() -> None:
    from miles.buffers.waiting import LeaseWaiters

    with pytest.raises(ValueError, match="need"):
        LeaseWaiters().add("w", 0, lambda: None)
