"""`RemoteEngine`: what the clients of inference servers share, whatever their protocol.

`SGLangEngine` and `VLLMEngine` are subclasses that say how to talk to their servers (the request
body, the pause and continue calls, where a server reports its weight version, how a checkpoint is
reloaded). This class holds the rest: the pool (`pool.py`) and control calls to one or every
server in rotation; `generate` with `max_new_tokens` clamped to the context window once known (a
prompt that leaves no room is a `length` Completion without tokens), the window learned from the
first context-length 400, and a request aborted by our own update pause sent again; and weight
updates under `paused()`, after which a returning server must serve the last pushed version, the
last disk update replayed on it when it does not (`_resync`). docs/serving.md has each server's
side.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import httpx

from agentgrpo.engine.base import Completion, EngineError, SamplingParams
from agentgrpo.engine.pool import ServerPool, ServerState, Wire, _ContextLengthError
from agentgrpo.engine.pool_config import PoolConfig

log = logging.getLogger(__name__)


class RemoteEngine:
    """The protocol-free part of an inference-server client (see the module docstring).

    A subclass sets `_window_slack` (the server admits prompt + max_new_tokens <= window - slack)
    and implements `_send` (one generate request), `_pause` / `_continue` (around an update),
    `_server_weight_version` and `_replay` (a returning server), `_score_body` / `_score_result`.
    """

    _window_slack = 0

    def __init__(self, config: PoolConfig, api_key: str | None, wire: Wire) -> None:
        self.config = config
        self.wire = wire
        headers = {"Content-Type": "application/json"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        # balancing, health and retries; a returning server must pass `_resync` to rejoin
        self._pool = ServerPool(config, headers, resync=self._resync, wire=wire)
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._epoch = 0  # bumped by every pause; lets generate() tell our aborts from others
        self._update_lock = asyncio.Lock()
        self._weight_version: str | None = None  # last pushed version (also the fallback for
        # servers that report none); a returning server must serve it to rejoin
        self._last_disk_update: Any = None  # replayed on returning servers
        self._update_targets: list[ServerState] | None = None
        self._released: list[ServerState] | None = None  # servers whose memory is released
        self._context_length: int | None = getattr(config, "context_length", None)

    @classmethod
    def from_config(cls, cfg: Any) -> Any:
        """Build from a validated config; the API key comes from the environment variable named
        by `cfg.api_key_env`, never from the config itself."""
        api_key = os.environ.get(cfg.api_key_env) if cfg.api_key_env else None
        return cls(cfg.urls, api_key=api_key, **cfg.model_dump(exclude={"urls"}))

    async def __aenter__(self) -> RemoteEngine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._pool.aclose()

    def servers(self) -> list[ServerState]:
        """A snapshot of every server's state (for logs and metrics)."""
        return [ServerState(**vars(s)) for s in self._pool.servers]

    def _learn_context_length(self, ctx: int | None) -> bool:
        """Keep the smallest context window seen; True when `ctx` lowered it."""
        if ctx is None or (self._context_length is not None and ctx >= self._context_length):
            return False
        self._context_length = ctx
        return True

    # -- generation --------------------------------------------------------------------------

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
        """Sample a completion of `prompt_ids` on the least loaded healthy server (the session's
        server with sticky routing). `max_new_tokens` is clamped to the servers' context window."""
        if not prompt_ids:
            raise ValueError(f"prompt_ids is empty ({self.wire.name} needs a prompt)")
        while True:
            max_new, ctx = params.max_new_tokens, self._context_length
            if ctx is not None:
                max_new = min(max_new, ctx - len(prompt_ids) - self._window_slack)
                if max_new < 1:
                    return self._no_room(
                        f"the prompt has {len(prompt_ids)} tokens and the servers' context "
                        f"length is {ctx}; no room for a new token"
                    )
            await self._resumed.wait()
            epoch = self._epoch
            try:
                c = await self._send(prompt_ids, params, max_new)
            except _ContextLengthError as e:
                learned = self._learn_context_length(self._context_length_of(str(e)))
                room = (self._context_length or 0) - len(prompt_ids) - self._window_slack
                if learned and room >= 1:
                    continue  # the window is known now: sent again, clamped to it
                return self._no_room(str(e))
            if c.finish_reason == "abort" and (epoch != self._epoch or not self._resumed.is_set()):
                continue  # aborted by our own weight-update pause: resubmit under the new weights
            return c

    def _no_room(self, why: str) -> Completion:
        return Completion([], [], "length", self._weight_version, detail=f"context length: {why}")

    async def _send(
        self, prompt_ids: list[int], params: SamplingParams, max_new: int
    ) -> Completion:
        """One generate request through the pool; raises `_ContextLengthError` for the server's
        context-length 400."""
        raise NotImplementedError

    def _context_length_of(self, message: str) -> int | None:
        """The context window a context-length error message names, or None."""
        raise NotImplementedError

    # -- scoring (the weight-sync probe) -----------------------------------------------------

    def _score_body(
        self, prompt_ids: list[int], completion_ids: list[int], temperature: float
    ) -> dict[str, Any]:
        raise NotImplementedError

    def _score_result(self, raw: dict[str, Any], body: dict[str, Any], start: int) -> list[float]:
        """The logprobs of the body's tokens from position `start` (the completion) on."""
        raise NotImplementedError

    async def score(
        self, prompt_ids: list[int], completion_ids: list[int], temperature: float = 1.0
    ) -> list[float]:
        """Logprobs of `completion_ids` after `prompt_ids`, from the prompt logprobs of one server
        (the balancer picks it; `score_each` asks every server)."""
        body = self._score_body(prompt_ids, completion_ids, temperature)
        await self._resumed.wait()
        raw = await self._pool.post_generate(body)
        return self._score_result(raw, body, len(prompt_ids))

    async def score_each(
        self, prompt_ids: list[int], completion_ids: list[int], temperature: float = 1.0
    ) -> dict[str, list[float]]:
        """`score` on every server in rotation, by URL. Verifying a weight sync needs this: any
        server may have acknowledged an update and kept its old weights, and `score` would look
        at one only. No retries: a server that cannot score is an `EngineError` naming it."""
        body = self._score_body(prompt_ids, completion_ids, temperature)
        await self._resumed.wait()
        servers = self._in_rotation()
        path = self.wire.generate_path

        async def one(s: ServerState) -> list[float]:
            fresh = {**body, self.wire.request_id_key: uuid.uuid4().hex}
            r = await self._control(s, "POST", path, fresh, timeout=self.config.request_timeout_s)
            raw = ServerPool.decode_output(f"{s.url}{path}", r.content)
            return self._score_result(raw, body, len(prompt_ids))

        results = await asyncio.gather(*(one(s) for s in servers))
        return {s.url: lps for s, lps in zip(servers, results, strict=True)}

    # -- control calls -----------------------------------------------------------------------

    async def _control(
        self,
        s: ServerState,
        method: str,
        path: str,
        payload: Any = None,
        *,
        timeout: float | None = None,
        allow_404: bool = False,
        tolerate: tuple[int, ...] = (),
    ) -> httpx.Response | None:
        """One control call to one server; raises `EngineError` on anything but 2xx and the
        statuses in `tolerate` (returned like a 2xx)."""
        timeout = self.config.connect_timeout_s + 30.0 if timeout is None else timeout
        try:
            r = await self._pool.client.request(
                method,
                f"{s.url}{path}",
                json=payload,
                timeout=httpx.Timeout(timeout, connect=self.config.connect_timeout_s),
            )
        except httpx.HTTPError as e:  # network boundary: name the server and the call
            raise EngineError(f"{s.url}{path} failed: {type(e).__name__}: {e}") from e
        if allow_404 and r.status_code == 404:
            return None
        if not 200 <= r.status_code < 300 and r.status_code not in tolerate:
            raise EngineError(
                f"{s.url}{path} answered HTTP {r.status_code}: {self.wire.error_message(r.content)}"
            )
        return r

    def _in_rotation(self) -> list[ServerState]:
        """The servers a control call goes to: those of the update in progress, else the healthy
        ones. Servers out of rotation catch up when they return (`_resync`)."""
        servers = self._update_targets or [s for s in self._pool.servers if s.healthy]
        if not servers:
            raise EngineError(
                f"no {self.wire.name} server in rotation: "
                + "; ".join(f"{s.url}: {s.last_error}" for s in self._pool.servers)
            )
        return servers

    async def _all(self, method: str, path: str, payload: Any = None, **kw: Any) -> list[Any]:
        return await self._each(self._in_rotation(), method, path, payload, **kw)

    async def _each(
        self,
        servers: Sequence[ServerState],
        method: str,
        path: str,
        payload: Any = None,
        *,
        return_exceptions: bool = False,
        **kw: Any,
    ) -> list[Any]:
        """The same control call to each of `servers`, concurrently."""
        return await asyncio.gather(
            *(self._control(s, method, path, payload, **kw) for s in servers),
            return_exceptions=return_exceptions,
        )

    async def _read_server_info(self, s: ServerState) -> None:
        """Read what server `s` reports of itself (version, parallel sizes, context window)."""
        raise NotImplementedError

    async def gpus_per_server(self) -> list[int]:
        """The ranks each server joins in an NCCL weight-update group (its model-parallel size),
        in `urls` order; data-parallel servers are refused."""
        for s in self._pool.servers:
            if s.tp_size is None:
                await self._read_server_info(s)
        bad = [s.url for s in self._pool.servers if s.dp_size != 1]
        if bad:
            raise EngineError(
                f"NCCL weight sync needs one data-parallel rank per server (or SGLang's DP "
                f"attention); not so on {bad}"
            )
        return [int(s.tp_size or 1) for s in self._pool.servers]

    def _require_every_server(self, servers: Sequence[ServerState]) -> None:
        """Raise `EngineError` naming the servers of the pool that are not in `servers` (an NCCL
        update needs every rank of its group)."""
        urls = {s.url for s in servers}
        missing = [s for s in self._pool.servers if s.url not in urls]
        if missing:
            raise EngineError(
                "an NCCL weight update needs every server of the weight-update group (a broadcast "
                "completes only when every rank joins), and "
                + "; ".join(f"{s.url} is out of rotation ({s.last_error})" for s in missing)
                + ". A server that restarted has left the group: start the run again (it resumes "
                "from its last checkpoint and creates the group anew) or sync from disk."
            )

    # -- weight updates ----------------------------------------------------------------------

    async def _pause(self, servers: list[ServerState]) -> None:
        """Stop generating on `servers` before an update (and drop what the update makes stale)."""
        raise NotImplementedError

    async def _continue(self, servers: list[ServerState]) -> list[Any]:
        """Generate again on `servers` after an update; each result or exception, in order."""
        raise NotImplementedError

    @asynccontextmanager
    async def paused(self, *, every_server: bool = False) -> AsyncIterator[None]:
        """Pause generation on the servers in rotation (`_pause`: in-flight requests are aborted
        and later resubmitted by this client, or kept with partial rollouts), run the body (the
        update), and always continue generation. New generate() calls wait meanwhile.

        `every_server=True` is for an update that must reach every server (NCCL): servers out of
        rotation are probed at once (they rejoin if healthy and on the current version), and
        `EngineError` names those still out before anything is paused."""
        if every_server:  # before the lock: a returning server's `_resync` takes it
            await self._pool.reprobe([s for s in self._pool.servers if not s.healthy])
        async with self._update_lock:
            if self._released is not None:
                raise EngineError(
                    f"weights pushed while the {self.wire.name} servers' memory is released: "
                    "call resume_memory() first (the update would write into freed memory)"
                )
            targets = self._in_rotation()
            if every_server:
                self._require_every_server(targets)
            self._update_targets = targets
            self._resumed.clear()
            self._epoch += 1
            try:
                await self._pause(targets)
                yield
            finally:
                results = await self._continue(self._update_targets)
                self._update_targets = None
                self._resumed.set()
                failed = [r for r in results if isinstance(r, BaseException)]
                if failed and sys.exc_info()[0] is None:  # don't hide the body's own error
                    raise failed[0]

    async def _server_weight_version(self, s: ServerState) -> str | None:
        """The weight version server `s` reports."""
        raise NotImplementedError

    async def _replay(self, s: ServerState) -> None:
        """Load `_last_disk_update` on server `s`, which missed it (or restarted)."""
        raise NotImplementedError

    async def _resync(self, s: ServerState) -> str:
        """Before a returning server rejoins: check that it serves the current weights, and
        reload the last disk checkpoint if it does not (it missed an update, or restarted).
        Returns "" when it may rejoin, else why not.

        Under the update lock: while an update runs, `_weight_version` is still the version being
        replaced and the update's servers are already chosen, so a server checked then would
        rejoin with weights the update never reached. It waits for the update and is checked
        against the new version (and an update waits for a replay in progress)."""
        async with self._update_lock:
            if self._weight_version is None:
                return ""
            if self._released is not None:  # its weights may be released too: no update now
                return "the servers' memory is released while the learner trains; it rejoins after"
            try:
                served = await self._server_weight_version(s)
                if served == self._weight_version:
                    return ""
                if self._last_disk_update is None:
                    return (
                        f"serves weight version {served!r}, not {self._weight_version!r}, and the "
                        "last update was not from disk"
                    )
                await self._replay(s)
            except EngineError as e:  # it stays out of rotation and is probed again later
                return f"could not bring it to weight version {self._weight_version}: {e}"
            name, version = self.wire.name, self._weight_version
            log.warning("%s server %s reloaded weight version %s", name, s.url, version)
            return ""

    async def weight_versions(self) -> dict[str, str | None]:
        """The weight version each server in rotation reports."""
        return {s.url: await self._server_weight_version(s) for s in self._in_rotation()}

    async def update_weights_from_disk(self, path: str | os.PathLike[str], version: str) -> None:
        """Load new weights on every server from `path` (same path on every machine) and set the
        weight version that later completions carry."""
        raise NotImplementedError

    async def update_weights(self, weights: Any, *, version: str) -> None:
        """`Engine` protocol: `weights` must be a directory of safetensors files every server can
        read. An in-memory state dict cannot travel over HTTP: use
        `agentgrpo.engine.weight_sync`."""
        if isinstance(weights, str | os.PathLike):
            await self.update_weights_from_disk(weights, version=version)
            return
        raise TypeError(
            f"{type(self).__name__}.update_weights takes a path to a safetensors directory; for a "
            "state dict use agentgrpo.engine.weight_sync.WeightSync (disk or distributed method)"
        )
