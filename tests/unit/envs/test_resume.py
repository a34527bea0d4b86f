"""Episodes park as PARTIAL on abort and resume — on the same worker or by replay elsewhere."""

from __future__ import annotations

import asyncio
import random

from miles.buffers.records import reset, restore
from miles.envs import EpisodeState
from miles.types import Status
from tests.unit.envs.helpers import EOS, TOKENIZER, CountdownEnv, ScriptedEngine, make_ctx, make_traj, rollout


def run(coro):
    return asyncio.run(coro)


def test_abort_mid_turn_parks_and_the_same_env_resumes() -> None:
    engine = ScriptedEngine(default=[30, 31, 32, 33, EOS], hold=True)
    ro = rollout(lambda: CountdownEnv(turns=2))
    ctx = make_ctx(engine)
    t = make_traj()

    async def go():
        task = asyncio.create_task(ro(t, ctx))
        await engine.until_waiting()
        engine.release()  # turn 1 completes
        await engine.until_waiting()
        ctx.aborts += 1  # what RolloutWorker.abort_inflight does
        await engine.abort(None)  # turn 2 is cut in the middle
        parked = await task
        assert parked.status is Status.PARTIAL and ro.stats()["env/parked_envs"] == 1.0
        n_before = len(parked.response_tokens)
        engine.version = 1  # new weights while parked
        task = asyncio.create_task(ro(parked, ctx))
        await engine.until_waiting()
        engine.release()
        return n_before, await task

    n_before, out = run(go())
    assert out.status is Status.COMPLETED and out.reward == 3.0
    env = CountdownEnv.instances[-1]
    assert len(env.actions) == 2  # the same Env object went on: no replay
    assert ro.stats().get("env/replays", 0.0) == 0.0
    # turn 2 = its first half (version 0) + the rest (version 1), one model segment
    seg = [s for s in out.segments if s.kind == "model"][1]
    assert out.versions[seg.start: seg.end] == [0] * (n_before - seg.start) + [1] * (seg.end - n_before)
    assert env.actions[1] == TOKENIZER.decode(out.response_tokens[seg.start: seg.end])  # the whole turn
    out.validate()


def test_abort_during_an_env_step_parks_between_turns() -> None:
    ctx = make_ctx(ScriptedEngine())

    class Aborting(CountdownEnv):
        def step(self, action):
            if len(self.actions) == 0:
                ctx.aborts += 1  # the worker aborts while this step runs
            return super().step(action)

    ro = rollout(lambda: Aborting(turns=3))
    t = run(ro(make_traj(), ctx))
    assert t.status is Status.PARTIAL and [s.kind for s in t.segments] == ["model", "env"]
    out = run(ro(t, ctx))
    assert out.status is Status.COMPLETED and out.reward == 6.0 and len(CountdownEnv.instances[-1].actions) == 3


def _parked_after_two_turns():
    ctx = make_ctx(ScriptedEngine())

    class Parks(CountdownEnv):
        def step(self, action):
            if len(self.actions) == 1:
                ctx.aborts += 1
            return super().step(action)

    t = run(rollout(lambda: Parks(turns=4))(make_traj(), ctx))
    assert t.status is Status.PARTIAL and len(EpisodeState.of(t).turns) == 2
    return t


def test_resume_on_another_worker_replays_the_env() -> None:
    t = _parked_after_two_turns()
    other = rollout(lambda: CountdownEnv(turns=4))  # a fresh worker: no live Env
    out = run(other(t, make_ctx(ScriptedEngine())))
    assert out.status is Status.COMPLETED and out.reward == 1.0 + 2.0 + 3.0 + 4.0
    assert other.stats()["env/replays"] == 1.0
    assert len(CountdownEnv.instances[-1].actions) == 4  # 2 replayed + 2 new


def test_a_nondeterministic_env_cannot_be_replayed() -> None:
    class Random(CountdownEnv):
        def step(self, action):
            super().step(action)
            return f"{random.random()}", 0.0, False, {}

    t = _parked_after_two_turns()
    out = run(rollout(Random)(t, make_ctx(ScriptedEngine())))
    assert out.status is Status.FAILED and out.finish_reason.startswith("env_replay_mismatch")


def test_a_cut_back_trajectory_drops_the_turns_it_lost() -> None:
    t = _parked_after_two_turns()
    first_turn_end = EpisodeState.of(t).turns[0].obs_end
    cut = restore(t, (first_turn_end, t.num_segments))  # the buffer's view after a worker died
    assert len(EpisodeState.of(cut).turns) == 1
    ro = rollout(lambda: CountdownEnv(turns=4))
    out = run(ro(cut, make_ctx(ScriptedEngine())))
    assert out.status is Status.COMPLETED and out.reward == 10.0
    out.validate()


def test_a_recomputed_trajectory_starts_over() -> None:
    t = _parked_after_two_turns()
    reset(t)  # the buffer's recompute: response gone, metadata kept
    ro = rollout(lambda: CountdownEnv(turns=2))
    out = run(ro(t, make_ctx(ScriptedEngine())))
    assert out.status is Status.COMPLETED and out.reward == 3.0
    assert len(EpisodeState.of(out).turns) == 2


def test_a_response_without_an_episode_record_fails() -> None:
    t = make_traj()
    t.append([5, 6], [0.0, 0.0], 0)
    out = run(rollout(CountdownEnv)(t, make_ctx(ScriptedEngine())))
    assert out.status is Status.FAILED and out.finish_reason.startswith("env_state_lost")


def test_parked_envs_expire_and_are_closed() -> None:
    ctx = make_ctx(ScriptedEngine())

    class ParksAtOnce(CountdownEnv):
        def reset(self, sample):
            ctx.aborts += 1  # the worker aborts before the first model turn
            return ""

    ro = rollout(ParksAtOnce)
    ro.max_parked = 1

    async def go():
        outs = [await ro(make_traj(f"t{i}"), ctx) for i in range(3)]
        await ro.wait_closed()
        return outs

    outs = run(go())
    assert all(o.status is Status.PARTIAL and not o.response_tokens for o in outs)
    stats = ro.stats()
    assert stats["env/parked_envs"] == 1.0 and stats["env/parked_expired"] == 2.0
    assert [e.closed for e in CountdownEnv.instances[-3:]] == [True, True, False]
