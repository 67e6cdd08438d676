"""The `/generate` path of `SGLangEngine`'s server pool (aiohttp) against scripted servers on
loopback: what goes on the wire, connection reuse, and what each network failure becomes (a typed
`EngineError`, the server in or out of rotation). The retry and balancing rules themselves are in
tests/test_sglang_engine.py, against the fake SGLang server."""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import pytest

from agentgrpo.engine.base import EngineError
from agentgrpo.engine.pool import ServerPool, ServerState
from agentgrpo.engine.sglang.client import WIRE, SGLangEngine
from agentgrpo.engine.sglang.config import SGLangConfig

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
OUTPUT = {"text": "hi", "output_ids": [1, 2], "meta_info": {"id": "x"}}


class Scripted:
    """A loopback server running `handler` on each connection; counts connections."""

    def __init__(self, handler: Handler) -> None:
        self.handler, self.connections = handler, 0
        self.tasks: list[asyncio.Task] = []

    async def __aenter__(self) -> Scripted:
        async def conn(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            self.connections += 1
            self.tasks.append(asyncio.current_task())
            try:
                await self.handler(r, w)
            except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
                pass
            finally:
                w.close()

        self.server = await asyncio.start_server(conn, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def read_request(r: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """(head, body) of one request."""
    head = await r.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    return head, await r.readexactly(length)


def answer(body: bytes, status: bytes = b"200 OK", extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 %s\r\ncontent-length: %d\r\n%s\r\n%s" % (status, len(body), extra, body)


async def no_resync(s: ServerState) -> str:
    return ""


def pool(url: str, headers: dict[str, str] | None = None, **settings: Any) -> ServerPool:
    settings = {"max_retries": 0, "connect_timeout_s": 2.0, "request_timeout_s": 5.0, **settings}
    return ServerPool(
        SGLangConfig(urls=[url], **settings),
        {"Content-Type": "application/json", **(headers or {})},
        resync=no_resync,
        wire=WIRE,
    )


async def test_request_on_the_wire_and_keep_alive():
    seen = []

    async def serve(r, w):
        while True:
            head, body = await read_request(r)
            seen.append((head, orjson.loads(body)))
            w.write(answer(orjson.dumps(OUTPUT)))

    async with Scripted(serve) as s:
        p = pool(s.url + "/prefix", {"Authorization": "Bearer k"})
        assert await p.post_generate({"input_ids": [1, 2]}) == OUTPUT
        assert await p.post_generate({"input_ids": [3]}) == OUTPUT
        await p.aclose()
    assert s.connections == 1  # the second request reused the connection
    head = seen[0][0].decode().lower()
    assert head.startswith("post /prefix/generate http/1.1\r\n")
    for field in (
        "content-type: application/json",
        "authorization: bearer k",
        f"host: {s.url.split('//')[1]}",
    ):
        assert f"\r\n{field}\r\n" in head, field
    assert seen[0][1]["input_ids"] == [1, 2] and seen[1][1]["input_ids"] == [3]
    assert len({b["rid"] for _, b in seen}) == 2  # a fresh rid per request


async def test_chunked_interim_and_close_framed_answers():
    async def serve(r, w):
        await read_request(r)
        if s.connections == 1:  # 100 Continue, then a chunked answer; the connection stays
            w.write(
                b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n"
                b'Transfer-Encoding: chunked\r\n\r\n4;ext=1\r\n[{"a\r\n5\r\n":1}]\r\n0\r\n'
                b"X-Trailer: t\r\n\r\n"
            )
            await read_request(r)
            w.write(b'HTTP/1.1 200 OK\r\n\r\n{"b":2}')  # framed by closing the connection
        else:
            w.write(answer(b'{"c":3}'))

    async with Scripted(serve) as s:
        p = pool(s.url)
        assert await p.post_generate({}) == {"a": 1}  # a one-element list is unwrapped
        assert await p.post_generate({}) == {"b": 2}
        assert await p.post_generate({}) == {"c": 3}
        assert p.servers[0].healthy
        await p.aclose()
    assert s.connections == 2  # the close-framed answer's connection was not reused


async def test_idle_connections_closed_by_the_server_are_not_reused():
    async def serve(r, w):  # one answer per connection, then closed while idle (as uvicorn does)
        await read_request(r)
        w.write(answer(orjson.dumps(OUTPUT)))
        await w.drain()
        await asyncio.sleep(0.05)

    async with Scripted(serve) as s:
        p = pool(s.url)
        for _ in range(3):
            assert await p.post_generate({}) == OUTPUT
            await asyncio.sleep(0.2)
        assert p.servers[0].healthy and p.servers[0].failures == 0
        await p.aclose()
    assert s.connections == 3


async def test_no_answer_before_the_deadline_is_an_engine_error_and_the_connection_is_dropped():
    async def serve(r, w):  # the first connection answers late
        n = s.connections
        await read_request(r)
        if n == 1:
            await asyncio.sleep(1.0)
        w.write(answer(b'{"connection": %d}' % n))

    async with Scripted(serve) as s:
        p = pool(s.url, request_timeout_s=0.3)
        t0 = time.monotonic()
        with pytest.raises(EngineError, match="deadline"):
            await p.post_generate({})
        assert time.monotonic() - t0 < 0.8
        assert p.servers[0].healthy  # a slow server is busy, not down
        assert p.servers[0].outstanding == 0
        assert await p.post_generate({}) == {"connection": 2}
        await p.aclose()
    assert s.connections == 2


@pytest.mark.parametrize(
    "reply",
    [
        b"",  # closed without answering
        b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\ncut",
        b"SSH-2.0-OpenSSH\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-length: ten\r\n\r\n",
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n",
    ],
    ids=["drop", "cut", "not-http", "bad-length", "bad-chunk"],
)
async def test_broken_answers_take_the_server_out_with_a_typed_error(reply):
    async def serve(r, w):
        await read_request(r)
        w.write(reply)

    async with Scripted(serve) as s:
        p = pool(s.url)
        with pytest.raises(EngineError, match="failed after 1 attempts"):
            await p.post_generate({})
        state = p.servers[0]
        assert not state.healthy and state.failures == 1 and s.url in state.last_error
        await p.aclose()


@pytest.mark.parametrize(
    "body, message",
    [
        (b"<html>Bad gateway</html>", "invalid JSON"),
        (b"[1, 2]", "returned list, not an object"),
    ],
)
async def test_answers_that_are_not_an_output_object_are_engine_errors(body, message):
    async def serve(r, w):
        await read_request(r)
        w.write(answer(body))

    async with Scripted(serve) as s:
        p = pool(s.url)
        with pytest.raises(EngineError, match=message):
            await p.post_generate({})
        await p.aclose()


async def test_a_refused_connection_takes_the_server_out():
    async with Scripted(read_request) as s:
        url = s.url  # closed on leaving: nothing listens there any more
    p = pool(url)
    with pytest.raises(EngineError, match="failed after 1 attempts.*Connect"):
        await p.post_generate({})
    assert not p.servers[0].healthy
    await p.aclose()


async def test_no_connection_within_connect_timeout_takes_the_server_out():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)  # never accepts: once its queue is full, connecting hangs
    port = listener.getsockname()[1]
    fillers = []
    for _ in range(3):
        c = socket.socket()
        c.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            c.connect(("127.0.0.1", port))
        fillers.append(c)
    p = pool(f"http://127.0.0.1:{port}", connect_timeout_s=0.3)
    try:
        t0 = time.monotonic()
        with pytest.raises(EngineError, match="failed after 1 attempts.*connect timeout"):
            await p.post_generate({})
        assert time.monotonic() - t0 < 2.0  # the connect timeout, not the 5 s deadline
        assert not p.servers[0].healthy and "connect timeout" in p.servers[0].last_error
    finally:
        await p.aclose()
        for c in [*fillers, listener]:
            c.close()


async def test_a_cancelled_request_frees_its_slot_and_its_connection_is_not_reused():
    async def serve(r, w):  # the first connection answers late
        n = s.connections
        while True:
            await read_request(r)
            if n == 1:
                await asyncio.sleep(0.5)
            w.write(answer(b'{"connection": %d}' % n))

    async with Scripted(serve) as s:
        p = pool(s.url)
        task = asyncio.create_task(p.post_generate({}))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert p.servers[0].outstanding == 0 and p.servers[0].healthy
        assert await p.post_generate({}) == {"connection": 2}
        await asyncio.sleep(0.5)  # past the first connection's late answer
        assert await p.post_generate({}) == {"connection": 2}
        await p.aclose()
    assert s.connections == 2


def test_header_values_with_line_breaks_are_refused():
    with pytest.raises(ValueError, match="line break"):
        SGLangEngine(["http://127.0.0.1:1"], api_key="k\r\nX-Injected: 1")


def test_a_pool_used_from_two_event_loops_gets_fresh_connections_in_each():
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
            body = orjson.dumps(OUTPUT)
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        p = pool(f"http://127.0.0.1:{server.server_address[1]}")
        for _ in range(2):  # the second loop cannot use connections bound to the first
            assert asyncio.run(p.post_generate({})) == OUTPUT
        asyncio.run(p.aclose())
    finally:
        server.shutdown()
        server.server_close()
