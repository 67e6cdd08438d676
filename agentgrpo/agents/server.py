"""The policy endpoint's HTTP server: uvicorn, with bounds that hold against hostile clients.

uvicorn alone lets a connection that never sends a request hold a connection slot forever
(issue 42: 40 idle connections shut out every authorised request). Here, for every route alike,
before any request is read: a waiting connection must deliver its whole request head within
`head_timeout_s` (new) or `keep_alive_s` (kept alive), however slowly it drips it; at most
`max_waiting` wait at once, the one waiting longest closed beyond; at most `max_connections` are
open, fewer when the process's descriptor limit leaves less room; after authentication a body
must arrive within `body_timeout_s`.

`Auth` checks, for every route, that the Host header names this machine on a loopback bind (no
DNS rebinding), then the token (`Authorization: Bearer`, or `x-api-key` as Anthropic's client
sends it). docs/security.md has the threat model and the measured attacks.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import os
import resource
import socket
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import uvicorn
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import Response
from uvicorn.protocols.http.h11_impl import H11Protocol

ACCEPT_QUEUE = 2048  # connections the kernel holds for us to accept (uvicorn's default backlog)


class ServerLimits(BaseModel):
    """Bounds of the endpoint's HTTP server; each applies to every route."""

    model_config = ConfigDict(extra="forbid")

    max_connections: int = Field(
        1024,
        ge=1,
        description="open connections at most; lowered to half the descriptors free at start-up "
        "when that is less. A connection past it is closed unless one waiting can be shed",
    )
    max_waiting: int = Field(
        128,
        ge=1,
        description="connections waiting for a request head at most (at most half of "
        "max_connections); the one waiting longest is closed beyond",
    )
    head_timeout_s: float = Field(
        10.0, gt=0, description="a new connection's whole request head must arrive within this"
    )
    keep_alive_s: float = Field(
        30.0,
        gt=0,
        description="an idle kept-alive connection's next request head must arrive within this",
    )
    body_timeout_s: float = Field(
        60.0, gt=0, description="a request body must arrive whole within this (a 408 after)"
    )


@dataclass
class Effective:
    """The limits a server runs with (`ServerLimits` after the descriptor budget), and its
    counters."""

    max_connections: int
    max_waiting: int
    accept_batch: int
    head_timeout_s: float
    keep_alive_s: float
    shed: int = 0  # connections closed to make room
    timed_out: int = 0  # connections closed for a head that did not arrive in time


def effective_limits(limits: ServerLimits, free: int | None) -> Effective:
    """`limits` within `free` descriptors (None: no known limit): connections take at most half
    of them, and asyncio accepts at most `accept_batch` at once before any can be shed."""
    conns = limits.max_connections
    if free is not None:
        conns = max(1, min(conns, free // 2))
    batch = 64 if free is None else max(1, min(64, free // 8))
    return Effective(
        max_connections=conns,
        max_waiting=max(1, min(limits.max_waiting, conns // 2)),
        accept_batch=batch,
        head_timeout_s=limits.head_timeout_s,
        keep_alive_s=limits.keep_alive_s,
    )


def free_descriptors() -> int | None:
    """File descriptors this process may still open (None where that cannot be known)."""
    try:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        used = len(os.listdir("/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"))
    except (OSError, ValueError):
        return None
    return None if soft == resource.RLIM_INFINITY else soft - used


class _Waiting:
    """The connections of one server that wait for a request head, longest-waiting first."""

    def __init__(self, limits: Effective) -> None:
        self.limits = limits
        self.timers: dict[_Guarded, asyncio.TimerHandle] = {}  # insertion order: longest first
        self.open: set[_Guarded] = set()  # not yet closed by us or lost

    def close(self, conn: _Guarded) -> None:
        """Abort `conn` now (its descriptor is freed on the next loop iteration)."""
        self.remove(conn)
        self.open.discard(conn)
        conn.transport.abort()

    def add(self, conn: _Guarded, timeout_s: float) -> None:
        self.remove(conn)
        while len(self.timers) >= self.limits.max_waiting:
            self.shed()
        self.timers[conn] = conn.loop.call_later(timeout_s, self._expired, conn)

    def remove(self, conn: _Guarded) -> None:
        timer = self.timers.pop(conn, None)
        if timer is not None:
            timer.cancel()

    def shed(self) -> bool:
        """Close the connection waiting longest; False when none waits."""
        if not self.timers:
            return False
        self.limits.shed += 1
        self.close(next(iter(self.timers)))
        return True

    def _expired(self, conn: _Guarded) -> None:
        self.timers.pop(conn, None)
        self.limits.timed_out += 1
        self.close(conn)


class _Guarded(H11Protocol):
    """uvicorn's h11 protocol, each connection registered in `waiting` while it owes a request
    head. `waiting` is set on the subclass made per server (`serve_app`)."""

    waiting: _Waiting
    _in_request = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        waiting = self.waiting
        waiting.open.add(self)
        if len(waiting.open) > waiting.limits.max_connections and not waiting.shed():
            waiting.limits.shed += 1
            waiting.close(self)  # every other connection is in a request: no room
            return
        waiting.add(self, waiting.limits.head_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self.waiting.remove(self)
        self.waiting.open.discard(self)
        super().connection_lost(exc)

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request head arrived
            self._in_request = True
            self.waiting.remove(self)

    def on_response_complete(self) -> None:
        self._in_request = False
        super().on_response_complete()  # may start a pipelined request (handle_events)
        if not self._in_request and not self.transport.is_closing():
            self.waiting.add(self, self.waiting.limits.keep_alive_s)


@contextlib.asynccontextmanager
async def serve_app(
    app: Any, host: str, port: int, limits: ServerLimits
) -> AsyncIterator[tuple[str, Effective]]:
    """Serve `app` on this event loop while the block runs; yields (base URL, the limits in
    effect). Port 0: any free port. Signals are left to the host program."""
    effective = effective_limits(limits, free_descriptors())
    waiting = _Waiting(effective)
    protocol = type("GuardedH11", (_Guarded,), {"waiting": waiting})

    class _Quiet(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Any:
            yield

    sock = _listening_socket(host, port, effective.accept_batch)
    server = _Quiet(
        uvicorn.Config(
            app,
            log_level="warning",
            lifespan="off",
            http=protocol,
            ws="none",  # no websocket routes: an upgrade request is plain HTTP
            limit_concurrency=None,  # connections are bounded above, waiting ones shed
            timeout_keep_alive=int(limits.keep_alive_s) + 1,  # ours closes first
            backlog=effective.accept_batch,  # asyncio accepts this many per wake-up
        )
    )
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            if task.done():
                task.result()  # the startup's error, else it stopped early
                raise RuntimeError("the policy endpoint stopped while starting")
            await asyncio.sleep(0.005)
        # asyncio listened with the accept batch as backlog; the kernel may queue many more
        # (a queue that overflows drops an honest client's connect for a second or more)
        sock.listen(ACCEPT_QUEUE)
        bound = sock.getsockname()
        yield f"http://{host if ':' not in host else f'[{host}]'}:{bound[1]}", effective
    finally:
        server.should_exit = True
        await task


def _listening_socket(host: str, port: int, backlog: int) -> socket.socket:
    """A TCP socket listening on (host, port). Its protocol is named: asyncio sets TCP_NODELAY
    only on accepted sockets whose proto is IPPROTO_TCP, and without it every reply waited for
    the client's delayed ACK (about 40 ms a call)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_name(header: bytes) -> str:
    """The host of a Host header, without its port (`[::1]:80` -> `::1`)."""
    text = header.decode("latin-1").strip().lower()
    if text.startswith("["):
        return text[1 : text.find("]")] if "]" in text else text
    return text.rsplit(":", 1)[0] if text.count(":") == 1 else text


@dataclass
class HostRule:
    """Which Host headers a server answers: with `loopback_only` (a loopback bind), only this
    machine's names and `allowed` (a reverse proxy's name); otherwise any."""

    loopback_only: bool = False
    allowed: frozenset[str] = frozenset()

    def admits(self, header: bytes) -> bool:
        name = host_name(header)
        return not self.loopback_only or is_loopback(name) or name in self.allowed


class Auth:
    """ASGI middleware for every route: the Host check (`hosts`, set when serving starts), then
    the token. `token` None: no token needed (the library's loopback default; serve-policy and
    AgentEnv always set one). `episode_token(path)` gives the token of the episode a path belongs
    to (`/episodes/<id>/v1/...`), which that path accepts as well as the server's.
    `error(status, message, code, path)` makes the error response (each API has its shape)."""

    def __init__(
        self,
        app: Any,
        token: str | None,
        hosts: HostRule,
        episode_token: Callable[[str], str | None],
        error: Callable[[int, str, str, str], Response],
    ) -> None:
        self.app, self.token, self.hosts = app, token, hosts
        self.episode_token, self.error = episode_token, error

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers, path = dict(scope["headers"]), scope["path"]
        if not self.hosts.admits(headers.get(b"host", b"")):
            host = headers.get(b"host", b"").decode("latin-1")
            resp = self.error(421, f"Host {host!r:.80} is not this server", "invalid_host", path)
        elif self.token is not None and not self._authorised(headers, path):
            message = "missing or wrong bearer token (or x-api-key)"
            resp = self.error(401, message, "invalid_api_key", path)
        else:
            await self.app(scope, receive, send)
            return
        resp.headers["connection"] = "close"  # no second try on this connection
        await resp(scope, receive, send)

    def _authorised(self, headers: dict[bytes, bytes], path: str) -> bool:
        if self.token is None:
            return False
        auth = headers.get(b"authorization", b"")
        sent = [auth[7:].strip() if auth[:7].lower() == b"bearer " else b""]
        sent.append(headers.get(b"x-api-key", b"").strip())  # Anthropic's clients send this
        keys = [self.token.encode()]
        own = self.episode_token(path)
        if own is not None:
            keys.append(own.encode())
        # every comparison is made, in constant time each: no early answer tells which failed
        return any([hmac.compare_digest(got, key) for got in sent if got for key in keys])
