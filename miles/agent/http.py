"""A small HTTP/1.1 server on an ``asyncio.Protocol``: what the session server needs, no more.

The session server answers one episode's calls, one at a time, on a kept-alive connection,
so a request's cost besides the session's own work is per-turn overhead. A general web
framework spends most of that on what a session never uses (routing tables, middlewares,
request and response objects of many fields, access logs, ``Date`` and ``Server`` headers the
client then has to look through). Here a connection's bytes are parsed in place: the head
with one split, the body by ``Content-Length`` (or ``Transfer-Encoding: chunked``), and each
request runs as one task that writes its reply in one call. Requests on a connection are
answered in order (pipelined ones wait their turn); a request the handler's task cannot
answer (it raised) gets a 500 and the connection goes on.

What is refused, with the status a client can act on and the connection closed: a head that
is not HTTP/1.x (400), one over 64 KiB (431), a body over ``max_body`` (413).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

log = logging.getLogger(__name__)

MAX_HEAD = 64 * 1024
_REASONS = {200: b"OK", 400: b"Bad Request", 404: b"Not Found", 405: b"Method Not Allowed", 409: b"Conflict",
            410: b"Gone", 413: b"Payload Too Large", 431: b"Request Header Fields Too Large",
            500: b"Internal Server Error", 503: b"Service Unavailable"}


class Request:
    """One parsed request: method and path as str, header names lower-case."""

    __slots__ = ("body", "headers", "method", "path")

    def __init__(self, method: str, path: str, headers: dict[str, str], body: bytes) -> None:
        self.method, self.path, self.headers, self.body = method, path, headers, body


class Reply:
    """A response: ``body`` bytes with a ``Content-Length``, or ``events`` (each already an
    encoded server-sent event) sent as the chunks of a chunked ``text/event-stream``."""

    __slots__ = ("body", "content_type", "events", "status")

    def __init__(self, status: int = 200, body: bytes = b"", *, content_type: str = "application/json",
                 events: list[bytes] | None = None) -> None:
        self.status, self.body, self.content_type, self.events = status, body, content_type, events

    def encode(self, keep_alive: bool) -> bytes:
        reason = _REASONS.get(self.status, b"Unknown")
        conn = b"" if keep_alive else b"Connection: close\r\n"
        if self.events is None:
            return b"HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n%s\r\n%s" % (
                self.status, reason, self.content_type.encode(), len(self.body), conn, self.body)
        parts = [b"HTTP/1.1 %d %s\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
                 b"Transfer-Encoding: chunked\r\n%s\r\n" % (self.status, reason, conn)]
        for event in self.events:
            parts.append(b"%x\r\n%s\r\n" % (len(event), event))
        parts.append(b"0\r\n\r\n")
        return b"".join(parts)


Handler = Callable[[Request], Awaitable[Reply]]


class _Connection(asyncio.Protocol):
    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.busy = False  # a request's task runs; later bytes wait in buf
        self.closing = False
        self.continued = False  # 100 Continue sent for the request being received

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.server.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closing = True
        self.server.connections.discard(self)

    def data_received(self, data: bytes) -> None:
        if self.closing:
            return
        self.buf += data
        if not self.busy:
            self._next()

    def _next(self) -> None:
        """Start the next complete request in the buffer (if any)."""
        buf = self.buf
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            if len(buf) > MAX_HEAD:
                self._refuse(431, "the request head is over 64 KiB")
            return
        if end > MAX_HEAD:
            self._refuse(431, "the request head is over 64 KiB")
            return
        lines = bytes(buf[:end]).decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            self._refuse(400, "not an HTTP/1.x request")
            return
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep:
                self._refuse(400, "a malformed header line")
                return
            headers[name.strip().lower()] = value.strip()
        at = end + 4
        if "chunked" in headers.get("transfer-encoding", "").lower():
            body_end = self._chunked(at)
            if body_end is None:
                return
            body, at = body_end
        else:
            try:
                length = int(headers.get("content-length", "0"))
            except ValueError:
                self._refuse(400, "Content-Length is not a number")
                return
            if length < 0:
                self._refuse(400, "Content-Length is negative")
                return
            if length > self.server.max_body:
                self._refuse(413, f"the body is over {self.server.max_body} bytes")
                return
            if len(buf) < at + length:
                if not self.continued and headers.get("expect", "").lower() == "100-continue":
                    self.continued = True  # the client waits for this before it sends the body
                    self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # type: ignore[union-attr]
                return
            body = bytes(buf[at:at + length])
            at += length
        del buf[:at]
        self.continued = False
        keep = headers.get("connection", "").lower() != "close" and (
            parts[2] != "HTTP/1.0" or headers.get("connection", "").lower() == "keep-alive")
        self.busy = True
        task = asyncio.get_running_loop().create_task(self._answer(Request(parts[0], parts[1], headers, body), keep))
        self.server.tasks.add(task)  # the loop keeps only a weak reference
        task.add_done_callback(self.server.tasks.discard)

    def _chunked(self, at: int) -> tuple[bytes, int] | None:
        """The body of a chunked request starting at ``at`` and where it ends, or None while
        it has not all arrived (or it was refused)."""
        buf, out = self.buf, []
        size_total = 0
        while True:
            eol = buf.find(b"\r\n", at)
            if eol < 0:
                return None
            try:
                size = int(bytes(buf[at:eol]).split(b";", 1)[0], 16)
            except ValueError:
                self._refuse(400, "a malformed chunk size")
                return None
            size_total += size
            if size_total > self.server.max_body:
                self._refuse(413, f"the body is over {self.server.max_body} bytes")
                return None
            if size == 0:
                end = buf.find(b"\r\n\r\n", eol)  # after the trailers, if any
                return None if end < 0 else (b"".join(out), end + 4)
            if len(buf) < eol + 2 + size + 2:
                return None
            out.append(bytes(buf[eol + 2:eol + 2 + size]))
            at = eol + 2 + size + 2

    async def _answer(self, request: Request, keep: bool) -> None:
        try:
            reply = await self.server.handler(request)
        except Exception:
            log.exception("agent session server: the handler of %s %s raised", request.method, request.path)
            reply = Reply(500, b'{"error": {"message": "internal error", "type": "server_error", "param": null, '
                               b'"code": 500}}')
        if self.closing:
            return
        self.transport.write(reply.encode(keep))  # type: ignore[union-attr]
        self.busy = False
        if not keep:
            self.closing = True
            self.transport.close()  # type: ignore[union-attr]
        elif self.buf:
            self._next()

    def _refuse(self, status: int, message: str) -> None:
        body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                     "code": status}}).encode()
        self.transport.write(Reply(status, body).encode(keep_alive=False))  # type: ignore[union-attr]
        self.closing = True
        self.buf.clear()
        self.transport.close()  # type: ignore[union-attr]


class HttpServer:
    """Serves ``handler`` on ``host``:``port`` (0: a free one; ``sockets`` says which)."""

    def __init__(self, handler: Handler, *, max_body: int = 64 * 1024 * 1024) -> None:
        self.handler, self.max_body = handler, max_body
        self.connections: set[_Connection] = set()
        self.tasks: set[asyncio.Task[None]] = set()  # requests being answered
        self._server: asyncio.base_events.Server | None = None

    async def start(self, host: str, port: int) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _Connection(self), host, port)

    @property
    def addresses(self) -> list[Any]:
        """The bound socket addresses (host, port, ...)."""
        return [s.getsockname() for s in (self._server.sockets if self._server is not None else ())]

    async def stop(self) -> None:
        """Stop listening, close every connection (kept-alive ones included) and cancel the
        requests still being answered (their clients are gone with the connections)."""
        if self._server is None:
            return
        self._server.close()
        for conn in list(self.connections):
            if conn.transport is not None:
                conn.transport.close()
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self._server.wait_closed()
        self._server = None
