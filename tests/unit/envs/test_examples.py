"""The agentic examples' environments (examples/agentic)."""

from __future__ import annotations

import asyncio
import json

import pytest

from miles.types import Status
from miles.utils.loading import load_function
from tests.unit.envs.helpers import TOKENIZER, ScriptedEngine, make_ctx, make_traj, rollout

NumberGuessEnv = load_function("examples/agentic/number_guess.py:NumberGuessEnv")
calc = load_function("examples/agentic/calculator.py:calculator")
CalculatorEnv = load_function("examples/agentic/calculator.py:CalculatorEnv")
problems = load_function("examples/agentic/calculator.py:problems")


def test_number_guess_feedback() -> None:
    env = NumberGuessEnv(high=7)
    env.reset(make_traj(label=5))
    assert env.step("3") == ("higher", 0.0, False, {"valid": True})
    assert env.step(" 6!") == ("lower", 0.0, False, {"valid": True})
    assert env.step("zz") == ("say a number from 1 to 7", -0.1, False, {"valid": False})
    assert env.step("9") == ("say a number from 1 to 7", -0.1, False, {"valid": False})
    assert env.step("5") == ("correct", 1.0, True, {"valid": True, "solved": True})


def test_number_guess_episode_rewards_only_solved_games_above_zero() -> None:
    solved = [TOKENIZER.encode("4"), TOKENIZER.encode("6"), TOKENIZER.encode("5")]
    out = asyncio.run(rollout(lambda: NumberGuessEnv(high=7), max_turns=3)(make_traj(label=5), make_ctx(ScriptedEngine(solved))))
    assert out.status is Status.COMPLETED and out.reward == 1.0
    assert "higher" in out.response and "lower" in out.response
    lost = [TOKENIZER.encode("x"), TOKENIZER.encode("1"), TOKENIZER.encode("2")]
    out = asyncio.run(rollout(lambda: NumberGuessEnv(high=7), max_turns=3)(make_traj(label=5), make_ctx(ScriptedEngine(lost))))
    assert out.status is Status.TRUNCATED and out.reward == pytest.approx(-0.1)


def test_calculator_is_arithmetic_only() -> None:
    assert calc("2 + 3 * (4 - 1)") == 11 and calc("-2 ** 3") == -8 and calc("7 // 2") == 3
    for bad in ("__import__('os')", "x + 1", "2 ** 1000", "[1, 2]", "1" * 300):
        with pytest.raises(ValueError):
            calc(bad)
    with pytest.raises(ZeroDivisionError):
        calc("1 / 0")


def test_calculator_episode() -> None:
    row = problems(1, seed=0)[0]
    label = row["label"]
    call = json.dumps({"name": "calculator", "arguments": {"expression": "6 * 7"}})
    engine = ScriptedEngine([TOKENIZER.encode(f"<tool_call>{call}</tool_call>"), TOKENIZER.encode(f"It is {label}")])
    out = asyncio.run(rollout(CalculatorEnv, env_turn_template="raw")(make_traj(label=label), make_ctx(engine)))
    assert out.status is Status.COMPLETED and out.reward == 1.0 and "42" in out.response
    assert row["input"][0]["role"] == "system" and "<tools>" in row["input"][0]["content"]
