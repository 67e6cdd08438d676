"""Client of the `remote` sandbox backend: one or several `agentgrpo serve-sandbox` servers.

Separate from `sandbox.py` because it is a different transport (HTTP through httpx, imported only
when a remote sandbox is used) with its own balancing and back-pressure; the `Sandbox` facade only
chooses a client and retries.
"""

from __future__ import annotations

import asyncio
import base64
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from agentgrpo.deadlines import waiting_for_capacity
from agentgrpo.verify._records import ExecResult, Limits, sandbox_error

if TYPE_CHECKING:
    from agentgrpo.verify.sandbox import SandboxConfig


class _RemoteClient:
    """Client of one or several `serve-sandbox` servers: least-loaded choice, retry on 429/5xx."""

    kind = "remote"

    def __init__(self, urls: Sequence[str], token: str | None, cfg: SandboxConfig) -> None:
        import httpx

        self.urls = [u.rstrip("/") for u in urls]
        self.cfg = cfg
        self.load = dict.fromkeys(self.urls, 0)
        self._lock = threading.Lock()
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._sync = httpx.Client(headers=self.headers, timeout=None)
        self._async: dict[int, object] = {}
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

    def _parse(self, resp, url: str) -> ExecResult:
        if resp.status_code != 200:
            return sandbox_error(f"{url}: HTTP {resp.status_code}: {resp.text[:200]}", "remote")
        try:
            d = resp.json()
            d["backend"] = f"remote:{d.get('backend')}"
            return ExecResult(**{k: d[k] for k in ExecResult.__dataclass_fields__ if k in d})
        except (ValueError, TypeError, KeyError) as e:  # a broken server is an infrastructure error
            return sandbox_error(f"{url}: bad response: {e}", "remote")

    def _busy_wait(self, resp, attempt: int, deadline: float) -> float | None:
        """Seconds to wait before retrying a busy server (429/503), None to give up."""
        if resp is None or resp.status_code not in (429, 503) or time.monotonic() >= deadline:
            return None
        try:
            after = float(resp.headers.get("Retry-After", "0"))
        except ValueError:
            after = 0.0
        return min(max(after, 0.05 * 2**attempt), 2.0, max(deadline - time.monotonic(), 0.0))

    def run(self, payload: dict, limits: Limits) -> ExecResult:
        import httpx

        deadline = time.monotonic() + self.cfg.busy_wait_s
        for attempt in range(1000):
            url, resp = self._pick(), None
            try:
                resp = self._sync.post(
                    url + "/run", json=payload, timeout=limits.wall_s + self.cfg.margin_s + 30
                )
            except httpx.HTTPError as e:
                return sandbox_error(f"{url}: {type(e).__name__}: {e}", "remote")
            finally:
                self._done(url)
            wait = self._busy_wait(resp, attempt, deadline)
            if wait is None:
                return self._parse(resp, url)
            with waiting_for_capacity():  # a busy server is load: not charged to a tool's deadline
                time.sleep(wait)
        return sandbox_error("servers busy", "remote")

    async def arun(self, payload: dict, limits: Limits) -> ExecResult:
        import httpx

        loop = asyncio.get_running_loop()
        client = self._async.get(id(loop))
        if client is None or client.is_closed:
            client = self._async[id(loop)] = httpx.AsyncClient(headers=self.headers, timeout=None)
        deadline = time.monotonic() + self.cfg.busy_wait_s
        for attempt in range(1000):
            url, resp = self._pick(), None
            try:
                resp = await client.post(
                    url + "/run", json=payload, timeout=limits.wall_s + self.cfg.margin_s + 30
                )
            except httpx.HTTPError as e:
                return sandbox_error(f"{url}: {type(e).__name__}: {e}", "remote")
            finally:
                self._done(url)
            wait = self._busy_wait(resp, attempt, deadline)
            if wait is None:
                return self._parse(resp, url)
            with waiting_for_capacity():
                await asyncio.sleep(wait)
        return sandbox_error("servers busy", "remote")

    def close(self) -> None:
        self._sync.close()
