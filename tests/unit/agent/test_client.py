"""The episode client (``miles.agent.client``): its request bodies are the library's.

``create`` there skips the ``openai`` request transform on the grounds that the chat and
completions params declare no key alias or value format; these tests fail if an ``openai``
release adds one, or if the body built instead differs from what the transform returns.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import openai
import pytest
import typing_extensions as te
from openai._utils._transform import PropertyInfo, async_maybe_transform
from openai.types import completion_create_params as text_params
from openai.types.chat import ChatCompletionMessage, completion_create_params as chat_params

from miles.agent.client import _CHAT, _TEXT


def _property_infos(tp: Any, seen: set[int]) -> list[PropertyInfo]:
    """Every PropertyInfo in the annotations reachable from ``tp``."""
    if id(tp) in seen:
        return []
    seen.add(id(tp))
    found = [a for a in getattr(tp, "__metadata__", ()) if isinstance(a, PropertyInfo)]
    for arg in te.get_args(tp):
        found += _property_infos(arg, seen)
    if te.is_typeddict(tp):
        for hint in te.get_type_hints(tp, include_extras=True).values():
            found += _property_infos(hint, seen)
    return found


def test_the_check_sees_an_alias() -> None:
    response_create_params = pytest.importorskip("openai.types.beta.response_create_params")
    assert [i.alias for i in _property_infos(response_create_params.ResponseCreateParamsBase, set()) if i.alias]


@pytest.mark.parametrize("params", [chat_params.CompletionCreateParamsStreaming,
                                    chat_params.CompletionCreateParamsNonStreaming,
                                    text_params.CompletionCreateParamsStreaming,
                                    text_params.CompletionCreateParamsNonStreaming])
def test_params_declare_no_alias_or_format(params: Any) -> None:
    infos = _property_infos(params, set())
    assert not [i for i in infos if i.alias or i.format], "the transform rewrites these params now"


def _library_body(params: dict[str, Any], annotation: Any) -> Any:
    kw = {k: v for k, v in params.items() if k not in ("extra_body", "extra_headers", "timeout")}
    return asyncio.run(async_maybe_transform(kw, annotation))


def test_chat_body_is_what_the_transform_returns() -> None:
    reply = ChatCompletionMessage(role="assistant", content=None, tool_calls=[
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}])
    params = {
        "model": "m",
        "messages": ({"role": "system", "content": "s"},
                     {"role": "user", "content": [{"type": "text", "text": "hi"}]},
                     reply,
                     {"role": "tool", "tool_call_id": "call_1", "content": "2", "name": openai.omit}),
        "tools": [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}],
        "tool_choice": "auto", "stop": ["a", "b"], "max_tokens": 8, "temperature": 0.5, "top_p": openai.omit,
        "logit_bias": {"1": 2}, "stream_options": {"include_usage": True}, "stream": True, "seed": None,
        "extra_headers": {"x": "y"}, "timeout": 3.0,
    }
    ours = _CHAT.body(params)
    assert json.loads(json.dumps(ours)) == json.loads(json.dumps(
        _library_body(params, chat_params.CompletionCreateParamsStreaming)))
    assert "top_p" not in ours and ours["seed"] is None and "timeout" not in ours


def test_completions_body_is_what_the_transform_returns() -> None:
    params = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 4, "stop": "x", "logprobs": 1, "echo": openai.omit}
    ours = _TEXT.body(params)
    assert ours == _library_body(params, text_params.CompletionCreateParamsNonStreaming)


def test_extra_body_is_merged_and_bad_arguments_raise_as_in_the_library() -> None:
    assert _CHAT.body({"model": "m", "messages": [], "extra_body": {"top_k": 5}})["top_k"] == 5
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_token'"):
        _CHAT.body({"model": "m", "messages": [], "max_token": 3})
    with pytest.raises(TypeError, match="messages"):
        _CHAT.body({"model": "m"})
    with pytest.raises(TypeError, match="parse"):
        _CHAT.body({"model": "m", "messages": [], "response_format": ChatCompletionMessage})


def test_a_refused_connection_is_the_library_s_connection_error() -> None:
    import socket

    from miles.agent.client import ClientFactory

    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    async def go() -> None:
        factory = ClientFactory()
        client = factory(f"http://127.0.0.1:{port}/v1", 5.0)
        try:
            with pytest.raises(openai.APIConnectionError):
                await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        finally:
            await factory.close()

    asyncio.run(go())


def test_requests_and_responses_read_as_httpx_ones_and_raw_responses_still_work() -> None:
    """The lean request and response objects (built as httpx leaves read ones) carry what the
    library and an agent read: the body, Content-Length, headers, content, json; a raw
    response (``with_raw_response``) goes the library's way and parses to the same result."""
    from miles.agent.client import ClientFactory
    from miles.agent.http import HttpServer, Reply

    seen: list[Any] = []
    canned = {"id": "c1", "object": "chat.completion", "created": 0, "model": "m",
              "choices": [{"index": 0, "message": {"role": "assistant", "content": "hé"}, "finish_reason": "stop",
                           "token_ids": [7]}],
              "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}

    async def handler(request: Any) -> Reply:
        seen.append(request)
        return Reply(200, json.dumps(canned).encode())

    async def go() -> tuple[Any, Any, Any]:
        server = HttpServer(handler)
        await server.start("127.0.0.1", 0)
        factory = ClientFactory()
        client = factory(f"http://127.0.0.1:{server.addresses[0][1]}/v1", 5.0)
        sent: list[Any] = []
        send = client._client.send

        async def spy(request: Any, **kw: Any) -> Any:
            response = await send(request, **kw)
            sent.append((request, response))
            return response

        client._client.send = spy  # type: ignore[method-assign]
        try:
            args = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
            first = await client.chat.completions.create(**args)
            second = await client.chat.completions.create(**args, max_tokens=3)  # the cached request shape
            raw = await client.chat.completions.with_raw_response.create(**args)
            return first, second, (raw, raw.parse(), sent)
        finally:
            await factory.close()
            await server.stop()

    first, second, (raw, parsed, sent) = asyncio.run(go())
    assert first.choices[0].message.content == "hé" and first.choices[0].model_extra["token_ids"] == [7]
    assert second == first and parsed == first and raw.headers["content-type"] == "application/json"
    assert json.loads(seen[1].body) == {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 3}
    assert int(seen[1].headers["content-length"]) == len(seen[1].body)
    request, response = sent[1]
    assert request.content == seen[1].body and request.headers["Content-Length"] == str(len(seen[1].body))
    assert response.json() == canned and response.text == json.dumps(canned) and response.is_closed
    assert asyncio.run(response.aread()) == json.dumps(canned).encode()
