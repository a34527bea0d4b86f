"""state_dict / load_state_dict: a resumed buffer continues with nothing lost or duplicated."""

import msgspec
import pytest

from miles.types import Status

from tests.unit.buffers.helpers import FakeClock, generate, make_buffer, prompts, snapshot


def _busy_buffer(clock: FakeClock):
    buf = make_buffer(clock, n_samples_per_prompt=2, max_staleness=2, lease_timeout_s=30.0)
    buf.add_prompts(prompts(4))
    leased = buf.lease("w1", 5)
    buf.put_many([generate(t, 0) for t in leased[:2]], "w1")  # group 0 ready
    buf.put(generate(leased[2], 0, status=Status.PARTIAL), "w1")
    buf.put(generate(leased[3], 0, status=Status.FAILED), "w1")  # waiting (group fails later)
    buf.set_version(1)
    return buf, leased


def test_round_trip_through_msgpack_is_exact() -> None:
    clock = FakeClock()
    buf, _ = _busy_buffer(clock)
    data = msgspec.msgpack.encode(buf.state_dict())
    fresh = make_buffer(clock, n_samples_per_prompt=2, max_staleness=2, lease_timeout_s=30.0)
    fresh.load_state_dict(msgspec.msgpack.decode(data))
    assert snapshot(fresh) == data
    assert fresh.ledger() == buf.ledger()
    assert fresh.stats() == buf.stats()


def test_resumed_buffer_continues_leases_and_queues() -> None:
    clock = FakeClock()
    buf, leased = _busy_buffer(clock)
    state = msgspec.msgpack.decode(msgspec.msgpack.encode(buf.state_dict()))
    fresh = make_buffer(clock, n_samples_per_prompt=2, max_staleness=2, lease_timeout_s=30.0)
    fresh.load_state_dict(state)
    # the old worker still holds leased[4]; its put is accepted exactly once
    fresh.put(generate(leased[4], 1), "w1")
    with pytest.raises(Exception, match="not leased"):
        fresh.put(generate(leased[4], 1), "w1")
    # queues continue in order: the partial first, then the pending ones
    nxt = fresh.lease("w2", 10)
    assert nxt[0].id == leased[2].id and nxt[0].versions == [0, 0]
    fresh.put_many([generate(t, 1) for t in nxt], "w2")
    trained = [t.id for g in fresh.get_batch(3, 1) for t in g]
    assert len(trained) == len(set(trained)) == 6
    led = fresh.ledger()
    assert led.dropped == {"failed": 2} and led.trained == 6 and led.live == 0
    led.check()


def test_lease_deadlines_survive_as_remaining_time() -> None:
    clock = FakeClock()
    buf, _ = _busy_buffer(clock)  # w1's deadline: 30 s after its last put at t=0
    clock.now = 20.0
    state = buf.state_dict()
    other = FakeClock()
    other.now = 1000.0  # a new process: another monotonic origin
    fresh = make_buffer(other, n_samples_per_prompt=2, max_staleness=2, lease_timeout_s=30.0)
    fresh.load_state_dict(state)
    other.now = 1009.0
    assert fresh.expire_leases() == 0
    other.now = 1010.0
    assert fresh.expire_leases() == 1


def test_bad_state_is_refused() -> None:
    clock = FakeClock()
    buf, _ = _busy_buffer(clock)
    state = buf.state_dict()
    with pytest.raises(ValueError, match="format"):
        make_buffer(clock).load_state_dict({**state, "format": 99})
    broken = {**state, "events": {**state["events"], "admitted": 1}}
    with pytest.raises(ValueError, match="does not balance"):
        make_buffer(clock).load_state_dict(broken)


def test_partial_and_in_flight_trajectories_survive_a_resume() -> None:
    """A checkpoint taken while a resumed partial trajectory is leased (in flight with a
    prefix), another is parked and fresh samples are in flight: after the load, the old run's
    leases come back once — the resumed one as PARTIAL with its prefix tokens, log-probs and
    versions, the fresh ones as queued — and every sample is trained exactly once."""
    clock = FakeClock()
    buf = make_buffer(clock, n_samples_per_prompt=2, max_staleness=4, lease_timeout_s=30.0)
    buf.add_prompts(prompts(2))
    first = buf.lease("w1", 4)
    buf.put(generate(first[0], 0, n_tokens=3, status=Status.PARTIAL), "w1")  # parked with a 3-token prefix
    buf.put(generate(first[1], 0, n_tokens=2, status=Status.PARTIAL), "w1")  # parked with a 2-token prefix
    buf.set_version(1)
    resumed = buf.lease("w2", 1)  # the partials come first: this one is now in flight with its prefix
    assert resumed[0].id == first[0].id and len(resumed[0].response_tokens) == 3
    state = msgspec.msgpack.decode(msgspec.msgpack.encode(buf.state_dict()))

    fresh = make_buffer(FakeClock(), n_samples_per_prompt=2, max_staleness=4, lease_timeout_s=30.0)
    fresh.load_state_dict(state)
    led = fresh.ledger()
    assert (led.in_flight, led.partial, led.queued) == (3, 1, 0)
    assert fresh.release_all_workers() == 3 and fresh.release_all_workers() == 0
    led = fresh.ledger()
    assert (led.in_flight, led.partial, led.queued) == (0, 2, 2)
    again = fresh.lease("w3", 4)
    prefix = {t.id: (t.response_tokens, t.logprobs, t.versions) for t in again if t.response_tokens}
    assert prefix == {first[0].id: ([0, 1, 2], [-0.5] * 3, [0, 0, 0]), first[1].id: ([0, 1], [-0.5] * 2, [0, 0])}
    assert {t.id for t in again[:2]} == set(prefix)  # the unfinished queue is served first
    fresh.put_many([generate(t, 1) for t in again], "w3")
    trained = [t.id for g in fresh.get_batch(2, 1) for t in g]
    assert sorted(trained) == sorted(t.id for t in first)
    led = fresh.ledger()
    assert led.trained == 4 and led.live == 0
    led.check()
