"""The HTTP/1.1 client of `/generate`: keep-alive connections to one server over asyncio streams.

Why not httpx here: one learner process must send thousands of `/generate` requests a second, and
httpx (with httpcore and anyio under it) spends many times this client's CPU per request, far more
than encoding the request or parsing the answer (bench/sglang_client.py; the numbers are in
docs/performance.md). A `/generate` call has one shape: a POST of a JSON body with a
Content-Length, answered with a body, so it needs little of HTTP. The health probes, control calls
and weight updates stay on httpx, where a request's cost does not matter.

What it speaks: HTTP/1.1 over TCP or TLS (the SSL context of the engine's httpx clients), persistent
connections (reused last-in first-out; one the server has closed is dropped before reuse), an
answer framed by Content-Length, by the chunked transfer coding or by the end of the connection.
Not: proxies (the engine never uses one: its httpx clients set trust_env=False), redirects,
compression (it asks for none), HTTP/2, credentials in the URL (refused).

Failures raise httpx's exception types, so that the pool's retry rules read the same for both
clients: `httpx.ConnectTimeout` and `httpx.ConnectError` (no connection), `httpx.ReadTimeout` (no
whole answer within the request's time), `httpx.RemoteProtocolError` (the server closed the
connection mid-answer, or answered something that is not HTTP/1.x) and `httpx.ReadError` /
`httpx.WriteError` (the socket failed).
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Mapping
from urllib.parse import urlsplit

import httpx

_MAX_HEAD = 1 << 16  # the status line and headers of an answer; longer is not an SGLang server


class _Connection:
    __slots__ = ("reader", "writer", "timed_out")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.timed_out = False

    def expire(self) -> None:
        """The request's time is up: abort the connection, which ends any pending read or write."""
        self.timed_out = True
        self.writer.transport.abort()

    def reusable(self) -> bool:
        return not self.writer.is_closing() and not self.reader.at_eof()


class Http11Pool:
    """Keep-alive HTTP/1.1 connections to the server at `url`, for POSTs of JSON bodies.

    As many connections as requests in flight; the caller bounds those (the engine's
    `max_inflight_per_server`).

    Example:
        ```python
        pool = Http11Pool("http://127.0.0.1:30000", {"Content-Type": "application/json"},
                          ssl_context=None, connect_timeout_s=10.0)
        status, body = await pool.post("/generate", b'{"input_ids": [1, 2]}', timeout=60.0)
        await pool.aclose()
        ```
    """

    def __init__(self, url: str, headers: Mapping[str, str], *, ssl_context: ssl.SSLContext | None,
                 connect_timeout_s: float) -> None:
        u = urlsplit(url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"not an http(s) server URL: {url!r}")
        if u.username is not None or u.password is not None:
            raise ValueError(f"credentials in the server URL are not supported ({u.hostname}): "
                             "use api_key (sent as Authorization: Bearer)")
        self._host = u.hostname
        self._port = u.port or (443 if u.scheme == "https" else 80)
        # True: asyncio's default context
        self._ssl = (ssl_context or True) if u.scheme == "https" else None
        self._path_prefix = u.path.rstrip("/").encode()
        host = u.netloc  # with the port and an IPv6 address's brackets, as the Host header wants
        for k, v in headers.items():
            if any(c in f"{k}{v}" for c in "\r\n\0") or ":" in k:
                raise ValueError(f"HTTP header {k!r} has a line break or its name a colon")
        fields = "".join(f"{k}: {v}\r\n" for k, v in headers.items() if k.lower() != "host")
        self._fields = f"host: {host}\r\n{fields}".encode("latin-1")
        self._connect_timeout_s = connect_timeout_s
        self._idle: list[_Connection] = []

    async def aclose(self) -> None:
        idle, self._idle = self._idle, []
        for c in idle:
            c.writer.close()

    async def post(self, path: str, content: bytes, *, timeout: float) -> tuple[int, bytes]:
        """POST `content` to `path`; returns (status, body). `timeout` bounds the whole call."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        conn = await self._connection(loop, timeout)
        timer = loop.call_at(deadline, conn.expire)
        done = False
        try:
            head = b"POST %s%s HTTP/1.1\r\n%scontent-length: %d\r\n\r\n" % (
                self._path_prefix, path.encode(), self._fields, len(content))
            conn.writer.write(head + content)
            try:
                await conn.writer.drain()
            except OSError as e:
                raise httpx.WriteError(f"sending the request failed: {e!r}") from e
            status, body, keep = await _read_response(conn.reader)
            done = True
        except (httpx.TransportError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                OSError) as e:
            if conn.timed_out:
                raise httpx.ReadTimeout(f"no whole answer within {timeout:.3g} s") from e
            if isinstance(e, httpx.TransportError):
                raise
            if isinstance(e, asyncio.IncompleteReadError):
                raise httpx.RemoteProtocolError(
                    "the server closed the connection before a whole answer") from e
            if isinstance(e, asyncio.LimitOverrunError):
                raise httpx.RemoteProtocolError(
                    f"an answer line longer than {_MAX_HEAD} bytes") from e
            raise httpx.ReadError(f"reading the answer failed: {e!r}") from e
        finally:
            timer.cancel()
            if not done:  # cancelled, failed or timed out: the connection's state is unknown
                conn.writer.transport.abort()
        if keep and conn.reusable():
            self._idle.append(conn)
        else:
            conn.writer.close()
        return status, body

    async def _connection(self, loop: asyncio.AbstractEventLoop, timeout: float) -> _Connection:
        while self._idle:
            conn = self._idle.pop()
            if conn.reusable():
                return conn
            conn.writer.close()  # the server closed it while it was idle
        limit = min(self._connect_timeout_s, timeout)
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(self._host, self._port, ssl=self._ssl, limit=_MAX_HEAD),
                limit)
        except asyncio.TimeoutError as e:
            if limit < self._connect_timeout_s:  # the request's own time ran out first
                raise httpx.ReadTimeout(
                    f"no connection within the request's {timeout:.3g} s") from e
            raise httpx.ConnectTimeout(f"no connection within {limit:.3g} s") from e
        except OSError as e:  # refused, unreachable, TLS handshake failed
            raise httpx.ConnectError(f"{type(e).__name__}: {e}") from e
        return _Connection(reader, writer)


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, bytes, bool]:
    """One answer: (status, body, whether the connection may carry another request)."""
    while True:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.LimitOverrunError as e:
            raise httpx.RemoteProtocolError(f"answer headers longer than {_MAX_HEAD} bytes") from e
        lines = head[:-4].split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise httpx.RemoteProtocolError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
        status = int(parts[1])
        if status >= 200:
            break  # an informational 1xx (100 Continue, 103 Early Hints) comes before the answer
    length = encoding = connection = None
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            length = value.strip()
        elif name == b"transfer-encoding":
            encoding = value.strip().lower()
        elif name == b"connection":
            connection = value.strip().lower()
    keep = parts[0] == b"HTTP/1.1" and connection != b"close"
    if encoding is not None and encoding != b"identity":
        if not encoding.endswith(b"chunked"):
            raise httpx.RemoteProtocolError(f"unsupported transfer-encoding {encoding!r}")
        return status, await _read_chunked(reader), keep
    if length is not None:
        if not length.isdigit():
            raise httpx.RemoteProtocolError(f"bad content-length {length!r}")
        return status, await reader.readexactly(int(length)), keep
    if status in (204, 304):
        return status, b"", keep
    return status, await reader.read(), False  # framed by the end of the connection


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    body = bytearray()
    while True:
        size_line = await reader.readuntil(b"\r\n")
        try:
            size = int(size_line.split(b";", 1)[0].strip(), 16)
        except ValueError as e:
            raise httpx.RemoteProtocolError(f"bad chunk size line {size_line[:40]!r}") from e
        if size == 0:
            while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers, then the last line
                pass
            return bytes(body)
        body += await reader.readexactly(size)
        if await reader.readexactly(2) != b"\r\n":
            raise httpx.RemoteProtocolError("a chunk does not end with CRLF")
