"""The server pool shared by the clients of inference servers (SGLang, vLLM): which server a request
goes to, and which servers are in rotation.

The engine clients (`sglang/client.py`, `vllm/client.py`) decide what to ask the servers and how to
read the answers; this module decides where a generate request goes, how many run at once, and
what happens when a server fails. The engines' protocol differences come in a `Wire`. Requests go
to the least loaded healthy server, at most `max_inflight_per_server` at once; an episode's
requests (`SamplingParams.session_id`) stick to the server that holds its prefix cache, in a
bounded LRU table. Transport errors, 5xx and 429 take a server out of rotation and retry the
request elsewhere within one deadline, then raise `EngineError`; a server comes back once its
health probe and the engine's `resync` pass. Generate requests go over aiohttp, probes and control
calls over httpx. docs/rollouts.md (sticky routing, failures) and docs/serving.md (the server
pool) have the details.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import aiohttp
import httpx
import orjson

from agentgrpo.engine.base import EngineError
from agentgrpo.engine.wire import StreamReader, Wire, error_message  # noqa: F401 - re-exported

if TYPE_CHECKING:  # only the annotation needs the config
    from agentgrpo.engine.pool_config import PoolConfig

log = logging.getLogger(__name__)
_T = TypeVar("_T")

_RETRY_STATUS = frozenset({429, 500, 502, 503, 504})
# Idle generate connections are closed by the client after this long, before uvicorn (SGLang's and
# vLLM's server) closes them after its 5 s keep-alive timeout: a POST is not retried by aiohttp on a
# connection that the server closed under it, it would take the server out of rotation.
_KEEPALIVE_S = 4.0
# A transport failure of a generate request: refused, reset or dropped connection, cut or malformed
# answer.
_TRANSPORT_ERRORS = (
    aiohttp.ClientConnectionError,
    aiohttp.ClientPayloadError,
    aiohttp.ClientResponseError,
)


@dataclass
class ServerState:
    """What the client knows about one server (also returned by `SGLangEngine.servers()`)."""

    url: str
    healthy: bool = True
    outstanding: int = 0
    completed: int = 0
    failures: int = 0
    last_error: str = ""
    retry_at: float = 0.0  # loop time of the next health probe while unhealthy
    probe_delay: float = 0.0  # current probe backoff while unhealthy
    probing: bool = False
    version: str | None = None  # the server's version, once known
    tp_size: int | None = None  # GPUs it contributes to the NCCL weight-update group
    dp_size: int = 1


class _ContextLengthError(EngineError):
    """Internal: the server's 400 for a prompt that does not fit; becomes a `length` Completion."""


class ServerPool:
    """The servers of one engine client: balancing, health probes and retries of generate requests.

    `post_generate` sends a request to the least loaded healthy server and retries it elsewhere;
    `client` carries the engine's control calls and the health probes; `servers` holds what is
    known about each server, updated in place.
    """

    def __init__(
        self,
        config: PoolConfig,
        headers: dict[str, str],
        resync: Callable[[ServerState], Awaitable[str]],
        wire: Wire,
    ) -> None:
        self.config = config
        self.wire = wire
        cfg = config
        self.servers = [ServerState(url=u) for u in cfg.urls]  # updated in place
        for k, v in headers.items():  # an API key read from a file may end in a newline
            if any(c in f"{k}{v}" for c in "\r\n\0"):
                raise ValueError(f"HTTP header {k!r} has a line break or NUL; check the API key")
        self._headers = headers
        self._ssl = httpx.create_ssl_context()  # one context for every client (costly to build)
        self.client = self._new_client(4 * len(self.servers))  # control calls and probes
        # the generate sessions of each server, made in the event loop that first uses them
        self._sessions: dict[str, aiohttp.ClientSession] = {}
        self._sessions_loop: asyncio.AbstractEventLoop | None = None
        # callers waiting for a slot, each with the server its session is pinned to (or None)
        self._waiters: list[tuple[asyncio.Future[None], str | None]] = []
        self._pins: OrderedDict[str, ServerState] = OrderedDict()  # session -> its server, LRU
        self._probes: dict[str, asyncio.Task[None]] = {}  # running health probes (kept referenced)
        self._rr = 0  # rotates the scan start so equally loaded servers share the work
        self._resync = resync  # run on a returning server before it rejoins; "" = it may rejoin

    def _new_client(self, connections: int) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            headers=self._headers,
            timeout=httpx.Timeout(
                self.config.request_timeout_s, connect=self.config.connect_timeout_s
            ),
            limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections),
            verify=self._ssl,
            trust_env=False,  # never route cluster traffic through a proxy from the environment
        )

    def _session(self, url: str) -> aiohttp.ClientSession:
        """The generate session of the server at `url`: up to `max_inflight_per_server`
        keep-alive connections. aiohttp binds a session to an event loop, so a new loop (another
        `asyncio.run`) gets new sessions; the old loop's idle connections cannot be closed from
        the new one and are left to the garbage collector (a ResourceWarning each)."""
        loop = asyncio.get_running_loop()
        if self._sessions_loop is not loop:
            self._sessions, self._sessions_loop = {}, loop
        session = self._sessions.get(url)
        if session is None:
            connector = aiohttp.TCPConnector(
                limit=self.config.max_inflight_per_server,
                limit_per_host=0,
                ssl=self._ssl,
                keepalive_timeout=_KEEPALIVE_S,
            )
            session = self._sessions[url] = aiohttp.ClientSession(
                connector=connector, headers=self._headers, trust_env=False
            )  # never route cluster traffic through a proxy from the environment
        return session

    async def aclose(self) -> None:
        probes = [t for t in self._probes.values() if not t.done()]
        for t in probes:
            t.cancel()
        await asyncio.gather(*probes, return_exceptions=True)
        sessions, self._sessions = self._sessions, {}
        if self._sessions_loop is not asyncio.get_running_loop():
            sessions = {}  # made in a loop that has ended: nothing left to close from here
        await asyncio.gather(self.client.aclose(), *(s.close() for s in sessions.values()))

    async def wait_ready(self, timeout_s: float | None = None) -> None:
        """Wait until every server answers 200 on its health path; then all are healthy.

        Raises `EngineError` naming each server that was not ready and what it last answered.
        """
        timeout_s = self.config.ready_timeout_s if timeout_s is None else timeout_s
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        last: dict[str, str] = {s.url: "no answer yet" for s in self.servers}
        pending = list(self.servers)
        while pending:
            results = await asyncio.gather(*(self._probe_once(s) for s in pending))
            for s, err in zip(pending, results, strict=True):
                last[s.url] = err or "ready"
            pending = [s for s, err in zip(pending, results, strict=True) if err]
            if not pending:
                break
            if loop.time() >= deadline:
                detail = "; ".join(f"{s.url}: {last[s.url]}" for s in pending)
                raise EngineError(
                    f"{self.wire.name} server(s) not ready after {timeout_s:.0f}s ({detail}). "
                    f"{self.wire.not_ready_hint}"
                )
            await asyncio.sleep(min(self.config.ready_poll_s, max(0.0, deadline - loop.time())))
        for s in self.servers:
            s.healthy, s.retry_at, s.probe_delay = True, 0.0, 0.0

    async def _probe_once(self, s: ServerState) -> str:
        """One GET of the health path; returns "" when healthy, else what went wrong."""
        try:
            r = await self.client.get(
                f"{s.url}{self.wire.health_path}", timeout=self.config.connect_timeout_s + 20.0
            )
        except httpx.HTTPError as e:  # network boundary: a refused or dropped probe means "not yet"
            return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        return "" if r.status_code == 200 else f"HTTP {r.status_code}"

    # -- requests ------------------------------------------------------------------------------

    async def post_generate(
        self, body: dict[str, Any], *, session_id: str | None = None
    ) -> dict[str, Any]:
        """POST a generate request with balancing, retries and the deadline; returns the output.
        `session_id`: the episode the request belongs to (sticky routing: docs/rollouts.md)."""
        return await self._post(body, session_id, self._read_json)

    async def post_generate_stream(
        self, body: dict[str, Any], *, session_id: str | None = None
    ) -> StreamReader:
        """`post_generate` for a streamed request (`body["stream"]` true): the SSE chunks fed to a
        fresh `Wire.new_stream()` (SGLang's `StreamFold`), returned at `[DONE]`. A stream cut
        before `[DONE]` is a transport failure (the server leaves the rotation, the request is
        retried); an error event is what a 400 is to `post_generate`."""
        return await self._post(body, session_id, self._read_sse)

    async def _post(
        self,
        body: dict[str, Any],
        session_id: str | None,
        read: Callable[[str, aiohttp.ClientResponse], Awaitable[_T]],
    ) -> _T:
        """The request loop: a server, an attempt, its answer read by `read` when it is a 200."""
        cfg = self.config
        loop = asyncio.get_running_loop()
        deadline = loop.time() + cfg.request_timeout_s
        attempt = 0
        last_error = "no attempt made"
        while True:
            s = await self._acquire(deadline, last_error, session_id)
            # fresh per attempt: the old one may still be running
            body[self.wire.request_id_key] = uuid.uuid4().hex
            url = s.url
            content = orjson.dumps(body)  # the stdlib's json is slow on long token lists
            timeout = aiohttp.ClientTimeout(
                total=max(deadline - loop.time(), 0.001), sock_connect=cfg.connect_timeout_s
            )
            try:
                async with self._session(url).post(
                    f"{url}{self.wire.generate_path}", data=content, timeout=timeout
                ) as r:
                    status = r.status
                    if status == 200:
                        result = await read(url, r)
                    else:
                        answer = await r.read()
            except aiohttp.ConnectionTimeoutError as e:
                # network boundary: no connection within connect_timeout_s -> server out, retry
                last_error = f"{url}: connect timeout"
                self._mark_unhealthy(s, f"connect timeout: {e}")
                if loop.time() >= deadline:
                    raise EngineError(
                        f"{self.wire.name} request did not finish within its "
                        f"{cfg.request_timeout_s:.0f}s deadline (last: {last_error})"
                    ) from e
            except asyncio.TimeoutError as e:
                # network boundary: the request's deadline is spent (the server may be busy, not
                # down)
                last_error = f"{url}: no answer within the deadline"
                raise EngineError(
                    f"{self.wire.name} request did not finish within its "
                    f"{cfg.request_timeout_s:.0f}s deadline (last: {last_error})"
                ) from e
            except _TRANSPORT_ERRORS as e:
                # network boundary: refused / dropped connection, broken answer -> server out, retry
                last_error = f"{url}: {type(e).__name__}: {e}"
                self._mark_unhealthy(s, last_error)
            else:
                if status == 200:
                    s.completed += 1
                    return result
                last_error = self._refused(url, status, answer)  # raises unless retryable
                self._mark_unhealthy(s, last_error)
            finally:
                self._release(s)  # also when the caller is cancelled mid-request
            attempt += 1
            if attempt > cfg.max_retries:
                raise EngineError(
                    f"{self.wire.name} request failed after {attempt} attempts (last: {last_error})"
                )
            delay = min(cfg.backoff_max_s, cfg.backoff_initial_s * 2 ** (attempt - 1))
            if loop.time() + delay >= deadline:
                raise EngineError(
                    f"{self.wire.name} request deadline of {cfg.request_timeout_s:.0f}s reached "
                    f"after {attempt} attempts (last: {last_error})"
                )
            await asyncio.sleep(delay)

    def _refused(self, url: str, status: int, answer: bytes) -> str:
        """What a non-200 answer means: raises `_ContextLengthError` (the prompt does not fit) or
        `EngineError` (the request's fault, or the API key); returns the error of a retryable
        status (5xx, 429)."""
        msg = self.wire.error_message(answer)
        if status == 400 and self.wire.is_context_length_error(msg):
            raise _ContextLengthError(msg)
        if status in (401, 403):
            raise EngineError(
                f"{url} refused the request with HTTP {status} ({msg}): the server runs "
                "with --api-key; pass api_key= (or set the variable named by api_key_env)"
            )
        if status not in _RETRY_STATUS:
            raise EngineError(f"{url}{self.wire.generate_path} answered HTTP {status}: {msg}")
        return f"{url}: HTTP {status}: {msg}"

    async def _read_json(self, url: str, r: aiohttp.ClientResponse) -> dict[str, Any]:
        return self.decode_output(f"{url}{self.wire.generate_path}", await r.read())

    async def _read_sse(self, url: str, r: aiohttp.ClientResponse) -> StreamReader:
        """Read the server-sent events of one streamed request: `data: <json>` events, each
        ended by a blank line, then `data: [DONE]`. Split here rather than by aiohttp's line
        reader, whose line limit (128 KiB) a cumulative chunk of a long completion exceeds."""
        if self.wire.new_stream is None:
            raise EngineError(f"{self.wire.name} requests are not streamed by this client")
        fold = self.wire.new_stream()
        where = f"{url}{self.wire.generate_path}"
        buf = bytearray()
        async for data in r.content.iter_any():
            start = max(0, len(buf) - 1)  # a separator may straddle two reads
            buf += data
            while (end := buf.find(b"\n\n", start)) >= 0:
                event = bytes(buf[:end])
                del buf[: end + 2]
                start = 0
                if not event.startswith(b"data: "):
                    continue  # data events only carry anything
                payload = event[6:]
                if payload == b"[DONE]":
                    return fold
                try:
                    chunk = orjson.loads(payload)
                except ValueError as e:  # trust boundary: a cut or foreign event
                    raise EngineError(f"{where} streamed invalid JSON: {e}") from e
                if not isinstance(chunk, dict):
                    raise EngineError(f"{where} streamed {type(chunk).__name__} chunks")
                if "error" in chunk:  # a validation error once the stream began (HTTP 200)
                    msg = self.wire.error_message(payload)
                    if self.wire.is_context_length_error(msg):
                        raise _ContextLengthError(msg)
                    raise EngineError(f"{where} failed in its stream: {msg}")
                fold.feed(chunk)
        raise aiohttp.ClientPayloadError("the event stream ended before data: [DONE]")

    @staticmethod
    def decode_output(where: str, content: bytes) -> dict[str, Any]:
        """The JSON object of a generate answer (a one-element list unwrapped); `where` names the
        server and path in errors."""
        try:
            out = orjson.loads(content)
        except ValueError as e:  # trust boundary: a proxy's HTML page, a cut body
            raise EngineError(f"{where} returned invalid JSON: {e}") from e
        if isinstance(out, list) and len(out) == 1:
            out = out[0]
        if not isinstance(out, dict):
            raise EngineError(f"{where} returned {type(out).__name__}, not an object")
        return out

    # -- balancing and health ----------------------------------------------------------------

    async def _acquire(
        self, deadline: float, last_error: str, session_id: str | None = None
    ) -> ServerState:
        """Reserve a slot on the server `session_id` is pinned to while it is healthy, else on the
        least loaded healthy server (then the session is pinned there), waiting for a slot until
        `deadline`.

        The same scan starts the health probes of servers out of rotation whose time has come,
        so a server returns as soon as it is healthy even while the others carry the load.
        """
        loop = asyncio.get_running_loop()
        cap = self.config.max_inflight_per_server
        servers = self.servers
        n = len(servers)
        sticky = session_id is not None and n > 1 and self.config.max_sticky_sessions > 0
        while True:
            now = loop.time()
            best: ServerState | None = None
            wake = deadline
            start = self._rr = (self._rr + 1) % n
            for i in range(n):
                s = servers[(start + i) % n]
                if s.healthy:
                    if s.outstanding < cap and (best is None or s.outstanding < best.outstanding):
                        best = s
                    continue
                if s.probing:
                    continue  # its probe wakes every waiter when it ends, whatever the outcome
                if s.retry_at <= now:
                    self._start_probe(s)
                else:
                    wake = min(wake, s.retry_at)
            pinned = self._pins.get(session_id) if sticky else None
            if pinned is not None and pinned.healthy:  # its cache holds the episode: wait for it
                best = pinned if pinned.outstanding < cap else None
            else:
                pinned = None  # a new session, or its server left: it moves to `best`
            if best is not None:
                best.outstanding += 1
                if sticky:
                    self._pin(session_id, best)
                return best
            if now >= deadline:
                states = ", ".join(
                    f"{s.url} ({'healthy' if s.healthy else 'down: ' + s.last_error}, "
                    f"{s.outstanding} in flight)"
                    for s in servers
                )
                raise EngineError(
                    f"no {self.wire.name} server available before the request deadline: {states}; "
                    f"last error: {last_error}"
                )
            fut: asyncio.Future[None] = loop.create_future()
            waiter = (fut, None if pinned is None else pinned.url)
            self._waiters.append(waiter)
            try:
                await asyncio.wait_for(fut, timeout=max(0.0, wake - now))
            except asyncio.TimeoutError:
                pass
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)

    def _pin(self, session_id: str, s: ServerState) -> None:
        """Remember `s` as the session's server, forgetting the least recently used session once
        the table holds `max_sticky_sessions`."""
        self._pins[session_id] = s
        self._pins.move_to_end(session_id)
        if len(self._pins) > self.config.max_sticky_sessions:
            self._pins.popitem(last=False)

    def session_server(self, session_id: str) -> str | None:
        """The URL of the server a session is pinned to, None when none (for logs and tests)."""
        s = self._pins.get(session_id)
        return None if s is None else s.url

    def _wake(self, freed: str | None = None) -> None:
        """Wake waiting callers: on a freed slot of server `freed`, the first one that may take
        it (not pinned to another server); on a health change (`freed` None), all of them."""
        for i, (f, pin) in enumerate(self._waiters):
            if f.done():
                continue
            if freed is None:
                f.set_result(None)
            elif pin is None or pin == freed:
                f.set_result(None)
                del self._waiters[i]
                return
        if freed is None:
            self._waiters.clear()

    def _release(self, s: ServerState) -> None:
        s.outstanding -= 1
        if self._waiters:
            self._wake(freed=s.url)

    def _mark_unhealthy(self, s: ServerState, error: str) -> None:
        s.failures += 1
        s.last_error = error
        if s.healthy:
            log.warning("%s server %s taken out of rotation: %s", self.wire.name, s.url, error)
            s.healthy = False
            s.probe_delay = 0.0
            s.retry_at = asyncio.get_running_loop().time()  # first probe right away

    def _start_probe(self, s: ServerState) -> asyncio.Task[None]:
        s.probing = True
        self._probes[s.url] = task = asyncio.ensure_future(self._reprobe(s))
        return task

    async def reprobe(self, servers: list[ServerState]) -> None:
        """Probe these servers out of rotation now (health, then resync), not at their next
        probe time, joining probes already running; returns when every probe has ended."""
        tasks = []
        for s in servers:
            running = self._probes.get(s.url)
            tasks.append(running if s.probing and running is not None else self._start_probe(s))
        await asyncio.gather(*(asyncio.shield(t) for t in tasks))

    async def _reprobe(self, s: ServerState) -> None:
        err = "the probe was cancelled"
        try:
            err = await self._probe_once(s) or await self._resync(s)
        except Exception as e:  # noqa: BLE001 - a probe task has no caller: record why, probe again later
            err = f"{type(e).__name__}: {e}"
            log.warning("%s server %s: health probe failed: %s", self.wire.name, s.url, err)
        finally:
            s.probing = False
            if err:
                s.last_error = f"health probe: {err}"
                s.probe_delay = min(self.config.probe_interval_s, max(0.05, s.probe_delay * 2))
                s.retry_at = asyncio.get_running_loop().time() + s.probe_delay
            else:
                if not s.healthy:
                    log.warning("%s server %s is healthy again", self.wire.name, s.url)
                s.healthy, s.probe_delay = True, 0.0
            self._wake()  # waiters skip probing servers (see _acquire): they look again now
