"""RewardRunner: sync/async/slime-style functions; raise, hang, NaN and garbage → FAILED."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from miles.rewards import RewardRunner, _Threads, check_reward
from miles.types import Status, Trajectory


def _t(i: int = 0, label: str = "a") -> Trajectory:
    return Trajectory(id=f"t{i}", prompt_id="p", group_id="g", response="a b", label=label)


def _score(runner: RewardRunner, trajs: list[Trajectory]) -> list[Trajectory]:
    return asyncio.run(runner.score_many(trajs))


def test_sync_async_and_slime_signatures() -> None:
    async def async_fn(sample):
        return {"acc": 1.0, "fmt": 0.5}

    def slime_fn(args, sample):
        return float(args["bonus"])

    (a,) = _score(RewardRunner(lambda s: float(s.label == "a")), [_t()])
    (b,) = _score(RewardRunner(async_fn), [_t()])
    (c,) = _score(RewardRunner(slime_fn, args={"bonus": 2}), [_t()])
    assert (a.reward, b.reward, c.reward) == (1.0, {"acc": 1.0, "fmt": 0.5}, 2.0)


@pytest.mark.parametrize(
    ("fn", "reason"),
    [
        (lambda s: 1 / 0, "reward_error: ZeroDivisionError"),
        (lambda s: float("nan"), "reward_invalid"),
        (lambda s: "high", "reward_invalid"),
        (lambda s: None, "reward_invalid"),
        (lambda s: {"a": float("inf")}, "reward_invalid"),
    ],
)
def test_bad_rewards_fail_the_sample(fn, reason) -> None:
    runner = RewardRunner(fn)
    (t,) = _score(runner, [_t()])
    assert t.status is Status.FAILED and t.finish_reason.startswith(reason) and t.reward is None
    assert runner.stats()[f"reward/{reason.split(':')[0]}"] == 1


def test_hanging_sync_calls_do_not_starve_others() -> None:
    """Twenty calls hang past the timeout; the good ones are scored while they still hang
    (each good call sees the hanging ones unreleased), and scoring returns before any hang ends."""
    release = threading.Event()  # set only once scoring returned: until then every hang holds
    hangs_over: list[int] = []  # a hang that ended (its wait ran out: a starved run waited that long)
    good_during_hang: list[bool] = []

    def fn(sample):
        if sample.label == "hang":
            release.wait(60)
            hangs_over.append(1)
        else:
            good_during_hang.append(not hangs_over)
        return 1.0

    runner = RewardRunner(fn, timeout_s=0.3)
    trajs = [_t(i, "hang") for i in range(20)] + [_t(100 + i) for i in range(20)]
    try:
        out = _score(runner, trajs)
        ended_before_return = len(hangs_over)
    finally:
        release.set()
    assert ended_before_return == 0 and good_during_hang == [True] * 20
    assert [t.status for t in out[:20]] == [Status.FAILED] * 20
    assert all(t.finish_reason.startswith("reward_timeout") for t in out[:20])
    assert all(t.reward == 1.0 for t in out[20:])


def test_async_timeout() -> None:
    async def slow(sample):
        await asyncio.sleep(10)

    (t,) = _score(RewardRunner(slow, timeout_s=0.05), [_t()])
    assert t.finish_reason.startswith("reward_timeout")


def test_check_reward_accepts_ints_and_dicts() -> None:
    assert check_reward(1) == 1.0 and check_reward({"x": 2}) == {"x": 2.0}
    with pytest.raises(ValueError):
        check_reward(True)


@pytest.mark.parametrize("value", ["1.0", b"1", True, {"x": "0.5"}, {"x": False}, None, {}, float("nan")])
def test_check_reward_refuses_strings_booleans_and_non_finite_values(value) -> None:
    with pytest.raises(ValueError):
        check_reward(value)


def test_check_reward_takes_numpy_and_torch_scalars() -> None:
    import numpy as np
    import torch

    assert check_reward(np.float32(0.5)) == 0.5 and check_reward(torch.tensor(2.0)) == 2.0
    assert check_reward({"a": np.int64(3)}) == {"a": 3.0}
    with pytest.raises(ValueError, match="not a number"):
        check_reward(np.bool_(True))


def test_sync_calls_reuse_idle_threads_and_never_wait_for_a_busy_one() -> None:
    """A call goes to an idle thread when there is one; while every thread is busy (one
    blocked here) the next call gets a new thread instead of queueing."""
    pool, seen, blocked, release = _Threads(), [], threading.Event(), threading.Event()

    def wait_idle(n: int) -> None:
        deadline = time.monotonic() + 10
        while len(pool._idle) != n and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(pool._idle) == n

    done = threading.Event()
    pool.submit(lambda: (seen.append(threading.get_ident()), done.set()))
    assert done.wait(10)
    wait_idle(1)
    done.clear()
    pool.submit(lambda: (seen.append(threading.get_ident()), done.set()))
    assert done.wait(10) and seen[0] == seen[1]  # the idle thread took it
    wait_idle(1)
    pool.submit(lambda: (seen.append(threading.get_ident()), blocked.set(), release.wait(10)))
    assert blocked.wait(10)
    done.clear()
    pool.submit(lambda: (seen.append(threading.get_ident()), done.set()))
    assert done.wait(10) and seen[3] != seen[2]  # not queued behind the blocked call
    release.set()
    wait_idle(2)
    pool.close()
    assert pool._idle == []
