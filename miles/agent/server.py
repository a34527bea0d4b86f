"""The session server: an OpenAI-compatible HTTP API per episode, on the rollout worker.

One ``AgentServer`` per rollout worker, on the worker's event loop (``miles.agent.http``: a
small HTTP/1.1 server, as a session's calls are per-turn overhead), listening on
``--agent-host`` (loopback by default: the API has no other authentication) and
``--agent-port`` (0: a free port). Each episode's base URL is
``http://HOST:PORT/s/<session id>/v1``; under it:

- ``POST /chat/completions``: messages (and ``tools`` / ``tool_choice``) rendered with the
  checkpoint's chat template; ``temperature``, ``top_p``, ``max_tokens`` (or
  ``max_completion_tokens``), ``stop``, ``logprobs``, ``n=1``, ``stream`` (SSE);
- ``POST /completions``: a prompt string or token ids, same sampling fields;
- ``GET /models``: the one model.

Responses have OpenAI's fields (``choices``, ``message`` with ``tool_calls`` parsed from the
model's Hermes ``<tool_call>`` blocks, ``finish_reason``, ``usage``) and, in each choice,
``token_ids`` and ``versions``: the sampled ids and the policy version of each. Errors are
OpenAI's ``{"error": {"message", "type", "param", "code"}}`` with a 4xx status: unknown
session 404, ended 410, a second concurrent request on one session 409, malformed input 400.
A stream is produced once the call is finished (one content delta, then the tool calls,
then the finish reason and usage), so every field a client reads is the same as without it.
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Any

import msgspec

from miles.agent.chat import AgentError, check_messages, check_tools
from miles.agent.http import HttpServer, Reply, Request
from miles.agent.session import Session, SessionStore, Turn

_encode = msgspec.json.Encoder().encode
_ROUTES = {"chat/completions": "POST", "completions": "POST", "models": "GET"}


def _error(exc: AgentError) -> Reply:
    return Reply(exc.status, json.dumps(exc.body()).encode())


def _number(body: dict[str, Any], name: str, lo: float, hi: float) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise AgentError(400, f"{name} must be a number in [{lo}, {hi}], got {value!r}", param=name)
    return float(value)


def _sampling(body: dict[str, Any]) -> tuple[int | None, list[str], dict[str, Any]]:
    """(max_tokens, stop strings, SamplingParams overrides) of a request."""
    n = body.get("n", 1)
    if n not in (None, 1):
        raise AgentError(400, f"n={n!r}: a session samples one choice per request (n=1); send n requests",
                         param="n")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise AgentError(400, f"max_tokens must be a positive integer, got {max_tokens!r}", param="max_tokens")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(x, str) and x for x in stop):
        raise AgentError(400, "stop must be a non-empty string or a list of them", param="stop")
    overrides: dict[str, Any] = {}
    for name, hi in (("temperature", 2.0), ("top_p", 1.0)):
        value = _number(body, name, 0.0, hi)
        if value is not None:
            overrides[name] = value
    if overrides.get("top_p") == 0.0:
        raise AgentError(400, "top_p must be > 0", param="top_p")
    return max_tokens, stop, overrides


class AgentServer:
    """The sessions' routes and their listening socket."""

    def __init__(self, store: SessionStore | None = None, *, model_name: str = "miles") -> None:
        self.store = store or SessionStore()
        self.model_name = model_name
        self.host, self.port = "127.0.0.1", 0
        self.http = HttpServer(self.handle, max_body=64 * 1024 * 1024)
        self.counters: dict[str, float] = {"requests": 0, "rejected": 0, "call_s": 0.0, "engine_s": 0.0}

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> None:
        await self.http.start(host, port)
        addresses = self.http.addresses  # the port 0 resolved to
        self.host, self.port = host, addresses[0][1] if addresses else port

    async def stop(self) -> None:
        await self.http.stop()

    @property
    def addresses(self) -> list[Any]:
        """The listening sockets' addresses."""
        return self.http.addresses

    def base_url(self, session: Session) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}/s/{session.id}/v1"

    # ---- routes --------------------------------------------------------------------------
    async def handle(self, request: Request) -> Reply:
        """``/s/<session id>/v1/<route>``; anything else is a 404 (405 for a known route's
        other methods)."""
        path = request.path.split("?", 1)[0]
        head, _, route = path.partition("/v1/")
        sid = head[3:] if head.startswith("/s/") else ""
        method = _ROUTES.get(route.rstrip("/"))
        if not sid or "/" in sid or method is None:
            return _error(AgentError(404, f"no route {path}", kind="not_found"))
        if request.method != method:
            return _error(AgentError(405, f"{request.method} is not allowed on {path}", kind="invalid_request_error"))
        if method == "GET":
            return self.models(sid)
        return await self._call(sid, request.body, chat=route.startswith("chat"))

    def models(self, sid: str) -> Reply:
        try:
            self.store.get(sid)
        except AgentError as exc:
            return _error(exc)
        card = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "miles"}
        return Reply(200, _encode({"object": "list", "data": [card]}))

    async def _call(self, sid: str, raw: bytes, *, chat: bool) -> Reply:
        t0 = time.perf_counter()
        self.counters["requests"] += 1
        try:
            session = self.store.get(sid)
            body = _body(raw)
            max_tokens, stop, overrides = _sampling(body)
            stream = bool(body.get("stream"))
            if chat:
                messages = check_messages(body.get("messages"))
                tools = check_tools(body.get("tools"), body.get("tool_choice"))
                top = body.get("top_logprobs")
                if top not in (None, 0):
                    raise AgentError(400, "top_logprobs is not supported (logprobs of the sampled tokens are)",
                                     param="top_logprobs")
                want_logprobs = bool(body.get("logprobs"))
            else:
                prompt = _prompt(body.get("prompt"))
                if body.get("echo"):
                    raise AgentError(400, "echo is not supported", param="echo")
                want_logprobs = body.get("logprobs") not in (None, 0, False)
                if body.get("max_tokens") is None:
                    max_tokens = 16  # OpenAI's default for /v1/completions
            if session.lock.locked():
                raise AgentError(409, "this session already has a request in flight; an episode's calls are "
                                      "sequential (open another sample for parallel work)", kind="conflict")
            async with session.lock:
                if session.ended:
                    raise AgentError(410, "this episode has ended: its session takes no more requests",
                                     kind="session_ended")
                if chat:
                    session.chat_context(messages, tools)
                else:
                    session.completion_context(prompt)
                t1 = time.perf_counter()
                turn = await session.generate(max_tokens=max_tokens, stop=stop, overrides=overrides,
                                              parse_tools=chat and tools is not None)
                self.counters["engine_s"] += time.perf_counter() - t1
        except AgentError as exc:
            self.counters["rejected"] += 1
            return _error(exc)
        finally:
            self.counters["call_s"] += time.perf_counter() - t0
        obj = self._response(session, turn, chat=chat, logprobs=want_logprobs)
        if not stream:
            return Reply(200, _encode(obj))
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        events = [b"data: " + _encode(c) + b"\n\n" for c in _chunks(obj, chat=chat, include_usage=include_usage)]
        return Reply(200, events=[*events, b"data: [DONE]\n\n"])

    def _response(self, session: Session, turn: Turn, *, chat: bool, logprobs: bool) -> dict[str, Any]:
        tok = session.tokenizer
        choice: dict[str, Any] = {"index": 0, "finish_reason": turn.finish_reason,
                                  "token_ids": turn.token_ids, "versions": turn.versions}
        if chat:
            choice["message"] = turn.message
            if logprobs:
                content = []
                for tid, lp in zip(turn.token_ids, turn.logprobs):
                    piece = tok.decode([tid], skip_special_tokens=False)
                    content.append({"token": piece, "logprob": lp, "bytes": list(piece.encode("utf-8")),
                                    "top_logprobs": []})
                choice["logprobs"] = {"content": content}
            else:
                choice["logprobs"] = None
        else:
            choice["text"] = turn.text
            choice["logprobs"] = None if not logprobs else {
                "tokens": [tok.decode([t], skip_special_tokens=False) for t in turn.token_ids],
                "token_logprobs": turn.logprobs, "top_logprobs": None, "text_offset": None}
        n_out = len(turn.token_ids)
        return {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [choice],
            "usage": {"prompt_tokens": turn.prompt_tokens, "completion_tokens": n_out,
                      "total_tokens": turn.prompt_tokens + n_out},
            "miles": {"segment": len(session.done_segments), "call": session.calls},
        }


def _body(raw: bytes) -> dict[str, Any]:
    try:
        body = msgspec.json.decode(raw) if raw.strip() else None
    except (msgspec.DecodeError, ValueError, UnicodeDecodeError) as exc:
        raise AgentError(400, f"the body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise AgentError(400, "the body must be a JSON object")
    return body


def _prompt(prompt: Any) -> str | list[int]:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str) and prompt:
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                   for t in prompt):
        return prompt
    raise AgentError(400, "prompt must be a non-empty string or a list of token ids (one prompt per request)",
                     param="prompt")


def _chunks(obj: dict[str, Any], *, chat: bool, include_usage: bool) -> list[dict[str, Any]]:
    """A finished response as the chunks of a stream (OpenAI's ``chat.completion.chunk``)."""
    head = {k: obj[k] for k in ("id", "created", "model")}
    choice = obj["choices"][0]
    kind = "chat.completion.chunk" if chat else "text_completion"
    out: list[dict[str, Any]] = []

    def chunk(**fields: Any) -> None:
        out.append({**head, "object": kind, "choices": [{"index": 0, "finish_reason": None, **fields}]})

    if chat:
        msg = choice["message"]
        chunk(delta={"role": "assistant", "content": ""})
        if msg.get("content"):
            chunk(delta={"content": msg["content"]}, logprobs=choice["logprobs"])
        for j, call in enumerate(msg.get("tool_calls") or []):
            chunk(delta={"tool_calls": [{"index": j, **call}]})
        last = {"delta": {}}
    else:
        last = {"text": choice["text"], "logprobs": choice["logprobs"]}
    chunk(**last, finish_reason=choice["finish_reason"], token_ids=choice["token_ids"], versions=choice["versions"])
    if include_usage:
        out.append({**head, "object": kind, "choices": [], "usage": obj["usage"]})
    return out
