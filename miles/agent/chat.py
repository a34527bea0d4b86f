"""OpenAI chat messages in and out: checking requests, rendering, parsing the model's tool calls.

Requests are checked here once (``check_messages``, ``check_tools``): anything malformed is an
``AgentError`` with status 400 and a message an agent developer can act on, which the server
sends as OpenAI's ``{"error": {...}}`` body (the ``openai`` client raises ``BadRequestError``).

Messages are kept in one normal form (``norm``): role, content as a string, tool calls as
``(id, name, arguments dict)``. Two requests' histories are compared in that form, so a
client that sends back the assistant message it received (``message.model_dump()``, or a
dict of its own with ``content=None``) extends the session instead of drifting.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from miles.envs.tools import ToolCallError, parse_tool_calls

ROLES = ("system", "developer", "user", "assistant", "tool")
_SENTINEL = "\u2063MILES_ASSISTANT_SENTINEL\u2063"


class AgentError(Exception):
    """A request the session refuses: ``status`` is the HTTP status, str(self) the message."""

    def __init__(self, status: int, message: str, *, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.param = status, kind, param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.status}}


def _text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: only text ones
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise AgentError(400, f"{where}: only text content parts ({{'type': 'text', 'text': ...}}) are "
                                      f"supported", param="messages")
            parts.append(part["text"])
        return "".join(parts)
    raise AgentError(400, f"{where}: content must be a string, a list of text parts or null, "
                          f"got {type(content).__name__}", param="messages")


def _tool_calls(raw: Any, where: str) -> list[tuple[str, str, dict[str, Any]]]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise AgentError(400, f"{where}: tool_calls must be a list", param="messages")
    out = []
    for j, call in enumerate(raw):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise AgentError(400, f"{where}.tool_calls[{j}]: expected {{'type': 'function', 'function': "
                                  f"{{'name', 'arguments'}}}}", param="messages")
        args = fn.get("arguments") or {}
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                raise AgentError(400, f"{where}.tool_calls[{j}]: arguments are not valid JSON",
                                 param="messages") from None
        if not isinstance(args, dict):
            raise AgentError(400, f"{where}.tool_calls[{j}]: arguments must be a JSON object", param="messages")
        out.append((str(call.get("id") or ""), fn["name"], args))
    return out


def check_messages(messages: Any) -> list[dict[str, Any]]:
    """The request's ``messages`` in normal form, or AgentError(400) saying what is wrong."""
    if not isinstance(messages, list) or not messages:
        raise AgentError(400, "messages must be a non-empty list of {'role', 'content'} objects", param="messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise AgentError(400, f"{where} must be an object, got {type(m).__name__}", param="messages")
        role = m.get("role")
        if role not in ROLES:
            raise AgentError(400, f"{where}: role must be one of {', '.join(ROLES)}, got {role!r}", param="messages")
        if role != "assistant" and "content" not in m:
            raise AgentError(400, f"{where}: a {role} message needs content", param="messages")
        msg: dict[str, Any] = {"role": role, "content": _text(m.get("content"), where)}
        calls = _tool_calls(m.get("tool_calls"), where) if role == "assistant" else []
        if calls:
            msg["tool_calls"] = calls
        if role == "tool" and m.get("tool_call_id") is not None:
            msg["tool_call_id"] = str(m["tool_call_id"])
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    return out


def check_tools(tools: Any, tool_choice: Any) -> list[dict[str, Any]] | None:
    """``tools`` as the chat template takes them (None when absent or ``tool_choice`` is none)."""
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(
        isinstance(t, dict) and t.get("type") == "function" and isinstance((t.get("function") or {}).get("name"), str)
        for t in tools
    ):
        raise AgentError(400, "tools must be a list of {'type': 'function', 'function': {'name', ...}}", param="tools")
    if tool_choice not in (None, "auto", "none", "required") and not isinstance(tool_choice, dict):
        raise AgentError(400, f"tool_choice must be 'auto', 'none', 'required' or a named function, "
                              f"got {tool_choice!r}", param="tool_choice")
    return None if tool_choice == "none" else tools


def _for_template(msg: dict[str, Any]) -> dict[str, Any]:
    """A normal-form message as chat templates expect it (tool call arguments as dicts)."""
    out = {k: v for k, v in msg.items() if k != "tool_calls"}
    if msg.get("tool_calls"):
        out["tool_calls"] = [{"id": cid, "type": "function", "function": {"name": name, "arguments": args}}
                             for cid, name, args in msg["tool_calls"]]
    return out


def render(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, *,
           generation_prompt: bool) -> str:
    """The conversation as the checkpoint's chat template writes it."""
    kwargs: dict[str, Any] = {"tools": tools} if tools else {}
    try:
        return str(tokenizer.apply_chat_template([_for_template(m) for m in messages], tokenize=False,
                                                 add_generation_prompt=generation_prompt, **kwargs))
    except Exception as exc:  # a template's raise_exception (e.g. roles out of order)
        raise AgentError(400, f"the chat template cannot render these messages: {exc}", param="messages") from None


def assistant_close(tokenizer: Any, tools: list[dict[str, Any]] | None) -> str:
    """What the template writes after an assistant message's content (ChatML: ``<|im_end|>\\n``).
    Probed on a one-exchange conversation (templates close an assistant turn the same way
    wherever it stands), once per session: a render of the whole history costs more."""
    probe = [{"role": "user", "content": "\u2063"}, {"role": "assistant", "content": _SENTINEL}]
    text = render(tokenizer, probe, tools, generation_prompt=False)
    at = text.rfind(_SENTINEL)
    return text[at + len(_SENTINEL):] if at >= 0 else ""


def assistant_message(text: str, *, parse_tools: bool) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The response ``message`` for the model's text, and its tool calls (OpenAI's shape).

    Tool calls are the Hermes ``<tool_call>{json}</tool_call>`` blocks (Qwen2.5 / Qwen3); text
    outside them is the content. A malformed block is left in the content as the model wrote
    it (the agent sees it and can answer it), with no tool call."""
    calls: list[dict[str, Any]] = []
    content: str | None = text
    if parse_tools and "<tool_call>" in text:
        try:
            parsed = parse_tool_calls(text)
        except ToolCallError:
            parsed = []
        if parsed:
            calls = [{"id": f"call_{secrets.token_hex(8)}", "type": "function",
                      "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for c in parsed]
            head = text[: text.find("<tool_call>")]
            tail = text[text.rfind("</tool_call>") + len("</tool_call>"):]
            content = (head + tail).strip() or None
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    return message, calls


def same_history(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    """Whether two normal-form histories are the same conversation (tool call ids aside:
    clients may rewrite them; names and arguments must match)."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x["role"] != y["role"] or x["content"] != y["content"]:
            return False
        cx, cy = x.get("tool_calls", []), y.get("tool_calls", [])
        if [(n, args) for _, n, args in cx] != [(n, args) for _, n, args in cy]:
            return False
    return True
