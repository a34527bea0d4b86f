"""Leases: expiry and worker death return work exactly once; late puts are refused."""

import pytest

from miles.types import Status, TrajectoryError

from tests.unit.buffers.helpers import FakeClock, generate, make_buffer, prompts


def test_expired_lease_returns_work_once_and_late_put_is_refused() -> None:
    clock = FakeClock()
    buf = make_buffer(clock, lease_timeout_s=10.0)
    buf.add_prompts(prompts(2))
    a, b = buf.lease("w", 2)
    buf.put(generate(a, 0, status=Status.PARTIAL), "w")  # a put is a sign of life
    (a,) = buf.lease("w", 1)
    clock.now = 9.0
    assert buf.expire_leases() == 0
    clock.now = 10.0
    assert buf.expire_leases() == 2
    assert buf.expire_leases() == 0  # exactly once
    led = buf.ledger()
    assert (led.partial, led.queued, led.in_flight, led.expired) == (1, 1, 0, 2)
    with pytest.raises(TrajectoryError, match="not leased"):
        buf.put(generate(b, 0), "w")
    # the work goes to the next worker: partial first, with its prefix
    again = buf.lease("w2", 2)
    assert [t.id for t in again] == [a.id, b.id] and again[0].versions == [0, 0]


def test_renew_extends_all_leases() -> None:
    clock = FakeClock()
    buf = make_buffer(clock, lease_timeout_s=10.0)
    buf.add_prompts(prompts(2))
    buf.lease("w", 2)
    clock.now = 8.0
    assert buf.renew("w") == []
    clock.now = 15.0
    assert buf.expire_leases() == 0
    clock.now = 18.0
    assert buf.expire_leases() == 2
    assert buf.renew("w") == []  # unknown worker: nothing to do


def test_release_worker_returns_partial_or_pending() -> None:
    buf = make_buffer()
    buf.add_prompts(prompts(3))
    buf.lease("w", 1)
    (t,) = buf.lease("dead", 1)
    buf.put(generate(t, 0, status=Status.PARTIAL), "dead")
    buf.lease("dead", 2)  # the partial and one fresh prompt
    assert buf.release_worker("dead") == 2
    assert buf.release_worker("dead") == 0
    led = buf.ledger()
    assert (led.partial, led.queued, led.in_flight, led.released) == (1, 1, 1, 2)
    assert buf.leased("dead") == [] and len(buf.leased("w")) == 1


def test_in_process_mutation_is_cut_back_on_release() -> None:
    """In-process the worker edits the very object it leased; a release restores the
    lease-time prefix and detaches the buffer from the dead worker's object."""
    buf = make_buffer()
    buf.add_prompts(prompts(1))
    (t,) = buf.lease("w", 1)
    t.append([5, 6], [-0.1, -0.2], 0)
    t.status = Status.PARTIAL
    buf.put(t, "w")
    (t,) = buf.lease("w", 1)
    t.append([7], [-0.3], 0)  # then the worker dies mid-generation
    t.reward = 2.0
    buf.release_worker("w")
    (again,) = buf.lease("w2", 1)
    assert again is not t
    assert again.response_tokens == [5, 6] and again.reward is None
    assert [len(again.logprobs), len(again.versions), len(again.loss_mask)] == [2, 2, 2]
    t.append([8], [-0.4], 0)  # the zombie writes on: the buffer's copy does not change
    assert again.response_tokens == [5, 6]
    again.validate()


def test_dropped_group_member_in_flight_is_dropped_on_release() -> None:
    buf = make_buffer(max_staleness=0, n_samples_per_prompt=2)
    buf.add_prompts(prompts(1))
    a, _ = buf.lease("w", 2)
    buf.put(generate(a, 0), "w")
    buf.set_version(1)  # a is doomed: its group goes, b is still in flight
    assert buf.release_worker("w") == 1
    led = buf.ledger()
    assert led.dropped == {"stale": 2} and led.live == 0
    led.check()


def test_lease_nothing_available_still_counts_as_life() -> None:
    clock = FakeClock()
    buf = make_buffer(clock, lease_timeout_s=10.0)
    buf.add_prompts(prompts(1))
    buf.lease("w", 1)
    clock.now = 9.0
    assert buf.lease("w", 4) == []
    clock.now = 12.0
    assert buf.expire_leases() == 0


def test_release_all_workers_after_checkpoint_load() -> None:
    """A resumed run: leases of the old run's workers go back once, state-dict round trip."""
    from miles.buffers import ReplayBuffer

    buf = make_buffer()
    buf.add_prompts(prompts(3))
    buf.lease("a", 1)
    buf.lease("b", 2)
    fresh = ReplayBuffer(buf.config)
    fresh.load_state_dict(buf.state_dict())
    assert fresh.ledger().in_flight == 3
    assert fresh.release_all_workers() == 3
    assert fresh.release_all_workers() == 0
    led = fresh.ledger()
    assert (led.in_flight, led.queued) == (0, 3)
    led.check()


def test_put_and_lease_returns_then_leases_and_leases_nothing_when_the_put_is_refused() -> None:
    buf = make_buffer(n_samples_per_prompt=2)
    buf.add_prompts(prompts(2))
    a, b = buf.lease("w", 2)
    # a PARTIAL put comes first, so the lease after it in the same call gets it back first
    again = buf.put_and_lease([generate(a, 0, status=Status.PARTIAL)], "w", 2)
    assert [t.id for t in again][:1] == [a.id] and len(again) == 2
    assert buf.ledger().in_flight == 3
    bad = generate(b, 0)
    bad.logprobs = bad.logprobs[:-1]
    with pytest.raises(TrajectoryError, match="logprobs"):
        buf.put_and_lease([bad], "w", 4)
    led = buf.ledger()
    assert (led.in_flight, led.queued, led.waiting) == (3, 1, 0)  # nothing put, nothing leased
    assert buf.put_and_lease([], "w", 4)[0].id not in {a.id, b.id}  # an empty put only leases
