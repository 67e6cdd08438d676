"""`Http11Pool`, the HTTP/1.1 client of SGLang's `/generate`, against scripted servers on loopback:
what it sends, each framing of an answer, connection reuse, and which httpx error each failure is
(the engine's retry rules are written against those; tests/test_sglang_engine.py covers them)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import httpx
import pytest

from agentgrpo.engine.sglang_http import Http11Pool

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


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
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    return head, await r.readexactly(length)


def answer(body: bytes, status: bytes = b"200 OK", extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 %s\r\ncontent-length: %d\r\n%s\r\n%s" % (status, len(body), extra, body)


def pool(url: str, **kw) -> Http11Pool:
    return Http11Pool(url, {"Content-Type": "application/json", **kw}, ssl_context=None,
                      connect_timeout_s=2.0)


async def test_request_on_the_wire_and_keep_alive():
    seen = []

    async def echo(r, w):
        while True:
            head, body = await read_request(r)
            seen.append(head)
            w.write(answer(body[::-1]))

    async with Scripted(echo) as s:
        p = pool(s.url + "/prefix", Authorization="Bearer k")
        assert await p.post("/generate", b'{"a":1}', timeout=5) == (200, b'}1:"a"{')
        assert await p.post("/generate", b"[2]", timeout=5) == (200, b"]2[")
        await p.aclose()
    assert s.connections == 1  # the second request reused the connection
    port = s.url.rsplit(":", 1)[1]
    assert seen[0] == (b"POST /prefix/generate HTTP/1.1\r\nhost: 127.0.0.1:%s\r\n"
                       b"Content-Type: application/json\r\nAuthorization: Bearer k\r\n"
                       b"content-length: 7\r\n\r\n" % port.encode())


async def test_chunked_and_interim_answers():
    async def chunked(r, w):
        await read_request(r)
        w.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 503 Service Unavailable\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n4;ext=1\r\n{\"a\"\r\n3\r\n:1}\r\n0\r\n"
                b"X-Trailer: t\r\n\r\n")
        await read_request(r)  # the connection is still usable
        w.write(answer(b"ok"))

    async with Scripted(chunked) as s:
        p = pool(s.url)
        assert await p.post("/generate", b"x", timeout=5) == (503, b'{"a":1}')
        assert await p.post("/generate", b"x", timeout=5) == (200, b"ok")
        await p.aclose()
    assert s.connections == 1


async def test_answer_framed_by_closing_and_idle_connections_closed_by_the_server():
    async def once(r, w):  # one answer per connection, each ended differently
        await read_request(r)
        if s.connections == 1:
            w.write(b"HTTP/1.1 200 OK\r\n\r\nuntil the end")
        else:
            w.write(answer(b"kept-alive"))
            await w.drain()
            await asyncio.sleep(0.05)  # then closed while idle, as uvicorn does after 5 s

    async with Scripted(once) as s:
        p = pool(s.url)
        assert await p.post("/generate", b"x", timeout=5) == (200, b"until the end")
        assert await p.post("/generate", b"x", timeout=5) == (200, b"kept-alive")
        await asyncio.sleep(0.2)
        assert await p.post("/generate", b"x", timeout=5) == (200, b"kept-alive")
        await p.aclose()
    assert s.connections == 3  # the closed connections were not reused


async def test_no_answer_in_time_is_a_read_timeout_and_the_connection_is_dropped():
    async def slow(r, w):  # the first connection answers late
        n = s.connections
        await read_request(r)
        if n == 1:
            await asyncio.sleep(0.5)
        w.write(answer(b"connection %d" % n))

    async with Scripted(slow) as s:
        p = pool(s.url)
        t0 = time.monotonic()
        with pytest.raises(httpx.ReadTimeout):
            await p.post("/generate", b"x", timeout=0.2)
        assert time.monotonic() - t0 < 0.45
        assert await p.post("/generate", b"x", timeout=5) == (200, b"connection 2")
        await p.aclose()
    assert s.connections == 2


@pytest.mark.parametrize("reply, error", [
    (b"", httpx.RemoteProtocolError),  # closed without answering ("drop")
    (b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\ncut", httpx.RemoteProtocolError),
    (b"SSH-2.0-OpenSSH\r\n\r\n", httpx.RemoteProtocolError),
    (b"HTTP/1.1 200 OK\r\ncontent-length: ten\r\n\r\n", httpx.RemoteProtocolError),
    (b"HTTP/1.1 200 OK\r\ntransfer-encoding: gzip\r\n\r\n", httpx.RemoteProtocolError),
    (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n" + b"f" * 70000,
     httpx.RemoteProtocolError),  # a chunk-size line past the limit
])
async def test_broken_answers_are_transport_errors(reply, error):
    async def broken(r, w):
        await read_request(r)
        w.write(reply)

    async with Scripted(broken) as s:
        p = pool(s.url)
        with pytest.raises(error):
            await p.post("/generate", b"x", timeout=5)
        await p.aclose()


async def test_refused_connection_and_bad_urls():
    async with Scripted(read_request) as s:
        url = s.url
    with pytest.raises(httpx.ConnectError):
        await pool(url).post("/generate", b"x", timeout=5)
    with pytest.raises(ValueError, match="credentials"):
        pool("http://user:pw@127.0.0.1:1")
    with pytest.raises(ValueError, match="http"):
        pool("ftp://127.0.0.1:1")
    with pytest.raises(ValueError, match="line break"):
        pool("http://127.0.0.1:1", Authorization="Bearer k\r\nX-Injected: 1")


async def test_a_cancelled_request_does_not_leave_its_connection_for_reuse():
    async def slow(r, w):  # the first connection answers late
        n = s.connections
        await read_request(r)
        if n == 1:
            await asyncio.sleep(0.3)
        w.write(answer(b"connection %d" % n))

    async with Scripted(slow) as s:
        p = pool(s.url)
        task = asyncio.create_task(p.post("/generate", b"x", timeout=5))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await p.post("/generate", b"x", timeout=5) == (200, b"connection 2")
        await p.aclose()
    assert s.connections == 2
