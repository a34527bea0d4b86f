"""A small HTTP/1.1 client for the session server on loopback: kept-alive connections, one
request at a time on each.

``miles.agent.client`` sends every episode's requests through it (under httpx's request and
response objects, which the ``openai`` client works with). An agent's turn is a
round trip to this process's own session server, and a general client's per-request work
(aiohttp's request and response objects, timers, cookie jar, tracing hooks) costs more CPU
than the server's whole handler: the round trip here is one write of the request and a
read of the status line, headers and body (``Content-Length``, chunked, or to the end).

Connections are pooled per host and port; an episode's calls are sequential, so each
episode in flight holds one. A pooled connection the server has closed meanwhile (its
keep-alive timeout) fails before any byte of a response arrives, and the request is sent
once more on a new connection.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator


class HttpError(Exception):
    """The connection failed or the response was not HTTP/1.x."""


class Response:
    """Status, raw headers, and the body: read whole (``body``), or still on the connection
    (``chunks()``) when the caller streams."""

    def __init__(self, pool: Connections, conn: _Conn, status: int, reason: bytes,
                 headers: list[tuple[bytes, bytes]], timeout: float | None) -> None:
        self.pool, self.conn, self.status, self.reason, self.headers = pool, conn, status, reason, headers
        self.timeout = timeout
        self.released = False
        self.body = b""
        self.length: int | None = None
        self._chunked = False
        self._keep = True
        for name, value in headers:
            name = name.lower()
            if name == b"content-length":
                self.length = int(value)
            elif name == b"transfer-encoding" and value.strip().lower() == b"chunked":
                self._chunked = True
            elif name == b"connection" and value.strip().lower() == b"close":
                self._keep = False

    def sized(self) -> bool:
        """Whether the body is ``Content-Length`` bytes."""
        return self.length is not None and not self._chunked

    def done(self) -> None:
        """The body has been read to its end."""
        self._release(keep=self._keep)

    async def read(self) -> bytes:
        self.body = b"".join([c async for c in self.chunks()])
        return self.body

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives; the connection goes back to the pool at its end."""
        reader = self.conn.reader
        done = False
        try:
            async with asyncio.timeout(self.timeout):
                if self._chunked:
                    while True:
                        size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0], 16)
                        if size == 0:
                            await _trailer(reader)
                            break
                        data = await reader.readexactly(size + 2)
                        yield data[:-2]
                elif self.length is not None:
                    if self.length:
                        yield await reader.readexactly(self.length)
                else:
                    self._keep = False
                    while data := await reader.read(1 << 16):
                        yield data
            done = True
        except (asyncio.IncompleteReadError, ConnectionError, ValueError) as exc:
            raise HttpError(f"the response body broke off: {exc!r}") from exc
        finally:
            self._release(keep=done and self._keep)

    def close(self) -> None:
        """Drop a body not read to its end (and the connection with it)."""
        self._release(keep=False)

    def _release(self, *, keep: bool) -> None:
        if not self.released:  # once: the connection may be serving the next request by now
            self.released = True
            self.pool.release(self.conn, keep=keep)


def _parse_head(raw: bytes) -> tuple[int, bytes, list[tuple[bytes, bytes]]]:
    lines = raw.split(b"\r\n")
    parts = lines[0].split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
        raise HttpError(f"not an HTTP/1.x response: {lines[0][:80]!r}")
    headers = []
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(b":")
            headers.append((name, value.strip()))
    return int(parts[1]), parts[2].strip() if len(parts) > 2 else b"", headers


async def _trailer(reader: asyncio.StreamReader) -> None:
    while (await reader.readuntil(b"\r\n")) != b"\r\n":
        pass


class _Conn:
    __slots__ = ("key", "reader", "reused", "writer")

    def __init__(self, key: tuple[str, int], reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.key, self.reader, self.writer = key, reader, writer
        self.reused = False


class Connections:
    """Idle keep-alive connections by (host, port)."""

    def __init__(self) -> None:
        self.idle: dict[tuple[str, int], list[_Conn]] = {}

    async def _connect(self, key: tuple[str, int], timeout: float | None) -> _Conn:
        try:
            async with asyncio.timeout(timeout):
                reader, writer = await asyncio.open_connection(*key, limit=1 << 20)
        except OSError as exc:
            raise HttpError(f"cannot connect to {key[0]}:{key[1]}: {exc}") from exc
        return _Conn(key, reader, writer)

    async def request(self, host: str, port: int, head: bytes, body: bytes, *, stream: bool,
                      connect_timeout: float | None, read_timeout: float | None) -> Response:
        """Send ``head`` (request line and headers, CRLF-terminated) and ``body``; the response
        with its body read unless ``stream``. TimeoutError past the timeouts, HttpError on a
        broken connection or a response that is not HTTP/1.x."""
        key = (host, port)
        idle = self.idle.get(key)
        while True:
            conn = idle.pop() if idle else await self._connect(key, connect_timeout)
            resp: Response | None = None
            try:
                conn.writer.write(head + body)
                async with asyncio.timeout(read_timeout):
                    raw = await conn.reader.readuntil(b"\r\n\r\n")
                    resp = Response(self, conn, *_parse_head(raw), read_timeout)
                    if not stream and resp.sized():  # the usual case: the body in the same wait
                        resp.body = await conn.reader.readexactly(resp.length) if resp.length else b""
                        resp.done()
            except (asyncio.IncompleteReadError, ConnectionError) as exc:
                if resp is not None:
                    resp.close()
                    raise HttpError(f"the response body broke off: {exc!r}") from exc
                self.release(conn, keep=False)
                if conn.reused and not getattr(exc, "partial", b""):
                    continue  # the server closed it while it sat idle: once more on a new one
                raise HttpError(f"the connection broke: {exc!r}") from exc
            except BaseException:
                if resp is not None:
                    resp.close()
                else:
                    self.release(conn, keep=False)
                raise
            break
        if not stream and not resp.released:
            await resp.read()
        return resp

    def release(self, conn: _Conn, *, keep: bool) -> None:
        """Back to the pool (``keep``: the response was read to its end and the server keeps
        the connection open) or closed."""
        if keep and not conn.writer.is_closing() and not conn.reader.at_eof():
            conn.reused = True
            self.idle.setdefault(conn.key, []).append(conn)
            return
        conn.writer.close()

    async def close(self) -> None:
        for conns in self.idle.values():
            for conn in conns:
                conn.writer.close()
        self.idle.clear()
