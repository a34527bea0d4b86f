"""What happens to tokens older than the bound under drop / recompute / mask."""

import pytest

from miles.types import Status

from tests.unit.buffers.helpers import generate, make_buffer, prompts, run_groups


def _loss_staleness_ok(batch, trainer_version: int, eta: int) -> bool:
    return all(
        trainer_version - v <= eta
        for group in batch for t in group for v, m in zip(t.versions, t.loss_mask) if m
    )


def test_drop_at_get_batch_drops_whole_group() -> None:
    buf = make_buffer(max_staleness=1, n_samples_per_prompt=2)
    run_groups(buf, 2, version=0)
    # the trainer is ahead of what the buffer was told: get_batch still enforces the bound
    assert buf.get_batch(1, 2) == []
    led = buf.ledger()
    assert led.dropped == {"stale": 4} and led.groups.dropped == {"stale": 2}
    led.check()


def test_drop_at_version_bump_keeps_groups_whole() -> None:
    buf = make_buffer(max_staleness=1, n_samples_per_prompt=2)
    buf.add_prompts(prompts(1))
    a, b = buf.lease("w", 2)
    buf.put(generate(a, 0), "w")  # a waits for b
    buf.set_version(2)  # a's tokens can never be trained now
    led = buf.ledger()
    assert (led.waiting, led.in_flight, led.dropped) == (0, 1, {"stale": 1})
    assert buf.renew("w") == [b.id]  # the worker learns its work is moot
    buf.put(generate(b, 2), "w")  # accepted, and dropped with its group
    led = buf.ledger()
    assert led.dropped == {"stale": 2} and led.groups.dropped == {"stale": 1} and led.live == 0
    led.check()


def test_drop_stale_partial_on_put_and_lease() -> None:
    buf = make_buffer(max_staleness=1)
    buf.add_prompts(prompts(2))
    a, b = buf.lease("w", 2)
    buf.set_version(2)
    buf.put(generate(a, 0, status=Status.PARTIAL), "w")  # doomed on arrival
    buf.put(generate(b, 1, status=Status.PARTIAL), "w")  # fine at version 2
    assert buf.ledger().dropped == {"stale": 1} and buf.ledger().partial == 1
    buf.set_version(3)  # now b is doomed too: dropped by the sweep
    assert buf.lease("w", 5) == []
    assert buf.ledger().dropped == {"stale": 2}


def test_recompute_resets_stale_members_only() -> None:
    buf = make_buffer(max_staleness=1, stale_policy="recompute", n_samples_per_prompt=2)
    buf.add_prompts(prompts(1))
    a, b = buf.lease("w", 2)
    buf.put(generate(a, 0), "w")
    buf.set_version(1)
    buf.put(generate(b, 1), "w")
    assert buf.ledger().groups.ready == 1
    assert buf.get_batch(1, 2) == []  # a is too old for version 2: regenerate it
    led = buf.ledger()
    assert (led.recomputed, led.queued, led.waiting, led.ready, led.groups.open) == (1, 1, 1, 0, 1)
    (again,) = buf.lease("w", 1)
    assert again.id == a.id and again.response_tokens == [] and again.reward is None
    buf.set_version(2)
    buf.put(generate(again, 2), "w")
    (group,) = buf.get_batch(1, 2)
    assert _loss_staleness_ok([group], 2, 1)
    assert [t.versions for t in group] == [[2, 2], [1, 1]]
    buf.ledger().check()


def test_recompute_stale_partial_at_lease_time() -> None:
    buf = make_buffer(max_staleness=0, stale_policy="recompute")
    buf.add_prompts(prompts(1))
    (t,) = buf.lease("w", 1)
    buf.put(generate(t, 0, status=Status.PARTIAL), "w")
    # simulate a version moving without a sweep (e.g. state restored from an older run)
    buf._version = 1
    (again,) = buf.lease("w", 1)
    assert again.response_tokens == [] and buf.ledger().recomputed == 1


def test_mask_zeroes_only_stale_tokens() -> None:
    buf = make_buffer(max_staleness=1, stale_policy="mask")
    buf.add_prompts(prompts(1))
    (t,) = buf.lease("w", 1)
    buf.put(generate(t, 0, status=Status.PARTIAL), "w")
    buf.set_version(2)  # masking never drops on a version bump
    (t,) = buf.lease("w", 1)
    assert t.versions == [0, 0]
    buf.put(generate(t, 2, n_tokens=3), "w")
    assert buf._recs[t.id].runs == [(0, 2), (1, 2), (2, 5)]  # kept from the put's check for the mask
    (group,) = buf.get_batch(1, 2)
    assert group[0].loss_mask == [0, 0, 1, 1, 1]
    assert _loss_staleness_ok([group], 2, 1)
    assert buf.ledger().masked_tokens == 2 and buf.stats()["buffer/batch_masked_tokens"] == 2
    assert buf.stats()["buffer/staleness_max"] == 0


@pytest.mark.parametrize("policy", ["drop", "recompute", "mask"])
def test_bound_holds_for_every_handed_out_token(policy) -> None:
    eta = 1
    buf = make_buffer(max_staleness=eta, stale_policy=policy, n_samples_per_prompt=2)
    handed = []
    for version in range(6):
        buf.set_version(version)
        buf.add_prompts(prompts(2, start=10 * version))
        for t in buf.lease("w", 3):
            status = Status.PARTIAL if version % 2 else Status.COMPLETED
            buf.put(generate(t, max(0, version - 1), status=status), "w")
        batch = buf.get_batch(1, version)
        assert _loss_staleness_ok(batch, version, eta)
        handed += [t.id for g in batch for t in g]
    assert len(handed) == len(set(handed))
    buf.ledger().check()
