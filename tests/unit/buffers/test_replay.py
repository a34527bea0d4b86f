"""ReplayBuffer life cycle: admission, leasing order, groups, get_batch, ledger, stats."""

import pytest

from miles.buffers import BufferFull, oldest_first, priority
from miles.types import Status

from tests.unit.buffers.helpers import generate, make_buffer, prompts, run_groups


def test_prompt_becomes_group_of_pending_trajectories() -> None:
    buf = make_buffer(n_samples_per_prompt=3)
    gids = buf.add_prompts(prompts(2))
    assert len(gids) == 2 and len(set(gids)) == 2
    led = buf.ledger()
    assert (led.admitted, led.queued, led.groups.admitted, led.groups.open) == (6, 6, 2, 2)
    leased = buf.lease("w", 10)
    assert [t.index_in_group for t in leased] == [0, 1, 2, 0, 1, 2]
    assert {t.group_id for t in leased} == set(gids)
    assert all(t.status is Status.RUNNING and t.prompt_tokens == [1, 2, 3] for t in leased)
    assert buf.ledger().in_flight == 6 and buf.leased("w") == [t.id for t in leased]


def test_same_prompt_twice_gets_distinct_groups() -> None:
    buf = make_buffer()
    a = buf.add_prompts(prompts(1))
    b = buf.add_prompts(prompts(1))
    assert a != b


def test_group_ready_only_when_all_members_finished() -> None:
    buf = make_buffer(n_samples_per_prompt=2)
    buf.add_prompts(prompts(1))
    t0, t1 = buf.lease("w", 2)
    buf.put(generate(t0, 0), "w")
    led = buf.ledger()
    assert (led.waiting, led.in_flight, led.ready) == (1, 1, 0)
    assert buf.get_batch(1, 0) == []
    buf.put(generate(t1, 0), "w")
    batch = buf.get_batch(1, 0)
    assert [[t.id for t in g] for g in batch] == [[t0.id, t1.id]]
    led = buf.ledger()
    assert (led.trained, led.groups.trained, led.live) == (2, 1, 0)
    led.check()


def test_get_batch_all_or_nothing_and_fifo() -> None:
    buf = make_buffer()
    gids = run_groups(buf, 3)
    assert buf.get_batch(4, 0) == []
    assert buf.ledger().ready == 3  # nothing was taken
    first = buf.get_batch(2, 0)
    assert [g[0].group_id for g in first] == gids[:2]
    assert [g[0].group_id for g in buf.get_batch(1, 0)] == gids[2:]


def test_partials_are_leased_first_oldest_first() -> None:
    buf = make_buffer()
    buf.add_prompts(prompts(4))
    a, b, c, d = buf.lease("w", 4)
    buf.set_version(2)
    # b's tokens are older than a's: b must come back first, then a, then new work
    buf.put(generate(a, 2, status=Status.PARTIAL), "w")
    buf.put(generate(b, 1, status=Status.PARTIAL), "w")
    buf.add_prompts(prompts(1, start=10))
    got = buf.lease("w2", 3)
    assert [t.id for t in got[:2]] == [b.id, a.id]
    assert got[2].response_tokens == [] and got[2].prompt_id == "p10"
    assert buf.ledger().recycled == 2
    # the resumed prefix (tokens, versions, log-probs) is what the worker sent back
    assert got[0].versions == [1, 1] and got[0].status is Status.RUNNING


def test_resumed_partial_keeps_prefix_versions() -> None:
    buf = make_buffer(max_staleness=4)
    buf.add_prompts(prompts(1))
    (t,) = buf.lease("w", 1)
    buf.put(generate(t, 0, status=Status.PARTIAL), "w")
    buf.set_version(1)
    (t,) = buf.lease("w", 1)
    done = generate(t, 1, n_tokens=3)
    buf.put(done, "w")
    (group,) = buf.get_batch(1, 1)
    assert group[0].versions == [0, 0, 1, 1, 1] and group[0].num_segments == 2


def test_capacity_counts_every_live_trajectory() -> None:
    buf = make_buffer(capacity=4, n_samples_per_prompt=2)
    buf.add_prompts(prompts(2))
    assert buf.prompt_room() == 0
    buf.lease("w", 4)  # in flight still occupies room
    with pytest.raises(BufferFull, match="do not fit"):
        buf.add_prompts(prompts(1))
    with pytest.raises(BufferFull):
        buf.add_prompts(prompts(3), n_samples_per_prompt=2)


def test_sampling_policies() -> None:
    buf = make_buffer(max_staleness=5, sampling_policy=oldest_first)
    run_groups(buf, 1, version=0)
    buf.set_version(2)
    newer = run_groups(buf, 1, version=2)
    older = run_groups(buf, 1, version=1)
    order = [g[0].group_id for g in buf.get_batch(3, 2)]
    assert order[1:] == [older[0], newer[0]]

    by_reward = priority(lambda g: g.trajectories[0].reward)
    buf = make_buffer(sampling_policy=by_reward)
    buf.add_prompts(prompts(3))
    for t, r in zip(buf.lease("w", 3), (0.1, 0.9, 0.5)):
        buf.put(generate(t, 0, reward=r), "w")
    assert [g[0].reward for g in buf.get_batch(3, 0)] == [0.9, 0.5, 0.1]


def test_stats_and_staleness_histogram() -> None:
    buf = make_buffer(max_staleness=2, n_samples_per_prompt=2)
    run_groups(buf, 1, version=0)
    buf.set_version(1)
    run_groups(buf, 1, version=1)
    buf.get_batch(2, 1)
    s = buf.stats()
    assert s["buffer/staleness_max"] == 1.0
    assert s["buffer/staleness_mean"] == pytest.approx(0.5)
    assert (s["buffer/staleness_hist/0"], s["buffer/staleness_hist/1"], s["buffer/staleness_hist/2"]) == (2, 2, 0)
    assert s["buffer/trained"] == 4 and s["buffer/ready_groups"] == 0
    assert all(k.startswith("buffer/") for k in s)


def test_stats_keys_exist_before_any_batch() -> None:
    s = make_buffer(max_staleness=2).stats()
    for key in ("buffer/queued", "buffer/partial", "buffer/ready_groups", "buffer/staleness_mean",
                "buffer/staleness_max", "buffer/recycled_partials", "buffer/staleness_hist/2"):
        assert s[key] == 0.0


def test_env_tokens_carry_no_staleness() -> None:
    buf = make_buffer(max_staleness=0)
    buf.add_prompts(prompts(1))
    (t,) = buf.lease("w", 1)
    buf.set_version(1)
    out = generate(t, 1, env_tokens=2)
    out.versions[-2:] = [0, 0]  # env tokens written under an older version: no loss, no bound
    buf.put(out, "w")
    (group,) = buf.get_batch(1, 1)
    assert group[0].loss_mask == [1, 1, 0, 0]


def test_ledger_summary_and_check_detects_imbalance() -> None:
    buf = make_buffer()
    run_groups(buf, 2)
    led = buf.ledger()
    assert "admitted=2" in led.summary()
    led.ready -= 1
    with pytest.raises(AssertionError, match="sum"):
        led.check()
