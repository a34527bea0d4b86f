"""The episode client's HTTP/1.1 transport (``miles.agent.transport``) against a scripted
server on loopback: keep-alive reuse, a pooled connection the server closed, chunked and
to-the-end bodies, ``Connection: close``, a body that breaks off."""

from __future__ import annotations

import asyncio

import pytest

from miles.agent.transport import Connections, HttpError

OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
CHUNKED = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"


async def _serve(replies: list[bytes], *, close_after: bool = False):
    """A server answering each request (head plus Content-Length body) with the next reply;
    ``close_after``: it closes every connection after one answer, as an idle timeout would."""
    connections: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        try:
            while replies:
                head = await reader.readuntil(b"\r\n\r\n")
                length = [int(h.split(b":")[1]) for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")]
                if length:
                    await reader.readexactly(length[0])
                writer.write(replies.pop(0))
                await writer.drain()
                if close_after:
                    break
        except asyncio.IncompleteReadError:
            pass
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], connections


def _head(port: int, body: bytes) -> bytes:
    return b"POST /x HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Length: %d\r\n\r\n" % (port, len(body))


async def _get(pool: Connections, port: int, *, stream: bool = False):
    return await pool.request("127.0.0.1", port, _head(port, b"{}"), b"{}", stream=stream, connect_timeout=5,
                              read_timeout=5)


def test_keep_alive_reuses_one_connection() -> None:
    async def go() -> None:
        server, port, connections = await _serve([OK, OK, OK])
        pool = Connections()
        for _ in range(3):
            r = await _get(pool, port)
            assert (r.status, r.body) == (200, b"ok")
        assert len(connections) == 1 and len(pool.idle[("127.0.0.1", port)]) == 1
        await pool.close()
        server.close()

    asyncio.run(go())


def test_a_connection_the_server_closed_while_idle_is_replaced() -> None:
    async def go() -> None:
        server, port, connections = await _serve([OK, OK], close_after=True)
        pool = Connections()
        assert (await _get(pool, port)).body == b"ok"
        await asyncio.sleep(0.05)  # the server's close arrives while the connection sits idle
        assert (await _get(pool, port)).body == b"ok"
        assert len(connections) == 2
        await pool.close()
        server.close()

    asyncio.run(go())


def test_chunked_and_to_the_end_bodies() -> None:
    async def go() -> None:
        server, port, _ = await _serve([CHUNKED, CHUNKED, b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nall of it"])
        pool = Connections()
        assert (await _get(pool, port)).body == b"abcde"
        r = await _get(pool, port, stream=True)
        assert [c async for c in r.chunks()] == [b"abc", b"de"]
        last = await _get(pool, port)
        assert last.body == b"all of it" and not pool.idle.get(("127.0.0.1", port))  # not kept
        await pool.close()
        server.close()

    asyncio.run(go())


def test_a_body_that_breaks_off_is_an_error() -> None:
    async def go() -> None:
        server, port, _ = await _serve([b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort"], close_after=True)
        pool = Connections()
        with pytest.raises(HttpError, match="broke off"):
            await _get(pool, port)
        assert not pool.idle.get(("127.0.0.1", port))
        server.close()

    asyncio.run(go())


def test_not_http_is_an_error() -> None:
    async def go() -> None:
        server, port, _ = await _serve([b"SSH-2.0-nope\r\n\r\n"], close_after=True)
        with pytest.raises(HttpError, match="not an HTTP"):
            await _get(Connections(), port)
        server.close()

    asyncio.run(go())
