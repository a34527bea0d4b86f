"""Env failures end the episode FAILED with its reason, counted; the rollout goes on."""

from __future__ import annotations

import asyncio
import math
import threading

import numpy as np
import pytest

from miles.envs import EnvCaller, EnvFailure, check_reset, check_step, load_env_factory
from miles.types import Status
from tests.unit.envs.helpers import (
    AsyncHangingEnv,
    BarrierEnv,
    BrokenEnv,
    CountdownEnv,
    ScriptedEngine,
    make_ctx,
    make_traj,
    rollout,
)


def run(coro):
    return asyncio.run(coro)


CASES = [
    ("init", "raise", None, "env_error", "the Env constructor raised RuntimeError: cannot start the sandbox"),
    ("reset", "raise", None, "env_error", "reset raised ValueError: boom"),
    ("step", "raise", None, "env_error", "step raised ValueError: boom"),
    ("reset", "hang", None, "env_timeout", "reset gave no result within 0.2s"),
    ("step", "hang", None, "env_timeout", "step gave no result within 0.2s"),
    ("reset", "garbage", 42, "env_invalid", "reset returned int 42"),
    ("step", "garbage", "not a tuple", "env_invalid", "step returned str"),
    ("step", "garbage", ("obs", float("nan"), False, {}), "env_invalid", "reward nan"),
    ("step", "garbage", ("obs", 1.0, "yes", {}), "env_invalid", "done='yes'"),
    ("step", "garbage", (3, 1.0, False, {}), "env_invalid", "observation of type int"),
    ("step", "garbage", ("obs", 1.0, False, []), "env_invalid", "info of type list"),
]


@pytest.mark.parametrize(("where", "how", "value", "kind", "detail"), CASES)
def test_broken_env_fails_the_episode_with_its_reason(where, how, value, kind, detail) -> None:
    ro = rollout(lambda: BrokenEnv(where, how, value), turn_timeout_s=0.2)
    out = run(ro(make_traj(), make_ctx(ScriptedEngine())))
    assert out.status is Status.FAILED and out.reward is None
    assert out.finish_reason.startswith(f"{kind}: ") and detail in out.finish_reason
    assert ro.stats()[f"env/failed/{kind}"] == 1.0
    out.validate()


def test_async_hang_times_out() -> None:
    ro = rollout(AsyncHangingEnv, turn_timeout_s=0.05)
    out = run(ro(make_traj(), make_ctx(ScriptedEngine())))
    assert out.status is Status.FAILED and out.finish_reason.startswith("env_timeout: step")


def test_episode_timeout_counts_time_across_calls() -> None:
    class Slow(CountdownEnv):
        async def step(self, action):
            await asyncio.sleep(0.05)
            return "more", 0.0, False, {}

    ro = rollout(Slow, episode_timeout_s=0.2, max_turns=1000)
    out = run(ro(make_traj(), make_ctx(ScriptedEngine())))
    assert out.status is Status.FAILED and out.finish_reason.startswith("episode_timeout")
    assert ro.stats()["env/failed/episode_timeout"] == 1.0
    # the time spent is kept: a resumed episode over its budget fails at once
    out.status = Status.PARTIAL
    again = run(ro(out, make_ctx(ScriptedEngine())))
    assert again.finish_reason.startswith("episode_timeout")


def test_failures_do_not_stop_other_episodes() -> None:
    good = rollout(lambda: CountdownEnv(turns=2), turn_timeout_s=0.2)
    bad = rollout(lambda: BrokenEnv("step", "hang"), turn_timeout_s=0.2)
    engine = ScriptedEngine()

    async def go():
        return await asyncio.gather(*(ro(make_traj(f"t{i}"), make_ctx(engine))
                                      for i, ro in enumerate([good, bad] * 4)))

    outs = run(go())
    assert [o.status for o in outs] == [Status.COMPLETED, Status.FAILED] * 4


def test_sync_env_steps_run_in_parallel_threads() -> None:
    BarrierEnv.barrier = threading.Barrier(4)
    ro = rollout(BarrierEnv, env_threads=4)

    async def go():
        return await asyncio.gather(*(ro(make_traj(f"t{i}"), make_ctx(ScriptedEngine())) for i in range(4)))

    assert all(o.status is Status.COMPLETED for o in run(go()))


def test_env_steps_overlap_with_decoding() -> None:
    # Episode A sits in a step until episode B has finished generating and stepping.
    b_done = asyncio.Event()

    class Waits(CountdownEnv):
        async def step(self, action):
            await asyncio.wait_for(b_done.wait(), 5)
            return "", 1.0, True, {}

    class Quick(CountdownEnv):
        def step(self, action):
            return "", 1.0, True, {}

    engine = ScriptedEngine()

    async def go():
        a = asyncio.create_task(rollout(Waits)(make_traj("a"), make_ctx(engine)))
        b = await rollout(Quick)(make_traj("b"), make_ctx(engine))
        b_done.set()
        return await a, b

    a, b = run(go())
    assert a.status is b.status is Status.COMPLETED


def test_engine_error_fails_the_episode_and_closes_the_env() -> None:
    class ErrorEngine(ScriptedEngine):
        async def generate(self, request):
            out = await super().generate(request)
            out.finish_reason, out.error = "error", "non-finite logits"
            return out

    ro = rollout(CountdownEnv)

    async def go():
        out = await ro(make_traj(), make_ctx(ErrorEngine()))
        await ro.wait_closed()
        return out

    out = run(go())
    assert out.status is Status.FAILED and out.finish_reason == "engine_error: non-finite logits"
    assert CountdownEnv.instances[-1].closed


# ---- the checks themselves ------------------------------------------------------------------


def test_check_step_accepts_what_the_protocol_allows() -> None:
    r = check_step(("o", np.float32(0.5), np.bool_(True), None))
    assert (r.observation, r.reward, r.done, r.truncated, r.info) == ("o", 0.5, True, False, {})
    r = check_step([None, 1, 0, {"k": 1}])
    assert (r.observation, r.reward, r.done) == ("", 1.0, False)
    r = check_step(("o", 0.0, False, True, {}))
    assert r.done and r.truncated
    for bad in [(), ("o", True, False, {}), ("o", math.inf, False, {}), ("o", 1.0, 2, {}), ("o", 1.0, 0.0, {})]:
        with pytest.raises(EnvFailure) as exc:
            check_step(bad)
        assert exc.value.kind == "env_invalid"


def test_check_reset() -> None:
    assert check_reset(None, allow_messages=False) == ""
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert check_reset(msgs, allow_messages=True) == msgs
    with pytest.raises(EnvFailure, match="expected a str"):
        check_reset(msgs, allow_messages=False)
    with pytest.raises(EnvFailure):
        check_reset([{"role": "user"}], allow_messages=True)


def test_load_env_factory_names_the_problem(tmp_path) -> None:
    from miles.utils.loading import LoadError

    with pytest.raises(LoadError, match="no attribute"):
        load_env_factory("tests.unit.envs.helpers:Nope")
    path = tmp_path / "envs.py"
    path.write_text("class NoStep:\n    def __init__(self, a=0):\n        self.a = a\n    def reset(self, s):\n        return ''\n")
    make = load_env_factory(f"{path}:NoStep", {"a": 3})
    with pytest.raises(EnvFailure, match="without step"):
        make()
    make = load_env_factory("tests.unit.envs.helpers:CountdownEnv", {"turns": 7})
    assert make().turns == 7


def test_caller_timeouts_are_bounded() -> None:
    caller = EnvCaller(timeout_s=0.05, threads=2)

    async def slow():
        await asyncio.sleep(1)

    with pytest.raises(EnvFailure) as exc:
        run(caller.call("thing", slow))
    assert exc.value.kind == "env_timeout" and exc.value.reason == "env_timeout: thing gave no result within 0.05s"
    caller.shutdown()


def test_hung_threads_do_not_starve_healthy_envs() -> None:
    import time

    caller = EnvCaller(timeout_s=0.05, threads=2)
    release = threading.Event()

    async def go():
        for _ in range(3):  # each hangs its thread past the timeout
            with pytest.raises(EnvFailure):
                await caller.call("step", release.wait, 5)
        return await caller.call("step", time.monotonic)  # a healthy call still gets a thread

    assert isinstance(run(go()), float)
    assert caller.pools_replaced >= 1
    release.set()
    caller.shutdown()


def test_errors_survive_pickling_between_actors() -> None:
    # Ray pickles an actor's exception for its caller; one that cannot be rebuilt arrives
    # as an opaque UnserializableException instead of the reason.
    import pickle

    from miles.types import TrajectoryError

    err = pickle.loads(pickle.dumps(TrajectoryError("versions", "version 3 is newer than the current policy 2")))
    assert str(err) == "versions: version 3 is newer than the current policy 2" and err.field == "versions"
    failure = pickle.loads(pickle.dumps(EnvFailure("env_timeout", "step gave no result within 1s")))
    assert failure.reason == "env_timeout: step gave no result within 1s"
