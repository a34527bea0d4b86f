"""EnvRollout on a scripted engine: token-exact episodes, budgets, stops, rewards."""

from __future__ import annotations

import asyncio

import pytest

from miles.envs import EnvConfig, TurnTemplate
from miles.rollout import EnvRollout
from miles.types import Status
from tests.unit.envs.helpers import (
    EOS,
    TOKENIZER,
    AsyncCountdownEnv,
    CountdownEnv,
    ScriptedEngine,
    make_ctx,
    make_traj,
    rollout,
)

CHAT = TurnTemplate("chat", tokenizer=TOKENIZER)


def run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize("env_cls", [CountdownEnv, AsyncCountdownEnv])
def test_episode_is_token_exact(env_cls) -> None:
    actions = [[50, 51, EOS], [60, EOS], [70, 71, 72, EOS]]
    engine = ScriptedEngine([list(a) for a in actions], version=4)
    ro = rollout(env_cls)
    t = make_traj()
    prompt = list(t.prompt_tokens)

    async def go():
        out = await ro(t, make_ctx(engine))
        await ro.wait_closed()
        return out

    out = run(go())

    assert out.status is Status.COMPLETED and out.finish_reason == "env_done"
    obs = [TOKENIZER.encode(CHAT.observation_text(f"obs{i}")) for i in (1, 2)]
    assert out.response_tokens == actions[0] + obs[0] + actions[1] + obs[1] + actions[2]
    assert out.prompt_tokens == prompt  # reset returned "": the data prompt stays
    kinds = ["model"] * 3 + ["env"] * len(obs[0]) + ["model"] * 2 + ["env"] * len(obs[1]) + ["model"] * 4
    assert out.loss_mask == [int(k == "model") for k in kinds]
    assert all(lp == 0.0 for lp, k in zip(out.logprobs, kinds) if k == "env")
    assert all(lp == -0.5 for lp, k in zip(out.logprobs, kinds) if k == "model")
    assert [s.kind for s in out.segments] == ["model", "env", "model", "env", "model"]
    assert set(out.versions) == {4}
    out.validate()
    # each request continues exactly the tokens so far: nothing re-tokenized
    for req in engine.requests:
        assert req.input_ids == prompt + out.response_tokens[: req.num_prefix_tokens]
    assert out.reward == 1.0 + 2.0 + 3.0
    env = CountdownEnv.instances[-1]
    assert env.actions == [TOKENIZER.decode(a) for a in actions] and env.closed
    assert ro.stats()["env/episodes_completed"] == 1.0 and ro.stats()["env/turns"] == 3.0


def test_observation_is_tokenized_once(monkeypatch) -> None:
    calls: list[str] = []
    real = TOKENIZER.encode
    t = make_traj()

    def spy(text, **kw):
        calls.append(text)
        return real(text, **kw)

    monkeypatch.setattr(TOKENIZER, "encode", spy)
    run(rollout(CountdownEnv)(t, make_ctx(ScriptedEngine())))
    assert sorted(calls) == sorted(CHAT.observation_text(f"obs{i}") for i in (1, 2))


def test_reset_observation_becomes_the_prompt() -> None:
    t = make_traj()
    out = run(rollout(lambda: CountdownEnv(turns=1, first="pick a number"))(t, make_ctx(ScriptedEngine())))
    assert out.prompt_tokens == TOKENIZER.encode(CHAT.prompt_text("pick a number"))
    assert out.prompt == CHAT.prompt_text("pick a number")


def test_stop_token_of_the_template_is_not_written_twice() -> None:
    im_end = TOKENIZER.backend.token_to_id("<|im_end|>")
    engine = ScriptedEngine([[50, im_end], [60, EOS]])
    ro = EnvRollout(lambda: CountdownEnv(turns=2), EnvConfig(env_stop_token_ids=[im_end]), tokenizer=TOKENIZER)
    out = run(ro(make_traj(), make_ctx(engine)))
    text = TOKENIZER.decode(out.response_tokens, skip_special_tokens=False)
    assert text.startswith(TOKENIZER.decode([50]) + "<|im_end|>\n<|im_start|>user\nobs1<|im_end|>\n<|im_start|>assistant\n")
    assert im_end in engine.requests[0].sampling.stop_token_ids


def test_stops_from_flags_env_and_rollout_reach_the_engine() -> None:
    class Stopping(CountdownEnv):
        stop = ["</call>"]
        stop_token_ids = [77]

    engine = ScriptedEngine()
    ro = EnvRollout(lambda: Stopping(turns=1), EnvConfig(env_stop=["END"]), tokenizer=TOKENIZER)
    run(ro(make_traj(), make_ctx(engine, stop=["###"], stop_token_ids=[9])))
    sp = engine.requests[0].sampling
    assert sp.stop == ["###", "END", "</call>"] and sp.stop_token_ids == [9, 77]


def test_max_turns_truncates_with_the_rewards_so_far() -> None:
    out = run(rollout(lambda: CountdownEnv(turns=10), max_turns=2)(make_traj(), make_ctx(ScriptedEngine())))
    assert out.status is Status.TRUNCATED and out.finish_reason == "max_turns"
    assert out.reward == 3.0 and [s.kind for s in out.segments] == ["model", "env", "model"]


def test_max_turn_tokens_bounds_each_request_and_the_turn_goes_on() -> None:
    engine = ScriptedEngine(default=[30, 31, 32, 33, 34, 35, EOS])
    out = run(rollout(lambda: CountdownEnv(turns=2), max_turn_tokens=4)(make_traj(), make_ctx(engine)))
    assert out.status is Status.COMPLETED
    for req in engine.requests:
        assert req.sampling.max_new_tokens - req.num_prefix_tokens == 4
    assert [s.end - s.start for s in out.segments if s.kind == "model"] == [4, 4]


@pytest.mark.parametrize("limit", ["max_total_tokens", "max_response_len", "engine"])
def test_token_budgets_truncate_the_episode(limit) -> None:
    t = make_traj()
    budget = len(t.prompt_tokens) + 40
    engine = ScriptedEngine(default=[30] * 12 + [EOS], max_seq_len=budget if limit == "engine" else 4096)
    config = {"max_total_tokens": budget} if limit == "max_total_tokens" else {}
    ctx = make_ctx(engine, max_response_len=40 if limit == "max_response_len" else 512)
    out = run(rollout(lambda: CountdownEnv(turns=100), **config)(t, ctx))
    assert out.status is Status.TRUNCATED and out.finish_reason == "length"
    assert len(out.response_tokens) <= 40
    out.validate()


@pytest.mark.parametrize(("mode", "expected"), [("sum", 3.0), ("last", 2.0), ("none", None)])
def test_episode_reward_modes(mode, expected) -> None:
    out = run(rollout(lambda: CountdownEnv(turns=2), env_reward=mode)(make_traj(), make_ctx(ScriptedEngine())))
    assert out.reward == expected


def test_gymnasium_five_tuple_truncation() -> None:
    class Gym(CountdownEnv):
        def step(self, action):
            return "x", 0.5, False, True, {}

    out = run(rollout(Gym)(make_traj(), make_ctx(ScriptedEngine())))
    assert out.status is Status.TRUNCATED and out.finish_reason == "env_truncated" and out.reward == 0.5


def test_raw_and_custom_templates() -> None:
    for template, expected in (("raw", "obs1"), ("\n<r>{observation}</r>\n", "\n<r>obs1</r>\n")):
        engine = ScriptedEngine([[50, EOS], [60, EOS]])
        ro = rollout(lambda: CountdownEnv(turns=2), env_turn_template=template)
        out = run(ro(make_traj(), make_ctx(engine)))
        env_seg = next(s for s in out.segments if s.kind == "env")
        assert out.response_tokens[env_seg.start: env_seg.end] == TOKENIZER.encode(expected)


def test_many_episodes_share_one_rollout() -> None:
    engine = ScriptedEngine()
    ro = rollout(lambda: CountdownEnv(turns=3))
    trajs = [make_traj(f"t{i}") for i in range(16)]

    async def go():
        return await asyncio.gather(*(ro(t, make_ctx(engine)) for t in trajs))

    outs = run(go())
    assert all(o.status is Status.COMPLETED and o.reward == 6.0 for o in outs)
    assert ro.stats()["env/turns_per_episode"] == 3.0 and ro.stats()["env/parked_envs"] == 0.0


def test_occupancy_integrates_episodes_in_flight() -> None:
    ticks = iter(range(10_000))
    engine = ScriptedEngine()
    ro = EnvRollout(lambda: CountdownEnv(turns=2), EnvConfig(), tokenizer=TOKENIZER, clock=lambda: float(next(ticks)))

    async def go():
        await ro(make_traj("solo"), make_ctx(engine))
        alone = ro.stats()
        await asyncio.gather(*(ro(make_traj(f"t{i}"), make_ctx(engine)) for i in range(4)))
        return alone, ro.stats()

    alone, after = run(go())
    assert alone["env/episode_s"] == alone["env/busy_s"] > 0  # one episode: in flight = busy
    assert after["env/episode_s"] > after["env/busy_s"]  # overlapping episodes count each
    assert after["env/window_s"] >= after["env/busy_s"] and after["env/inflight"] == 0.0
