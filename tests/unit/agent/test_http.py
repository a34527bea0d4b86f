"""The session server's HTTP/1.1 layer (miles.agent.http) on raw sockets: framing, keep-alive,
pipelining, chunked bodies, Expect: 100-continue, and what it refuses."""

from __future__ import annotations

import asyncio
import json

from miles.agent.http import HttpServer, Reply, Request


async def _echo(request: Request) -> Reply:
    if request.path == "/boom":
        raise RuntimeError("handler bug")
    if request.path == "/sse":
        return Reply(events=[b"data: 1\n\n", b"data: [DONE]\n\n"])
    body = json.dumps({"method": request.method, "path": request.path, "body": request.body.decode(),
                       "ct": request.headers.get("content-type")}).encode()
    return Reply(200, body)


async def _exchange(payload: bytes, *, max_body: int = 1 << 20, until_close: bool = False,
                    replies: int = 1) -> list[bytes]:
    server = HttpServer(_echo, max_body=max_body)
    await server.start("127.0.0.1", 0)
    port = server.addresses[0][1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(payload)
    out = []
    try:
        if until_close:
            out.append(await asyncio.wait_for(reader.read(), 5))
        else:
            for _ in range(replies):
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                out.append(head + await reader.readexactly(length))
    finally:
        writer.close()
        await server.stop()
    return out


def _post(path: str, body: bytes, extra: bytes = b"") -> bytes:
    return (b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n%s"
            % (path.encode(), len(body), extra, body))


def _json(reply: bytes) -> dict:
    return json.loads(reply.split(b"\r\n\r\n", 1)[1])


def test_keep_alive_and_pipelined_requests_are_answered_in_order() -> None:
    payload = _post("/a", b'{"x": 1}') + _post("/b", b"") + b"GET /c?q=1 HTTP/1.1\r\nHost: x\r\n\r\n"
    replies = asyncio.run(_exchange(payload, replies=3))
    assert [r.split(b"\r\n", 1)[0] for r in replies] == [b"HTTP/1.1 200 OK"] * 3
    assert [_json(r)["path"] for r in replies] == ["/a", "/b", "/c?q=1"]
    assert _json(replies[0])["body"] == '{"x": 1}' and _json(replies[0])["ct"] == "application/json"
    assert b"connection: close" not in replies[0].lower()


def test_request_split_across_reads_and_chunked_body() -> None:
    async def go() -> list[bytes]:
        server = HttpServer(_echo)
        await server.start("127.0.0.1", 0)
        reader, writer = await asyncio.open_connection("127.0.0.1", server.addresses[0][1])
        msg = (b"POST /chunked HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
               b"3\r\nabc\r\n4;ext=1\r\ndefg\r\n0\r\n\r\n")
        for i in range(0, len(msg), 7):  # a few bytes at a time
            writer.write(msg[i:i + 7])
            await writer.drain()
            await asyncio.sleep(0)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        body = await reader.readexactly(length)
        writer.close()
        await server.stop()
        return [head + body]

    (reply,) = asyncio.run(go())
    assert _json(reply)["body"] == "abcdefg"


def test_expect_continue_gets_100_before_the_body() -> None:
    async def go() -> tuple[bytes, bytes]:
        server = HttpServer(_echo)
        await server.start("127.0.0.1", 0)
        reader, writer = await asyncio.open_connection("127.0.0.1", server.addresses[0][1])
        writer.write(b"POST /e HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nExpect: 100-continue\r\n\r\n")
        interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        writer.write(b"hi")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        body = await reader.readexactly(int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0]))
        writer.close()
        await server.stop()
        return interim, head + body

    interim, reply = asyncio.run(go())
    assert interim.startswith(b"HTTP/1.1 100 Continue") and _json(reply)["body"] == "hi"


def test_connection_close_sse_and_a_raising_handler() -> None:
    (closed,) = asyncio.run(_exchange(_post("/a", b"", b"Connection: close\r\n"), until_close=True))
    assert b"Connection: close" in closed and _json(closed)["path"] == "/a"
    (sse,) = asyncio.run(_exchange(b"GET /sse HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", until_close=True))
    assert b"Transfer-Encoding: chunked" in sse and b"text/event-stream" in sse
    assert sse.endswith(b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")
    boom, after = asyncio.run(_exchange(_post("/boom", b"") + _post("/ok", b""), replies=2))
    assert boom.startswith(b"HTTP/1.1 500") and _json(boom)["error"]["code"] == 500
    assert _json(after)["path"] == "/ok"  # the connection goes on


def test_malformed_and_oversized_requests_are_refused() -> None:
    (bad,) = asyncio.run(_exchange(b"hello there\r\n\r\n", until_close=True))
    assert bad.startswith(b"HTTP/1.1 400") and "HTTP/1.x" in _json(bad)["error"]["message"]
    (big,) = asyncio.run(_exchange(_post("/a", b"x" * 100), max_body=10, until_close=True))
    assert big.startswith(b"HTTP/1.1 413")
    (huge,) = asyncio.run(_exchange(b"GET / HTTP/1.1\r\nX: " + b"a" * 70_000, until_close=True))
    assert huge.startswith(b"HTTP/1.1 431")
    (length,) = asyncio.run(_exchange(b"POST / HTTP/1.1\r\nContent-Length: nope\r\n\r\n", until_close=True))
    assert length.startswith(b"HTTP/1.1 400")


def test_session_routes_refuse_other_paths_and_methods() -> None:
    from miles.agent.server import AgentServer

    async def go() -> list[bytes]:
        server = AgentServer()
        await server.start("127.0.0.1", 0)
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        out = []
        for req in (b"GET /v1/models HTTP/1.1\r\n\r\n", b"GET /s/abc/v1/chat/completions HTTP/1.1\r\n\r\n",
                    b"GET /s/abc/v1/models HTTP/1.1\r\n\r\n", b"POST /s/a/b/v1/completions HTTP/1.1\r\n\r\n",
                    _post("/s/abc/v1/chat/completions", b"{}")):
            writer.write(req)
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            out.append(head + await reader.readexactly(length))
        writer.close()
        await server.stop()
        return out

    replies = asyncio.run(go())
    assert [int(r.split(b" ", 2)[1]) for r in replies] == [404, 405, 404, 404, 404]
    assert [_json(r)["error"]["type"] for r in replies] == ["not_found", "invalid_request_error", "not_found",
                                                           "not_found", "not_found"]
