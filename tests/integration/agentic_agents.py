"""Agents for tests/integration/test_agent.py, loaded by the rollout workers from this file.

``scripted`` picks its behaviour from the sample's label: a 5-call tool loop that records
the ids it was sent ("ok"), or one of the ways an agent goes wrong.
"""

from __future__ import annotations

import asyncio
from typing import Any

import openai

TOOLS = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}]
_LEFT: dict[str, Any] = {}  # a client kept past its episode ("late")


async def scripted(client: openai.AsyncOpenAI, sample: Any) -> float | None:
    kind = sample.label
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"task {kind}"}]
    received = sample.metadata.setdefault("received", [])
    if kind == "raise":
        await client.chat.completions.create(model="m", messages=messages, max_tokens=4)
        raise RuntimeError("the agent's tool crashed")
    if kind == "hang":
        await client.chat.completions.create(model="m", messages=messages, max_tokens=4)
        await asyncio.Event().wait()
    if kind == "late" and "client" in _LEFT:  # an earlier episode's client: its session has ended
        try:
            await _LEFT["client"].chat.completions.create(model="m", messages=messages)
        except openai.APIStatusError as exc:
            sample.metadata["late_status"] = exc.status_code
    if kind == "refused":
        for bad in ({"messages": [{"role": "nobody", "content": "x"}]}, {"messages": messages, "n": 3}):
            try:
                await client.chat.completions.create(model="m", **bad)
            except openai.BadRequestError as exc:
                sample.metadata.setdefault("refused", []).append(exc.status_code)
    for i in range(5):  # five calls, each answered by a tool result
        r = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS, max_tokens=6)
        received.append(r.choices[0].model_extra["token_ids"])
        messages.append(r.choices[0].message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": f"c{i}", "content": f"result {i}"})
    _LEFT["client"] = client
    return 1.0 if kind != "none" else None


def zero_reward(sample: Any) -> float:
    """--custom-rm-path for the samples whose agent returns None."""
    return 0.0
