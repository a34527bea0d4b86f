"""Group fates: failures, dynamic-sampling filters, eviction — every drop counted."""

import pytest

from miles.buffers import (
    BufferFull,
    drop_aborted,
    drop_truncated,
    drop_uniform_rewards,
    evict_fifo,
    evict_oldest,
    filter_name,
)
from miles.types import Status, Trajectory

from tests.unit.buffers.helpers import generate, make_buffer, prompts, run_groups


def _finish_group(buf, rewards, statuses=None, version=0):
    statuses = statuses or [Status.COMPLETED] * len(rewards)
    leased = buf.lease("w", len(rewards))
    buf.put_many([generate(t, version, reward=r, status=s) for t, r, s in zip(leased, rewards, statuses)], "w")


@pytest.mark.parametrize(
    "statuses",
    [[Status.FAILED, Status.FAILED], [Status.COMPLETED, Status.FAILED]],
    ids=["all failed", "some failed"],
)
def test_group_with_failed_member_is_dropped_whole(statuses) -> None:
    buf = make_buffer(n_samples_per_prompt=2)
    buf.add_prompts(prompts(1))
    _finish_group(buf, [1.0, 1.0], statuses)
    led = buf.ledger()
    assert led.dropped == {"failed": 2} and led.groups.dropped == {"failed": 1} and led.live == 0
    assert buf.stats()["buffer/dropped/failed"] == 2


def test_failed_streak_counts_failed_groups_until_one_is_ready() -> None:
    """The driver stops a run on a long streak (a reward or environment that always fails);
    one ready group resets it, and other drop reasons do not count."""
    buf = make_buffer(n_samples_per_prompt=2, group_filters=[drop_uniform_rewards])
    buf.add_prompts(prompts(5))
    assert buf.failures() == (0, "")
    for _ in range(2):
        leased = buf.lease("w", 2)
        bad = generate(leased[1], 0, status=Status.FAILED)
        bad.finish_reason = "reward_invalid: expected a float"
        buf.put_many([generate(leased[0], 0), bad], "w")
    assert buf.failures() == (2, "reward_invalid: expected a float")
    _finish_group(buf, [1.0, 1.0])  # dropped by the filter: not a failure
    assert buf.failures()[0] == 2 and buf.stats()["buffer/failed_group_streak"] == 2
    _finish_group(buf, [1.0, 0.0])  # ready
    assert buf.failures()[0] == 0


def test_uniform_reward_filter() -> None:
    buf = make_buffer(n_samples_per_prompt=3, group_filters=[drop_uniform_rewards])
    buf.add_prompts(prompts(2))
    _finish_group(buf, [1.0, 1.0, 1.0])
    _finish_group(buf, [1.0, 0.0, 1.0])
    led = buf.ledger()
    assert led.dropped == {"drop_uniform_rewards": 3} and led.groups.ready == 1
    assert drop_uniform_rewards([Trajectory(id="a", prompt_id="p", group_id="g", reward=0.0)])


def test_filters_run_in_order_first_rejection_names_reason() -> None:
    buf = make_buffer(n_samples_per_prompt=2, group_filters=[drop_truncated, drop_aborted])
    buf.add_prompts(prompts(2))
    _finish_group(buf, [0.0, 1.0], [Status.TRUNCATED, Status.ABORTED])
    _finish_group(buf, [0.0, 1.0], [Status.COMPLETED, Status.ABORTED])
    assert buf.ledger().dropped == {"drop_truncated": 2, "drop_aborted": 2}


def test_filter_names() -> None:
    class Keep:
        name = "custom"

        def __call__(self, group):
            return True

    assert filter_name(drop_aborted) == "drop_aborted"
    assert filter_name(Keep()) == "custom"


def test_no_eviction_policy_refuses() -> None:
    buf = make_buffer(capacity=2)
    run_groups(buf, 2)
    with pytest.raises(BufferFull):
        buf.add_prompts(prompts(1, start=5))
    assert buf.ledger().dropped == {}


@pytest.mark.parametrize("policy", [evict_fifo, evict_oldest])
def test_eviction_is_a_counted_drop(policy) -> None:
    buf = make_buffer(capacity=3, max_staleness=5, eviction_policy=policy)
    buf.set_version(1)
    newer = run_groups(buf, 1, version=1)
    older = run_groups(buf, 1, version=0)
    buf.add_prompts(prompts(1, start=5))  # third slot: no eviction
    buf.add_prompts(prompts(1, start=6))  # needs one eviction
    led = buf.ledger()
    assert led.dropped == {"evicted": 1} and led.groups.dropped == {"evicted": 1}
    left = [g[0].group_id for g in buf.get_batch(1, 1)]
    assert left == (older if policy is evict_fifo else newer)
    led.check()


def test_eviction_that_cannot_make_room_changes_nothing() -> None:
    buf = make_buffer(capacity=2, eviction_policy=evict_fifo)
    run_groups(buf, 1)
    buf.add_prompts(prompts(1, start=5))  # queued, not evictable
    with pytest.raises(BufferFull, match="even after evicting"):
        buf.add_prompts(prompts(2, start=6))
    assert buf.ledger().dropped == {} and buf.ledger().ready == 1
