"""Client of the `remote` sandbox backend: one or several `agentgrpo serve-sandbox` servers.

Separate from `sandbox.py` because it is a different transport (HTTP through httpx, imported only
when a remote sandbox is used) with its own balancing and back-pressure; the `Sandbox` facade only
chooses a client and retries.

The server is not trusted (issue 33): a response is validated field by field into `ExecResult`,
and anything else (a JSON list, a status it does not know, a number where text belongs, a body
larger than the job's output could make) is a `sandbox_error`, never a score. Each exchange with
a server, from connecting to the last byte of the answer, is bounded as a whole (`wall_s` +
`margin_s` + `SERVER_QUEUE_S`), so a server that drips its answer cannot hold a call past that;
httpx's own timeouts count per read. The synchronous `run` does its exchanges on an event loop of
its own (one thread per client) to get that bound from asyncio; its waits for a busy server stay
in the caller's thread, where `waiting_for_capacity` sees them.
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import TYPE_CHECKING, Any

from agentgrpo.deadlines import waiting_for_capacity
from agentgrpo.verify._records import STATUSES, ExecResult, Limits, sandbox_error

if TYPE_CHECKING:
    import httpx

    from agentgrpo.verify.sandbox import SandboxConfig

# Seconds an exchange may take beyond the job's wall time and margin: the job queueing for a slot
# on a loaded server, and the transfers.
SERVER_QUEUE_S = 30.0


def _count(v: object) -> bool:
    return v is None or (isinstance(v, int) and not isinstance(v, bool))


def _seconds(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0


# Each field of an ExecResult, what a server's value must be, and that in words.
_FIELDS: dict[str, tuple[Callable[[object], bool], str]] = {
    "status": (lambda v: v in STATUSES, f"one of {', '.join(STATUSES)}"),
    "exit_code": (_count, "an integer or null"),
    "signal": (_count, "an integer or null"),
    "stdout": (lambda v: isinstance(v, str), "a string"),
    "stderr": (lambda v: isinstance(v, str), "a string"),
    "truncated": (lambda v: isinstance(v, bool), "true or false"),
    "wall_s": (_seconds, "a finite number >= 0"),
    "backend": (lambda v: isinstance(v, str), "a string"),
    "detail": (lambda v: isinstance(v, str), "a string"),
    "cpu_s": (lambda v: v is None or _seconds(v), "a finite number >= 0 or null"),
    "max_rss_mb": (lambda v: v is None or _seconds(v), "a finite number >= 0 or null"),
}
_OPTIONAL = {"detail": "", "cpu_s": None, "max_rss_mb": None}


def parse_result(body: bytes) -> ExecResult:
    """A server's /run answer as an ExecResult; ValueError naming the first field that is wrong."""
    d = json.loads(body)
    if not isinstance(d, dict):
        raise ValueError(f"the answer is a JSON {type(d).__name__}, not an object")
    values = {}
    for name, (ok, what) in _FIELDS.items():
        if name not in d and name not in _OPTIONAL:
            raise ValueError(f"{name!r} is missing")
        value = d.get(name, _OPTIONAL.get(name))
        if not ok(value):
            raise ValueError(f"{name!r} must be {what}, not {str(value)[:80]!r}")
        values[name] = value
    return ExecResult(**{**values, "backend": f"remote:{values['backend']}"})


def _retry_after(resp: httpx.Response) -> float:
    """The seconds a busy server's Retry-After asks for (0 if absent, negative or not a number)."""
    try:
        after = float(resp.headers.get("Retry-After", "0"))
    except ValueError:
        return 0.0
    return after if math.isfinite(after) and after > 0 else 0.0


class _RemoteClient:
    """Client of one or several `serve-sandbox` servers: least-loaded choice, retry on 429/503."""

    kind = "remote"

    def __init__(self, urls: Sequence[str], token: str | None, cfg: SandboxConfig) -> None:
        self.urls = [u.rstrip("/") for u in urls]
        self.cfg = cfg
        self.load = dict.fromkeys(self.urls, 0)
        self._lock = threading.Lock()
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._async: dict[int, httpx.AsyncClient] = {}  # one per event loop
        self._loop: asyncio.AbstractEventLoop | None = None  # the synchronous `run`'s own
        self.info = {
            "backend": "remote",
            "slots": None,
            "features": [f"remote: {', '.join(self.urls)}"],
        }

    def _pick(self) -> str:
        with self._lock:
            url = min(self.urls, key=lambda u: self.load[u])
            self.load[url] += 1
            return url

    def _done(self, url: str) -> None:
        with self._lock:
            self.load[url] -= 1

    @staticmethod
    def body(code: bytes, stdin: bytes, files: list[tuple[str, bytes]], limits: Limits) -> dict:
        return {
            "code": code.decode("utf-8", "surrogateescape"),
            "stdin_b64": base64.b64encode(stdin).decode(),
            "files_b64": {n: base64.b64encode(b).decode() for n, b in files},
            "limits": limits.model_dump(),
        }

    def _client(self) -> httpx.AsyncClient:
        import httpx

        loop = asyncio.get_running_loop()
        client = self._async.get(id(loop))
        if client is None or client.is_closed:
            client = self._async[id(loop)] = httpx.AsyncClient(headers=self.headers, timeout=None)
        return client

    async def _exchange(self, payload: dict, limits: Limits) -> tuple[ExecResult, float | None]:
        """One request to the least-loaded server: its result, and the seconds to wait before
        trying again when the server was busy (429/503; None otherwise)."""
        import httpx

        url, bound = self._pick(), limits.wall_s + self.cfg.margin_s + SERVER_QUEUE_S
        # The most an honest answer holds: stdout and stderr, each character escaped in 6 bytes.
        most = 12 * limits.output_bytes + (64 << 10)

        async def fetch() -> tuple[httpx.Response, bytearray | None]:
            request = self._client().stream("POST", url + "/run", json=payload, timeout=bound)
            async with request as r:
                body = bytearray()
                async for chunk in r.aiter_bytes():
                    body += chunk
                    if len(body) > most:
                        return r, None
                return r, body

        try:
            resp, body = await asyncio.wait_for(fetch(), bound)  # the whole exchange, not per read
        except asyncio.TimeoutError:  # the builtin TimeoutError from Python 3.11
            return sandbox_error(f"{url}: no complete answer within {bound:.1f} s", "remote"), None
        except httpx.HTTPError as e:
            return sandbox_error(f"{url}: {type(e).__name__}: {e}", "remote"), None
        finally:
            self._done(url)
        if body is None:
            return sandbox_error(f"{url}: answer over {most} bytes", "remote"), None
        text = bytes(body[:200]).decode("utf-8", "replace")
        if resp.status_code in (429, 503):
            busy = sandbox_error(f"{url}: HTTP {resp.status_code}: {text}", "remote")
            return busy, _retry_after(resp)
        if resp.status_code != 200:
            return sandbox_error(f"{url}: HTTP {resp.status_code}: {text}", "remote"), None
        try:
            return parse_result(bytes(body)), None
        except ValueError as e:  # json's errors are ValueErrors too; a broken server is infra
            return sandbox_error(f"{url}: bad answer: {e}", "remote"), None

    def _busy_wait(self, retry_after: float | None, attempt: int, deadline: float) -> float | None:
        """Seconds to wait before retrying a busy server, None to give up."""
        if retry_after is None or time.monotonic() >= deadline:
            return None
        return min(max(retry_after, 0.05 * 2**attempt), 2.0, max(deadline - time.monotonic(), 0.0))

    def _on_own_loop(self, coro: Coroutine[Any, Any, Any]) -> Any:
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                threading.Thread(
                    target=self._loop.run_forever, name="sandbox-remote", daemon=True
                ).start()
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def run(self, payload: dict, limits: Limits) -> ExecResult:
        deadline = time.monotonic() + self.cfg.busy_wait_s
        res = sandbox_error("servers busy", "remote")
        for attempt in range(1000):
            res, retry_after = self._on_own_loop(self._exchange(payload, limits))
            wait = self._busy_wait(retry_after, attempt, deadline)
            if wait is None:
                return res
            with waiting_for_capacity():  # a busy server is load: not charged to a tool's deadline
                time.sleep(wait)
        return res

    async def arun(self, payload: dict, limits: Limits) -> ExecResult:
        deadline = time.monotonic() + self.cfg.busy_wait_s
        res = sandbox_error("servers busy", "remote")
        for attempt in range(1000):
            res, retry_after = await self._exchange(payload, limits)
            wait = self._busy_wait(retry_after, attempt, deadline)
            if wait is None:
                return res
            with waiting_for_capacity():
                await asyncio.sleep(wait)
        return res

    def close(self) -> None:
        loop, self._loop = self._loop, None
        if loop is None:
            return
        client = self._async.pop(id(loop), None)
        if client is not None:
            asyncio.run_coroutine_threadsafe(client.aclose(), loop).result(timeout=5)
        loop.call_soon_threadsafe(loop.stop)
