"""Tool calling: parse the calls a model wrote, run them, and a ready-made ``ToolEnv``.

Formats:

- ``parse_tool_calls``: the Hermes format that Qwen2.5 / Qwen3 (and many others) are
  trained on — a JSON object ``{"name": ..., "arguments": {...}}`` between
  ``<tool_call>`` and ``</tool_call>``; several calls may follow each other.
- ``parse_tagged``: the contents of ``<tag>…</tag>`` spans (Search-R1's
  ``<search>query</search>``, ``<answer>…</answer>``).

A malformed call raises ``ToolCallError`` with a message meant for the model: an Env
should answer it as an observation (the model can learn from it), not fail the episode.

``ToolEnv`` is an Env for the common loop: each model turn either calls tools — the
observation is their results — or answers without a call, which ends the episode and is
scored by ``score(answer, sample)``. Its ``stop`` ends a turn right after a call.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from miles.types import Trajectory

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"


class ToolCallError(ValueError):
    """A tool call the model wrote cannot be used; str(self) is a message for the model."""


class ToolCall(msgspec.Struct, frozen=True):
    name: str
    arguments: dict[str, Any] = {}


def parse_tool_calls(text: str, *, open_tag: str = TOOL_CALL_OPEN, close_tag: str = TOOL_CALL_CLOSE) -> list[ToolCall]:
    """Every ``open_tag {json} close_tag`` call in ``text``, in order ([] when none)."""
    calls: list[ToolCall] = []
    pos = 0
    while (start := text.find(open_tag, pos)) >= 0:
        end = text.find(close_tag, start + len(open_tag))
        if end < 0:
            raise ToolCallError(f"a {open_tag} without its {close_tag}")
        body = text[start + len(open_tag): end].strip()
        pos = end + len(close_tag)
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as exc:
            raise ToolCallError(f"the tool call is not valid JSON ({exc.msg} at char {exc.pos})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            raise ToolCallError('a tool call must be a JSON object {"name": ..., "arguments": {...}}')
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):  # some models emit the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                raise ToolCallError("the tool call's arguments are not a JSON object") from None
        if not isinstance(args, dict):
            raise ToolCallError("the tool call's arguments must be a JSON object")
        calls.append(ToolCall(name=obj["name"], arguments=args))
    return calls


def parse_tagged(text: str, tag: str) -> list[str]:
    """Contents of every complete ``<tag>…</tag>`` in ``text`` (stripped)."""
    pattern = re.compile(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", re.DOTALL)
    return [m.strip() for m in pattern.findall(text)]


def format_tool_result(result: Any) -> str:
    """A tool's result as observation text: strings as they are, the rest as JSON."""
    if isinstance(result, str):
        return result
    try:
        return json.dumps(result, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        return str(result)


ToolFn = Callable[..., Any]


class ToolEnv:
    """A function-calling Env. Give it tools (name → callable taking keyword arguments,
    sync or async); subclass and override ``score`` (or pass ``score=``) to reward the
    final answer. ``reset`` keeps the data prompt (which should describe the tools)."""

    stop = [TOOL_CALL_CLOSE]

    def __init__(
        self,
        tools: Mapping[str, ToolFn] | None = None,
        *,
        score: Callable[[str, Trajectory], float] | None = None,
        max_calls_per_turn: int = 4,
        tool_timeout_s: float = 30.0,
        wrap_results: bool = False,
    ) -> None:
        self.tools: dict[str, ToolFn] = dict(tools or {})
        self._score = score
        self.max_calls_per_turn = max_calls_per_turn
        self.tool_timeout_s = tool_timeout_s
        # With a chat template whose tool role wraps results itself (Qwen's "tool" role
        # renders <tool_response>), leave this off; for raw templates turn it on.
        self.wrap_results = wrap_results
        self.sample: Trajectory | None = None
        self.calls = 0

    def reset(self, sample: Trajectory) -> str:
        self.sample = sample
        return ""

    def score(self, answer: str, sample: Trajectory) -> float:
        """The episode's reward for the final answer (a turn without tool calls)."""
        if self._score is None:
            raise NotImplementedError("ToolEnv needs score= or a score() override")
        return float(self._score(answer, sample))

    async def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        try:
            calls = parse_tool_calls(action)
        except ToolCallError as exc:
            return self._wrap(f"error: {exc}"), 0.0, False, {"tool_error": str(exc)}
        if not calls:
            assert self.sample is not None, "step before reset"
            reward = await asyncio.to_thread(self.score, action, self.sample)
            return "", reward, True, {"tool_calls": self.calls}
        results = [await self._run(c) for c in calls[: self.max_calls_per_turn]]
        self.calls += len(results)
        return "\n".join(self._wrap(r) for r in results), 0.0, False, {"tool_calls": self.calls}

    async def _run(self, call: ToolCall) -> str:
        fn = self.tools.get(call.name)
        if fn is None:
            return f"error: unknown tool {call.name!r}; tools: {', '.join(sorted(self.tools))}"
        try:
            if inspect.iscoroutinefunction(fn):
                result = await asyncio.wait_for(fn(**call.arguments), self.tool_timeout_s)
            else:
                result = await asyncio.wait_for(asyncio.to_thread(fn, **call.arguments), self.tool_timeout_s)
        except asyncio.TimeoutError:
            return f"error: {call.name} timed out after {self.tool_timeout_s}s"
        except Exception as exc:  # the model's arguments were wrong: tell it
            return f"error: {call.name} raised {type(exc).__name__}: {exc}"
        return format_tool_result(result)

    def _wrap(self, text: str) -> str:
        return f"<tool_response>\n{text}\n</tool_response>" if self.wrap_results else text
