"""The ``openai.AsyncOpenAI`` each episode's agent gets, lean for a session server on loopback.

``ClientFactory`` (``miles.agent.rollout`` builds one per rollout worker) makes every
episode's client. An episode's calls are sequential round trips to this process's own
session server, so what the client does per call besides HTTP is per-turn overhead
(``benchmarks/agentic.py --overhead``). The stock client spends several times the server's
whole turn on work this path does not need; the client here leaves that out and keeps the
rest of the library (its ``request`` loop, headers, ``ChatCompletion`` objects,
``AsyncStream`` for ``stream=True``, ``BadRequestError`` and the other status errors):

- the request transform. ``chat.completions.create`` walks every message against the
  union of OpenAI's message TypedDicts to apply key aliases and value formats, several
  milliseconds for a few dozen messages. The chat and completions params declare none
  (``tests/unit/agent/test_client.py`` checks, so an ``openai`` that adds one fails
  there), so the transform returns the arguments less the omitted ones, with pydantic
  objects dumped; ``create`` here builds that body itself (the library's signature: the
  same names accepted and required) and hands it to the client's ``request``.
- per-call rebuilding: request options field by field, headers and URL (the same for
  every call of an episode's path), the platform lookup on a worker thread for telemetry
  headers (``X-Stainless-*``, for OpenAI's API, left out here).
- lenient response construction: pydantic's validator builds the ``ChatCompletion`` in a
  twentieth of the time (``_strict_response_validation``; the server's responses follow
  the schema).
- the response wrapper: for a plain call's JSON answer (no raw or streamed response, no
  extra headers, no post-parser) the body is decoded and validated straight into the
  result type, as the library's ``APIResponse.parse`` ends up doing after several times
  that much work on type dispatch and header lookups.
- httpx's send layers (auth flow, redirects, cookie jar, event hooks) and a general HTTP
  client under them. The session server needs none of them (the session id in the URL is
  the credential; it never redirects or sets cookies): ``_LoopbackHttp.send`` writes the
  request on a kept-alive connection of ``miles.agent.transport`` and reads the body with
  the head unless the caller streams.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Iterable, Mapping
from typing import Any

import msgspec
import openai
import pydantic
from openai._models import FinalRequestOptions, add_request_id
from openai._utils import is_given
from openai.resources.chat.completions import AsyncCompletions as _AsyncChatCompletions
from openai.resources.completions import AsyncCompletions as _AsyncTextCompletions
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from miles.agent import transport

# the httpx the installed openai is built on (``httpx`` or its fork ``httpx2``)
httpx = importlib.import_module(openai.DefaultAsyncHttpxClient.__mro__[1].__module__.split(".")[0])

_OMITTED = tuple(t for t in (getattr(openai, "Omit", None), getattr(openai, "NotGiven", None)) if t is not None)
_REQUEST_ARGS = ("extra_headers", "extra_query", "extra_body", "timeout")
_FORWARD = (str, int, float, bool, type(None))


def _plain(value: Any) -> Any:
    """``value`` as the request transform leaves it when no key has an alias or format:
    omitted entries dropped, pydantic objects dumped as the transform dumps them, other
    iterables as lists."""
    if isinstance(value, _FORWARD):
        return value
    if type(value) is dict and all(isinstance(v, _FORWARD) for v in value.values()):
        return value  # a message of strings, as most are: nothing to drop or dump
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items() if not isinstance(v, _OMITTED)}
    if isinstance(value, pydantic.BaseModel):
        return value.model_dump(exclude_unset=True, mode="json", exclude=getattr(value, "__api_exclude__", None))
    if isinstance(value, Iterable) and not isinstance(value, (bytes, bytearray)):
        return [_plain(v) for v in value]
    return value


class _Create:
    """One ``create`` endpoint: its path, result types, and the library's signature."""

    def __init__(self, path: str, library_create: Any, cast_to: type, chunk: type) -> None:
        self.path, self.cast_to, self.chunk = path, cast_to, chunk
        self.stream_cls = openai.AsyncStream[chunk]
        # The request options every call starts from, copied (shallow) per call: building
        # them field by field costs more than the copy. ``security`` as the library's create
        # passes it, where this openai has the field.
        fields = getattr(FinalRequestOptions, "model_fields", {})
        security = {"security": {"bearer_auth": True}} if "security" in fields else {}
        self.template = FinalRequestOptions.construct(method="post", url=path, **security)
        params = inspect.signature(library_create).parameters
        self.names = frozenset(params) - {"self"}
        self.required = tuple(n for n, p in params.items()
                              if n != "self" and p.kind is p.KEYWORD_ONLY and p.default is p.empty)

    def body(self, params: dict[str, Any]) -> dict[str, Any]:
        """The JSON body of a call with these keyword arguments (TypeError where the library's
        ``create`` would raise one)."""
        unknown = params.keys() - self.names
        if unknown:
            raise TypeError(f"create() got an unexpected keyword argument {sorted(unknown)[0]!r}")
        missing = [n for n in self.required if n not in params]
        if missing:
            raise TypeError(f"create() is missing required arguments: {', '.join(missing)}")
        if isinstance(params.get("response_format"), type):  # a pydantic class: parse()'s job
            raise TypeError("You tried to pass a `BaseModel` class to `chat.completions.create()`; "
                            "You must use `chat.completions.parse()` instead")
        body = {k: _plain(v) for k, v in params.items() if k not in _REQUEST_ARGS and not isinstance(v, _OMITTED)}
        if params.get("extra_body"):
            body.update(_plain(params["extra_body"]))
        return body

    async def __call__(self, resource: Any, params: dict[str, Any]) -> Any:
        # the body as JSON bytes (the client's Content-Type is JSON already); msgspec raises
        # TypeError on what JSON cannot hold, as the library's json.dumps does
        update: dict[str, Any] = {"content": msgspec.json.encode(self.body(params))}
        if params.get("extra_headers") is not None:
            update["headers"] = params["extra_headers"]
        if params.get("extra_query") is not None:
            update["params"] = params["extra_query"]
        if "timeout" in params and not isinstance(params["timeout"], _OMITTED):
            update["timeout"] = params["timeout"]
        options = self.template.model_copy(update=update)
        return await resource._client.request(self.cast_to, options, stream=bool(params.get("stream")),
                                              stream_cls=self.stream_cls)


_CHAT = _Create("/chat/completions", _AsyncChatCompletions.create, ChatCompletion, ChatCompletionChunk)
_TEXT = _Create("/completions", _AsyncTextCompletions.create, Completion, Completion)


class _ChatCompletions(_AsyncChatCompletions):
    async def create(self, **params: Any) -> Any:  # type: ignore[override]
        return await _CHAT(self, params)


class _TextCompletions(_AsyncTextCompletions):
    async def create(self, **params: Any) -> Any:  # type: ignore[override]
        return await _TEXT(self, params)


@functools.cache
def _platform() -> Any:
    from openai._base_client import get_platform

    return get_platform()


class SessionClient(openai.AsyncOpenAI):
    """``openai.AsyncOpenAI`` whose ``chat.completions.create`` and ``completions.create``
    skip the request transform (module docstring)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.chat.__dict__["completions"] = _ChatCompletions(self)  # chat is a cached_property
        self.__dict__["completions"] = _TextCompletions(self)
        self._shapes: dict[tuple[Any, ...], tuple[Any, Any, Any, dict[str, Any]]] = {}
        # the library looks the platform up in a worker thread on a client's first call; it
        # only feeds the telemetry headers, which a session client leaves out
        self._platform = _platform()

    def platform_headers(self) -> dict[str, str]:
        """None: the ``X-Stainless-*`` telemetry headers are for OpenAI's API, not a session."""
        return {}

    def _build_request(self, options: Any, *, retries_taken: int = 0) -> Any:
        """The library's request, built by the library once per shape: a JSON post of ours
        (body bytes, no query, files, extra JSON or headers of the call's own) differs from
        the previous one of its path, timeout and retry count only in its body. Building
        the headers and URL again costs a third of the client's call. The request is built
        as httpx leaves one it has read (its body in a ``ByteStream`` and read, the
        ``Content-Length`` header set), from the shape's header list rather than through the
        header merge, and with the headers' encoding known (httpx works it out again on each
        new ``Headers`` by decoding every header)."""
        if not _plain_post(options) or self._idempotency_header:
            return super()._build_request(options, retries_taken=retries_taken)
        key = (options.method, options.url, retries_taken, repr(options.timeout), repr(options.security))
        shape = self._shapes.get(key)
        if shape is None:
            request = super()._build_request(options, retries_taken=retries_taken)
            raw = [(k, v) for k, v in request.headers.raw if k.lower() != b"content-length"]
            self._shapes[key] = (request.method, request.url, raw, dict(request.extensions), _encoding(raw))
            return request
        method, url, raw, extensions, encoding = shape
        content = options.content
        request = httpx.Request(method, url, headers=[*raw, (b"Content-Length", b"%d" % len(content))],
                                stream=httpx.ByteStream(content), extensions=dict(extensions))
        request._content = content  # as Request.read() leaves it
        if encoding is not None:
            request.headers.encoding = encoding
        return request

    async def _process_response(self, *, cast_to: Any, options: Any, response: Any, stream: bool,
                                stream_cls: Any, retries_taken: int = 0) -> Any:
        """A plain call's result validated from its JSON body (module docstring); anything
        else (streams, raw responses, other result types) the library's way."""
        if stream or cast_to not in _RESULTS or not _plain_post(options) or is_given(options.post_parser) \
                or not response.headers.get("content-type", "").startswith("application/json"):
            return await super()._process_response(cast_to=cast_to, options=options, response=response,
                                                   stream=stream, stream_cls=stream_cls, retries_taken=retries_taken)
        parsed = self._process_response_data(data=msgspec.json.decode(response.content), cast_to=cast_to,
                                             response=response)
        add_request_id(parsed, response.headers.get("x-request-id"))
        return parsed


def _plain_post(options: Any) -> bool:
    """A JSON post built by ``_Create``: body bytes, no query, files, extra JSON or headers."""
    return (options.files is None and not options.params and options.extra_json is None and not options.headers
            and isinstance(options.content, bytes))


_RESULTS = frozenset({ChatCompletion, Completion})


def _encoding(headers: list[tuple[bytes, bytes]]) -> str | None:
    """"ascii" where every header is (what httpx's ``Headers.encoding`` finds first), else
    None: httpx works it out."""
    return "ascii" if all(k.isascii() and v.isascii() for k, v in headers) else None


class _Body(httpx.AsyncByteStream):
    """A response body read as it arrives (SSE streams)."""

    def __init__(self, response: transport.Response, request: Any) -> None:
        self.response, self.request = response, request

    async def __aiter__(self) -> Any:
        try:
            async for chunk in self.response.chunks():
                yield chunk
        except TimeoutError as exc:
            raise httpx.ReadTimeout("timed out reading the response", request=self.request) from exc
        except transport.HttpError as exc:
            raise httpx.ReadError(str(exc), request=self.request) from exc

    async def aclose(self) -> None:
        self.response.close()


class _LoopbackHttp(httpx.AsyncClient):
    """An httpx client that sends straight over ``miles.agent.transport`` connections (module
    docstring)."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(timeout=timeout_s, follow_redirects=False)
        self._pool = transport.Connections()
        self._urls: dict[str, Any] = {}

    def build_request(self, method: str, url: Any, *, content: Any = None, headers: Any = None, timeout: Any = None,
                      extensions: Any = None, **rest: Any) -> Any:
        """The request as given: the client holds no base URL, cookies or headers of its own to
        merge, and a URL already parsed is not parsed again. Form data, files, query params or
        JSON go through httpx's merge."""
        if any(v is not None for v in rest.values()) or extensions:
            return super().build_request(method, url, content=content, headers=headers, timeout=timeout,
                                         extensions=extensions, **rest)
        parsed = self._urls.get(url)
        if parsed is None:
            if len(self._urls) >= 4096:  # one or two per episode; episodes end
                self._urls.clear()
            parsed = self._urls[url] = httpx.URL(url)
        limits = timeout if isinstance(timeout, httpx.Timeout) else self.timeout if timeout is None \
            else httpx.Timeout(timeout)
        return httpx.Request(method, parsed, content=content, headers=headers,
                             extensions={"timeout": limits.as_dict()})

    async def send(self, request: Any, *, stream: bool = False, **_: Any) -> Any:
        """The response to ``request``, its body read unless ``stream`` (auth and redirect
        arguments have nothing to act on here)."""
        url = request.url
        if url.scheme != "http":
            raise httpx.UnsupportedProtocol(f"the session client speaks plain http, not {url.scheme!r}",
                                            request=request)
        t = request.extensions.get("timeout") or {}
        head = b"".join([request.method.encode(), b" ", url.raw_path, b" HTTP/1.1\r\n",
                         *[b"%s: %s\r\n" % kv for kv in request.headers.raw], b"\r\n"])
        try:
            body = request.content
        except httpx.RequestNotRead:  # a streamed upload
            body = await request.aread()
        try:
            resp = await self._pool.request(url.host, url.port or 80, head, body, stream=stream,
                                            connect_timeout=t.get("connect"), read_timeout=t.get("read"))
        except TimeoutError as exc:
            raise httpx.ReadTimeout("timed out waiting for the session server", request=request) from exc
        except transport.HttpError as exc:
            raise httpx.ConnectError(str(exc), request=request) from exc
        ext = {"http_version": b"HTTP/1.1", "reason_phrase": resp.reason}
        if stream:
            return httpx.Response(resp.status, headers=resp.headers, stream=_Body(resp, request), request=request,
                                  extensions=ext)
        # the response as httpx leaves one it has read (Response.read()), without its decoder
        # and chunker passes over a body that has no content encoding
        if any(k.lower() == b"content-encoding" for k, _ in resp.headers):
            return httpx.Response(resp.status, headers=resp.headers, content=resp.body, request=request,
                                  extensions=ext)
        response = httpx.Response(resp.status, headers=resp.headers, stream=httpx.ByteStream(resp.body),
                                  request=request, extensions=ext)
        response._content = resp.body
        response.is_stream_consumed = response.is_closed = True
        encoding = _encoding(resp.headers)
        if encoding is not None:
            response.headers.encoding = encoding
        return response

    async def aclose(self) -> None:
        await self._pool.close()
        await super().aclose()


class ClientFactory:
    """Builds each episode's client; the clients share one HTTP client and its connections
    (building one loads the CA store, which costs more than a model call)."""

    def __init__(self) -> None:
        self.http: _LoopbackHttp | None = None

    def __call__(self, base_url: str, timeout_s: float) -> SessionClient:
        if self.http is None:
            self.http = _LoopbackHttp(timeout_s)
        # No retries: a refused request (4xx) is the agent's to see, and a 5xx ends the episode.
        # strict response validation: the faster construction (module docstring); the
        # session tests run every response kind through it
        return SessionClient(base_url=base_url, api_key="miles", max_retries=0, timeout=timeout_s,
                             http_client=self.http, _strict_response_validation=True)

    async def close(self) -> None:
        if self.http is not None:
            await self.http.aclose()
            self.http = None
