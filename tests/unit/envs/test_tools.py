"""Tool-call parsing and ToolEnv."""

from __future__ import annotations

import asyncio

import pytest

from miles.envs import ToolCall, ToolCallError, ToolEnv, format_tool_result, parse_tagged, parse_tool_calls
from miles.types import Status
from tests.unit.envs.helpers import ScriptedEngine, TOKENIZER, make_ctx, make_traj, rollout


def test_parse_hermes_tool_calls() -> None:
    text = ('Let me compute.\n<tool_call>\n{"name": "calc", "arguments": {"expression": "2+3"}}\n</tool_call>'
            '<tool_call>{"name": "now", "arguments": "{}"}</tool_call>')
    assert parse_tool_calls(text) == [ToolCall("calc", {"expression": "2+3"}), ToolCall("now", {})]
    assert parse_tool_calls("The answer is 5.") == []
    assert parse_tool_calls('<tool_call>{"name": "f", "parameters": {"x": 1}}</tool_call>') == [ToolCall("f", {"x": 1})]


@pytest.mark.parametrize(("text", "message"), [
    ('<tool_call>{"name": "calc"', "without its </tool_call>"),
    ("<tool_call>{calc}</tool_call>", "not valid JSON"),
    ('<tool_call>["calc"]</tool_call>', "must be a JSON object"),
    ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', "arguments must be a JSON object"),
    ('<tool_call>{"name": "f", "arguments": "nope"}</tool_call>', "arguments are not a JSON object"),
])
def test_malformed_calls_raise_a_message_for_the_model(text, message) -> None:
    with pytest.raises(ToolCallError, match=message):
        parse_tool_calls(text)


def test_parse_tagged_and_format() -> None:
    assert parse_tagged("<search> cats </search> and <search>dogs</search><search>open", "search") == ["cats", "dogs"]
    assert format_tool_result("x") == "x" and format_tool_result({"a": [1, 2]}) == '{"a": [1, 2]}'
    assert format_tool_result(object()).startswith('"<object')  # JSON of its str()


def _calc(expression: str) -> int:
    a, b = expression.split("+")
    return int(a) + int(b)


async def _slow() -> str:
    await asyncio.sleep(5)
    return "late"


class CalcEnv(ToolEnv):
    def __init__(self) -> None:
        super().__init__({"calc": _calc, "slow": _slow}, tool_timeout_s=0.05, wrap_results=True)

    def score(self, answer: str, sample) -> float:
        return float(answer.strip() == str(sample.label))


def _step(env: ToolEnv, action: str):
    return asyncio.run(env.step(action))


def test_tool_env_runs_tools_and_scores_the_answer() -> None:
    env = CalcEnv()
    env.reset(make_traj(label=5))
    obs, reward, done, info = _step(env, '<tool_call>{"name": "calc", "arguments": {"expression": "2+3"}}</tool_call>')
    assert (obs, reward, done, info) == ("<tool_response>\n5\n</tool_response>", 0.0, False, {"tool_calls": 1})
    obs, _, _, _ = _step(env, '<tool_call>{"name": "calc", "arguments": {"expression": "x"}}</tool_call>')
    assert "calc raised ValueError" in obs
    assert "unknown tool 'nope'; tools: calc, slow" in _step(env, '<tool_call>{"name": "nope"}</tool_call>')[0]
    assert "slow timed out" in _step(env, '<tool_call>{"name": "slow"}</tool_call>')[0]
    assert "not valid JSON" in _step(env, "<tool_call>{</tool_call>")[0]
    assert _step(env, " 5 ") == ("", 1.0, True, {"tool_calls": 4})


def test_tool_env_in_a_rollout() -> None:
    call = '<tool_call>{"name": "calc", "arguments": {"expression": "2+3"}}</tool_call>'
    engine = ScriptedEngine([TOKENIZER.encode(call) + [77], TOKENIZER.encode("5")])
    ro = rollout(CalcEnv)
    out = asyncio.run(ro(make_traj(label=5), make_ctx(engine)))
    assert out.status is Status.COMPLETED and out.reward == 1.0
    assert engine.requests[0].sampling.stop == ["</tool_call>"]
    assert "<tool_response>\n5\n</tool_response>" in out.response
