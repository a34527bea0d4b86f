"""Admission under the staleness budget, the modes, and the scheduler driving a buffer."""

import random

import pytest

from miles.buffers import BufferConfig, ReplayBuffer, drop_uniform_rewards
from miles.scheduler import (
    UNBOUNDED,
    Scheduler,
    SchedulerConfig,
    admission,
    check_staleness,
    is_doomed,
    loss_version_stats,
    mask_stale_tokens,
    mode_staleness,
    within_bound,
)
from miles.types import PromptSample, Status, Trajectory


def _budget(**kw) -> int:
    args = dict(version=0, batch_size=4, max_staleness=1, accepted=0, running=0)
    args.update(kw)
    return admission(**args)


def test_areal_rule() -> None:
    # (η + v + 1)·B − (accepted + running)
    assert _budget() == (1 + 0 + 1) * 4
    assert _budget(version=3, accepted=12, running=2) == (1 + 3 + 1) * 4 - 14
    assert _budget(accepted=5, running=3) == 0
    assert _budget(accepted=6, running=5) == 0  # over budget: never negative
    assert _budget(max_staleness=0) == 4


def test_caps_inflight_and_room() -> None:
    assert _budget(max_inflight=3) == 3
    assert _budget(running=2, max_inflight=3) == 1
    assert _budget(room=2) == 2
    assert _budget(room=0) == 0


def test_over_sampling_only_while_quota_not_filled() -> None:
    kw = dict(max_staleness=0, over_sampling_batch_size=6)
    assert _budget(**kw) == 6
    assert _budget(accepted=3, running=2, **kw) == 4 + 2 - 5
    assert _budget(accepted=4, **kw) == 0  # batch full: the next waits for new weights
    assert _budget(accepted=4, version=1, **kw) == 6


@pytest.mark.parametrize(
    ("kw", "match"),
    [(dict(version=-1), "version"), (dict(accepted=-1), "accepted"), (dict(running=-1), "running"),
     (dict(batch_size=0), "batch_size"), (dict(max_staleness=-1), "max_staleness"),
     (dict(over_sampling_batch_size=2), "over_sampling")],
)
def test_admission_rejects_bad_arguments(kw, match) -> None:
    with pytest.raises(ValueError, match=match):
        _budget(**kw)


def test_modes() -> None:
    assert mode_staleness("sync", 5) == 0
    assert mode_staleness("one-step-off", 5) == 1
    assert mode_staleness("async", 5) == 5
    assert SchedulerConfig(mode="sync", max_staleness=3).staleness == 0
    with pytest.raises(ValueError, match="mode"):
        SchedulerConfig(mode="fast")
    with pytest.raises(ValueError, match="over_sampling_batch_size"):
        SchedulerConfig(rollout_batch_size=8, over_sampling_batch_size=4)
    with pytest.raises(ValueError, match="max_inflight"):
        SchedulerConfig(max_inflight=0)


def test_token_bound_helpers() -> None:
    assert loss_version_stats([3, 1, 2, 0], [1, 1, 1, 0]) == (1, 3, 6)
    assert loss_version_stats([3], [0]) == (None, 0, 0)
    assert within_bound(1, 3, 2) and not within_bound(1, 4, 2) and within_bound(None, 9, 0)
    assert is_doomed(1, 4, 2) and not is_doomed(None, 4, 0)


def test_mask_stale_tokens_zeroes_exactly_the_stale_loss_tokens() -> None:
    """Non-decreasing versions (every trajectory's) and any order give what the per-token rule gives:
    a loss token older than ``v - η`` loses its loss, every other token keeps its mask."""
    rng = random.Random(3)
    for case in range(300):
        n = rng.randrange(0, 40)
        versions = [rng.randrange(0, 8) for _ in range(n)]
        if case % 3:
            versions.sort()
        mask = [rng.randrange(2) for _ in range(n)]
        v, eta = rng.randrange(0, 10), rng.randrange(0, 4)
        want = [0 if m and ver < v - eta else m for ver, m in zip(versions, mask)]
        t = Trajectory(id="t", prompt_id="p", group_id="g", response_tokens=[1] * n, logprobs=[0.0] * n,
                       versions=list(versions), loss_mask=list(mask))
        assert mask_stale_tokens(t, v, eta) == sum(mask) - sum(want)
        assert t.loss_mask == want and t.versions == versions


def test_mask_stale_agrees_with_masking_then_counting() -> None:
    """The fast path (ascending runs, every token carrying loss) and the general one give
    what ``mask_stale_tokens`` then ``loss_version_stats`` give, on every shape."""
    from miles.scheduler.staleness import mask_stale
    from miles.types import loss_version_stats, version_runs

    rng = random.Random(3)
    for _ in range(2000):
        n = rng.randint(1, 40)
        base = rng.randint(0, 5)
        if rng.random() < 0.7:  # ascending runs, some versions skipped
            versions = sorted(base + rng.choice((0, 1, 2, 4, 7, 9)) for _ in range(n))
        else:
            versions = [base + rng.randint(0, 9) for _ in range(n)]
        mask = [1] * n if rng.random() < 0.7 else [rng.randint(0, 1) for _ in range(n)]
        trainer, eta = base + rng.randint(0, 12), rng.randint(0, 4)
        fast = Trajectory(id="t", prompt_id="p", group_id="g", versions=list(versions), loss_mask=list(mask))
        slow = Trajectory(id="t", prompt_id="p", group_id="g", versions=list(versions), loss_mask=list(mask))
        runs = rng.choice((None, version_runs(versions), [(0, n + 1)]))  # unknown, known, another list's
        got = mask_stale(fast, trainer, eta, loss_version_stats(versions, mask), runs)
        want = mask_stale_tokens(slow, trainer, eta), loss_version_stats(slow.versions, slow.loss_mask)
        assert got == want and fast.loss_mask == slow.loss_mask, (versions, mask, trainer, eta, runs)


def test_scheduler_events_and_state() -> None:
    s = Scheduler(SchedulerConfig(rollout_batch_size=2, max_staleness=1))
    assert s.capacity() == 4
    s.on_admitted(3)
    s.on_finished(accepted=1, rejected=1)
    assert (s.accepted, s.running, s.capacity()) == (1, 1, 2)
    s.on_dropped(1)
    s.on_version(1)
    assert s.capacity() == 6 - 1
    with pytest.raises(ValueError, match="backwards"):
        s.on_version(0)
    t = Scheduler(s.config)
    t.load_state_dict(s.state_dict())
    assert t.state_dict() == s.state_dict() and set(s.stats()) >= {"scheduler/capacity"}


def _run(mode: str, *, eta: int = 1, steps: int = 6, B: int = 3, n: int = 2, over: int | None = None,
         lag: int = 0, seed: int = 0, filters=()):
    """A pure-Python driver loop: admit by the scheduler, workers finish what they lease at
    the current version (in random chunks), the trainer takes B groups and publishes.
    ``lag``: loop turns the trainer waits before each step (slow trainer)."""
    rng = random.Random(seed)
    cfg = SchedulerConfig(mode=mode, max_staleness=eta, rollout_batch_size=B, over_sampling_batch_size=over)
    sched = Scheduler(cfg)
    buf = ReplayBuffer(BufferConfig(max_staleness=cfg.staleness, n_samples_per_prompt=n, capacity=10**4),
                       group_filters=filters)
    version, waited, admitted_at = 0, 0, {}
    staleness_seen = []
    for turn in range(10_000):
        sched.observe(buf.ledger())
        k = sched.capacity(buf.prompt_room())
        if k:
            quota = (cfg.staleness + version + 1) * B
            for gid in buf.add_prompts([PromptSample(prompt_id=f"{turn}.{i}") for i in range(k)]):
                admitted_at[gid] = version
            sched.observe(buf.ledger())
            assert sched.accepted + sched.running <= quota + (over or B) - B
        for t in buf.lease("w", rng.randint(1, 4)):
            t.append([1], [-0.1], version)
            t.status, t.reward = Status.COMPLETED, float(rng.random() < 0.5)
            buf.put(t, "w")
        waited += 1
        if waited > lag:
            batch = buf.get_batch(B, version)
            if batch:
                staleness_seen += [version - v for g in batch for t in g for v in t.versions]
                waited = 0
                version += 1
                buf.set_version(version)
                sched.on_version(version)
                if version == steps:
                    break
    buf.ledger().check()
    return staleness_seen, admitted_at, buf


def test_sync_mode_is_on_policy() -> None:
    staleness, admitted_at, buf = _run("sync", B=3)
    assert staleness and set(staleness) == {0}
    # exactly one batch of prompts per version: the next never starts on old weights
    per_version = [list(admitted_at.values()).count(v) for v in range(6)]
    assert per_version == [3] * 6
    assert buf.ledger().dropped == {}


def test_one_step_off_and_async_stay_within_bound() -> None:
    for mode, eta, lag in (("one-step-off", 9, 2), ("async", 3, 3), ("async", 2, 0)):
        staleness, _, buf = _run(mode, eta=eta, lag=lag, steps=8)
        bound = mode_staleness(mode, eta)
        assert staleness and max(staleness) <= bound
        if lag:  # a slow trainer makes the budget, not the buffer, hold rollouts back
            assert max(staleness) == bound and buf.ledger().dropped == {}


def test_over_sampling_feeds_a_filter() -> None:
    staleness, admitted_at, buf = _run("sync", B=3, over=5, steps=4, filters=[drop_uniform_rewards])
    assert set(staleness) == {0}
    assert buf.ledger().groups.dropped["drop_uniform_rewards"] > 0
    # more than B start per version (the filter rejects some); the loop checks the budget
    assert max(list(admitted_at.values()).count(v) for v in range(4)) > 3


def test_admit_is_observe_then_capacity() -> None:
    """The driver's one admission call (and the simulator's) takes the ledger's counts first."""
    buf = ReplayBuffer(BufferConfig(max_staleness=1, capacity=100))
    sched = Scheduler(SchedulerConfig(mode="async", max_staleness=1, rollout_batch_size=4))
    assert sched.admit(buf.ledger(), buf.prompt_room()) == 8
    buf.add_prompts([PromptSample(prompt_id=f"p{i}") for i in range(5)])
    assert sched.admit(buf.ledger(), buf.prompt_room()) == 3
    assert (sched.running, sched.accepted, sched.admitted) == (5, 0, 5)
    assert sched.admit(buf.ledger(), 2) == 2


# ---- unbounded η ------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "eta"), [("inf", UNBOUNDED), ("Unbounded", UNBOUNDED), (float("inf"), UNBOUNDED),
                                            ("2", 2), (2.0, 2), (0, 0), (16, 16)])
def test_staleness_values(value, eta) -> None:
    assert check_staleness(value) == eta and type(check_staleness(value)) is type(eta)


@pytest.mark.parametrize("bad", [-1, "-1", 2.5, "2.5", "soon", True, None, float("nan"), -float("inf")])
def test_bad_staleness_values_say_what_is_allowed(bad) -> None:
    with pytest.raises(ValueError, match="whole number >= 0, or inf / unbounded"):
        check_staleness(bad)
    with pytest.raises(ValueError, match="whole number >= 0"):
        SchedulerConfig(max_staleness=bad)
    with pytest.raises(ValueError, match="whole number >= 0"):
        BufferConfig(max_staleness=bad)


def test_unbounded_staleness_from_the_flag_and_yaml(tmp_path) -> None:
    from miles.config import ConfigError, build_parser, default_config, load_yaml, resolve

    for word in ("inf", "unbounded"):
        ns = build_parser().parse_args(["--max-staleness", word])
        cfg = resolve({k: v for k, v in vars(ns).items() if k != "config"}, check=False)
        assert cfg.scheduler.staleness == UNBOUNDED and cfg.buffer.max_staleness == UNBOUNDED
    cfg.dump(tmp_path / "config.yaml")  # the resolved config reads back the same
    assert resolve(load_yaml(tmp_path / "config.yaml"), check=False).scheduler.max_staleness == UNBOUNDED
    assert default_config(max_staleness="3").scheduler.max_staleness == 3
    with pytest.raises(ConfigError, match="--max-staleness: .*inf / unbounded"):
        default_config(max_staleness="lots")


def test_unbounded_admission_is_held_by_the_finite_caps() -> None:
    kw = dict(version=0, batch_size=4, max_staleness=UNBOUNDED, accepted=10**6, running=3)
    assert admission(**kw, room=7) == 7
    assert admission(**kw, max_inflight=5, room=7) == 2
    with pytest.raises(ValueError, match="stay finite"):
        admission(**kw)
    sched = Scheduler(SchedulerConfig(mode="async", max_staleness="unbounded", rollout_batch_size=4))
    assert sched.stats()["scheduler/capacity"] == UNBOUNDED  # no room seen yet
    buf = ReplayBuffer(BufferConfig(max_staleness=UNBOUNDED, capacity=40, n_samples_per_prompt=2))
    assert sched.admit(buf.ledger(), buf.prompt_room()) == 20
    assert sched.stats()["scheduler/capacity"] == 20


def test_unbounded_run_trains_everything_however_old() -> None:
    """A slow trainer under η = ∞: staleness grows past any small bound, nothing is dropped,
    and the batches' histograms report the staleness values met."""
    staleness, _, buf = _run("async", eta=UNBOUNDED, lag=3, steps=20)
    assert max(staleness) > 4 and buf.ledger().dropped == {}
    assert any(k.startswith("buffer/staleness_hist/") and k != "buffer/staleness_hist/0" for k in buf.stats())
