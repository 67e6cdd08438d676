"""`SGLangEngine`: a client of SGLang's native `/generate` API, for one or many servers.

`/generate` goes over aiohttp (`sglang_pool.py`), control calls and probes over httpx.

Token in, token out: the client sends `input_ids` and reads the sampled ids and their logprobs from
`meta_info.output_token_logprobs` (every SGLang version has it; `output_ids` is missing before
v0.5.0). It sends exactly the RL sampling settings of docs/serving.md and no
other `sampling_params` key, because SGLang answers an unknown key with a 500.

Decisions (docs/serving.md has the server side of each):
- Balancing, failures and retries live in `sglang_pool.py`: least outstanding requests over the
  healthy servers, every turn of an episode on one server (`SamplingParams.session_id`, sticky
  routing); a failing server leaves the rotation and rejoins once healthy; a request that
  runs out of retries or of its deadline raises `EngineError`, never a made-up completion.
- The context window: SGLang rejects `prompt + max_new_tokens >= context_length` with a 400, so
  `max_new_tokens` is always clamped client-side to `context_length - prompt - 1` once the window
  is known: from `SGLangConfig.context_length`, from `/server_info` at `wait_ready()` (SGLang
  reports it there only when launched with `--context-length`), or else from the first such 400,
  whose message names it (the request is then sent again, clamped). Callers may thus ask for
  `window - prompt` tokens, the local engine's rule. A prompt that leaves no room is not an
  infrastructure failure: it becomes a `length` Completion with no tokens and the reason (the
  server's message, when it answered) in `detail`.
- Colocated with the learner (`release_memory_during_training`), the servers hold no GPU memory
  between a step's rollouts and its weight push: `release_memory` pauses them (abort: SGLang asserts
  an idle scheduler, and a request this client abandoned may still run) and frees weights and KV
  cache; `resume_memory` takes both back and continues; then the push. Both come back before the
  push (slime and verl resume the KV cache after in-memory updates): a disk update needs no room
  beyond the weights, and the push's pause/flush meets an ordinary server. A server without
  `--enable-memory-saver` would accept the release and free nothing: it is refused instead.
- Weight updates follow pause -> flush_cache -> update -> continue on every server in rotation.
  Requests that SGLang aborts because of our own pause are resubmitted once generation continues
  (their partial tokens came from the old weights); new requests wait client-side until the update
  is done.
- Partial rollouts (`partial_rollouts`): the pause is SGLang's mode `retract` instead, which keeps
  the requests in flight (their KV is dropped and recomputed under the new weights when they
  continue), so an update does not wait for long episodes and throws no token away. Every request
  is then streamed: SGLang stamps each chunk with the weight version of the moment it sent it, and
  no token is decoded while paused, so the tokens of the chunks before the update are the old
  version's (`StreamFold`, `Completion.version_runs`). The update itself is sent with
  `flush_cache: false`: SGLang asserts that this flush succeeds, and stock SGLang cannot flush while
  retracted requests wait in its queue (the scheduler dies; sgl-project/sglang#33783). The cache
  is flushed by `/flush_cache` after the pause instead; a server that refuses (400) keeps the
  prefixes it cached before the update, old-weight KV that later requests (the retracted ones too)
  may reuse until it is evicted: logged once per server. Builds with sgl-project/sglang#33784
  flush. A server that was out of rotation during an update (or restarted) must serve the
  current weight version to rejoin, checked under the update lock (one coming back during an
  update waits for it to end, then is checked against the new version): after a disk update the
  client replays it on that server. An NCCL update goes to every server of the group or to none
  (`paused(every_server=True)`, see `update_weights_from_distributed`); a server that restarted has
  left the group and stays out, and the next NCCL push names it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx

from agentgrpo.engine.base import Completion, EngineError, SamplingParams
from agentgrpo.engine.pool import ServerPool, ServerState, _ContextLengthError
from agentgrpo.engine.sglang.config import SGLangConfig
from agentgrpo.engine.sglang.nccl import NcclUpdates
from agentgrpo.engine.sglang.protocol import (  # noqa: F401 - re-exported: the client's public parsing API
    StreamFold,
    _version_tuple,
    context_length_of,
    error_message,
    is_context_length_error,
    parse_generate_output,
    parse_generate_response,
    sampling_body,
    score_body,
    score_result,
)

log = logging.getLogger(__name__)


class SGLangEngine(NcclUpdates):
    """Client of one or more SGLang servers, implementing the `Engine` protocol.

    Example:
        ```python
        engine = SGLangEngine(["http://10.0.0.5:30000", "http://10.0.0.6:30000"])
        await engine.wait_ready()
        c = await engine.generate(prompt_ids, SamplingParams(max_new_tokens=512,
                                                             stop_token_ids=(151645,)))
        c.token_ids, c.logprobs, c.finish_reason, c.weight_version
        await engine.update_weights_from_disk("/shared/ckpt/step_10", version="10")
        await engine.aclose()
        ```

    `api_key` (or the variable named by `SGLangConfig.api_key_env` with `from_config`) is sent as
    `Authorization: Bearer`. Other keyword arguments are `SGLangConfig` fields.
    """

    def __init__(self, urls: Sequence[str], *, api_key: str | None = None, **settings: Any) -> None:
        self.config = SGLangConfig(urls=list(urls), **settings)
        headers = {"Content-Type": "application/json"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        # balancing, health and retries; a returning server must pass `_resync` to rejoin
        self._pool = ServerPool(self.config, headers, resync=self._resync)
        self._resumed = asyncio.Event()
        self._resumed.set()
        self._epoch = 0  # bumped by every pause; lets generate() tell our aborts from others
        self._update_lock = asyncio.Lock()
        self._weight_version: str | None = None  # last pushed version (also the fallback for
        # servers without meta weight_version); a returning server must serve it to rejoin
        self._last_disk_update: dict[str, Any] | None = None  # replayed on returning servers
        self._update_targets: list[ServerState] | None = None
        self._released: list[ServerState] | None = None  # servers whose memory release_memory freed
        self._memory_saver: set[str] = set()  # urls seen with --enable-memory-saver
        self._stale_cache: set[str] = set()  # urls that could not flush under a retract pause
        self._context_length = (
            self.config.context_length
        )  # smallest window known, see the module doc

    @classmethod
    def from_config(cls, cfg: SGLangConfig) -> SGLangEngine:
        """Build from a validated config; the API key comes from the environment variable."""
        api_key = os.environ.get(cfg.api_key_env) if cfg.api_key_env else None
        return cls(cfg.urls, api_key=api_key, **cfg.model_dump(exclude={"urls"}))

    async def __aenter__(self) -> SGLangEngine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._pool.aclose()

    def servers(self) -> list[ServerState]:
        """A snapshot of every server's state (for logs and metrics)."""
        return [ServerState(**vars(s)) for s in self._pool.servers]

    # -- readiness ---------------------------------------------------------------------------

    async def wait_ready(self, timeout_s: float | None = None, *, seeded: bool = False) -> None:
        """Wait until every server answers 200 on `/health_generate`, then read its version (the
        `seed` check needs it), TP size and, when it reports one, its context length.

        Raises `EngineError` naming each server that was not ready and what it last answered.
        `seeded=True` (training and `agentgrpo eval`, which seed every request) also refuses, here
        and not on every request, a server too old for `sampling_seed`.
        """
        await self._pool.wait_ready(timeout_s)
        await asyncio.gather(*(self._read_server_info(s) for s in self._pool.servers))
        if seeded:
            self._check_seed_support()
        if self.config.partial_rollouts:
            old = [
                f"{s.url} ({s.version})"
                for s in self._pool.servers
                if s.version is not None and _version_tuple(s.version) < (0, 5, 6)
            ]
            if old:
                raise EngineError(
                    "partial_rollouts needs SGLang >= 0.5.6 (pause_generation modes; older "
                    f"servers abort every request on a pause): {', '.join(old)}"
                )

    async def _server_info(self, s: ServerState) -> dict[str, Any]:
        r = await self._control(s, "GET", "/server_info", allow_404=True)
        if r is None:  # very old servers only have /get_server_info
            r = await self._control(s, "GET", "/get_server_info")
        return r.json()

    async def _read_server_info(self, s: ServerState) -> None:
        info = await self._server_info(s)
        s.version = str(info.get("version")) if info.get("version") is not None else None
        s.tp_size = int(info.get("tp_size") or 1)
        s.dp_size = 1 if info.get("enable_dp_attention") else int(info.get("dp_size") or 1)
        ctx = info.get("context_length")  # null unless launched with --context-length
        self._learn_context_length(int(ctx) if ctx else None)
        # the flag is --incremental-streaming-output since 2026-03, --stream-output before
        if self.config.partial_rollouts and not (
            info.get("incremental_streaming_output") or info.get("stream_output")
        ):
            log.warning(
                "SGLang server %s streams cumulative chunks (no --incremental-streaming-output): "
                "with partial_rollouts every request is streamed and each chunk repeats the "
                "output so far, O(n^2) bytes for n tokens on the server and the client "
                "(docs/rollouts.md has the numbers). Restart it with the flag.",
                s.url,
            )
        log.info(
            "SGLang server %s: version %s, tp_size %s, context_length %s",
            s.url,
            s.version,
            s.tp_size,
            ctx,
        )

    def _learn_context_length(self, ctx: int | None) -> bool:
        """Keep the smallest context window seen; True when `ctx` lowered it."""
        if ctx is None or (self._context_length is not None and ctx >= self._context_length):
            return False
        self._context_length = ctx
        return True

    # -- generation --------------------------------------------------------------------------

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
        """Sample a completion of `prompt_ids` on the least loaded healthy server.

        `max_new_tokens` is clamped to the servers' context window (see the module docstring).
        """
        if not prompt_ids:
            raise ValueError("prompt_ids is empty (SGLang rejects empty input_ids)")
        if params.seed is not None:
            self._check_seed_support()
        body: dict[str, Any] = {
            "rid": "",
            "input_ids": prompt_ids,
            "sampling_params": None,
            "return_logprob": True,
            "logprob_start_len": -1,
            "stream": self.config.partial_rollouts,  # the version of every chunk, see above
        }
        sid = params.session_id  # sticky routing (sglang_pool.py); never sent to SGLang
        while True:
            max_new, ctx = params.max_new_tokens, self._context_length
            if ctx is not None:
                max_new = min(max_new, ctx - len(prompt_ids) - 1)
                if max_new < 1:
                    return Completion(
                        [],
                        [],
                        "length",
                        self._weight_version,
                        detail=f"context length: the prompt has {len(prompt_ids)} tokens and the "
                        f"servers' context length is {ctx}; no room for a new token",
                    )
            body["sampling_params"] = sampling_body(params, max_new)
            await self._resumed.wait()
            epoch = self._epoch
            fold: StreamFold | None = None
            try:
                if body["stream"]:
                    fold = await self._pool.post_generate_stream(body, session_id=sid)
                else:
                    raw = await self._pool.post_generate(body, session_id=sid)
            except _ContextLengthError as e:
                learned = self._learn_context_length(context_length_of(str(e)))
                if learned and len(prompt_ids) + 1 < (self._context_length or 0):
                    continue  # the window is known now: sent again, clamped to it
                return Completion(
                    [], [], "length", self._weight_version, detail=f"context length: {e}"
                )
            if fold is not None:
                raw = fold.output()
            c = parse_generate_output(raw, weight_version=self._weight_version)
            if c.finish_reason == "abort" and (epoch != self._epoch or not self._resumed.is_set()):
                continue  # aborted by our own weight-update pause: resubmit under the new weights
            if fold is not None and len(runs := fold.version_runs(self._weight_version)) > 1:
                c.version_runs = runs
            return c

    async def score(
        self, prompt_ids: list[int], completion_ids: list[int], temperature: float = 1.0
    ) -> list[float]:
        """Logprobs of `completion_ids` after `prompt_ids`, from the prompt logprobs of one server
        (the balancer picks it; `score_each` asks every server).

        At temperature 1 every SGLang version returns plain log_softmax(logits); other
        temperatures depend on the server version.
        """
        body = score_body(prompt_ids, completion_ids, temperature)
        await self._resumed.wait()
        return score_result(await self._pool.post_generate(body), body)

    async def score_each(
        self, prompt_ids: list[int], completion_ids: list[int], temperature: float = 1.0
    ) -> dict[str, list[float]]:
        """`score` on every server in rotation, by URL. Verifying a weight sync needs this: any
        server may have acknowledged an update and kept its old weights, and `score` would look
        at one only. No retries: a server that cannot score is an `EngineError` naming it."""
        body = score_body(prompt_ids, completion_ids, temperature)
        await self._resumed.wait()
        servers = self._in_rotation()

        async def one(s: ServerState) -> list[float]:
            r = await self._control(
                s,
                "POST",
                "/generate",
                {**body, "rid": uuid.uuid4().hex},
                timeout=self.config.request_timeout_s,
            )
            return score_result(ServerPool._decode_output(s.url, r.content), body)

        results = await asyncio.gather(*(one(s) for s in servers))
        return {s.url: lps for s, lps in zip(servers, results, strict=True)}

    def _check_seed_support(self) -> None:
        for s in self._pool.servers:
            if s.version is not None and _version_tuple(s.version) < (0, 5, 9):
                raise EngineError(
                    f"SamplingParams.seed needs SGLang >= 0.5.9 (sampling_seed); {s.url} runs "
                    f"{s.version}. Use seed=None with this server."
                )

    # -- control and weight updates ----------------------------------------------------------

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
                r = await self._control(s, "GET", "/model_info")
                if r.json().get("weight_version") == self._weight_version:
                    return ""
                if self._last_disk_update is None:
                    return (
                        f"serves weight version {r.json().get('weight_version')!r}, not "
                        f"{self._weight_version!r}, and the last update was not from disk"
                    )
                await self._control(
                    s,
                    "POST",
                    "/update_weights_from_disk",
                    self._last_disk_update,
                    timeout=self.config.weight_update_timeout_s,
                )
            except EngineError as e:  # it stays out of rotation and is probed again later
                return f"could not bring it to weight version {self._weight_version}: {e}"
            log.warning("SGLang server %s reloaded weight version %s", s.url, self._weight_version)
            return ""

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
                f"{s.url}{path} answered HTTP {r.status_code}: {error_message(r.content)}"
            )
        return r

    def _in_rotation(self) -> list[ServerState]:
        """The servers a control call goes to: those of the update in progress, else the healthy
        ones. Servers out of rotation catch up when they return (`_resync`)."""
        servers = self._update_targets or [s for s in self._pool.servers if s.healthy]
        if not servers:
            raise EngineError(
                "no SGLang server in rotation: "
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

    async def flush_cache(self, timeout_s: float | None = None) -> None:
        """Flush the prefix cache on every server, retrying while requests are still in flight
        (SGLang answers 400 then)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (timeout_s or self.config.weight_update_timeout_s)

        async def one(s: ServerState) -> None:
            while True:
                try:
                    await self._control(s, "POST", "/flush_cache")
                    return
                except EngineError:
                    if loop.time() >= deadline:
                        raise
                await asyncio.sleep(0.2)

        await asyncio.gather(*(one(s) for s in self._in_rotation()))

    @asynccontextmanager
    async def paused(self, *, every_server: bool = False) -> AsyncIterator[None]:
        """Pause generation on the servers in rotation (in-flight requests are aborted and later
        resubmitted by this client; kept with `partial_rollouts`), flush their cache, run the body
        (the update), and always continue generation. New generate() calls wait meanwhile.

        `every_server=True` is for an update that must reach every server (NCCL): servers out of
        rotation are probed at once (they rejoin if healthy and on the current version), and
        `EngineError` names those still out before anything is paused."""
        if every_server:  # before the lock: a returning server's `_resync` takes it
            await self._pool.reprobe([s for s in self._pool.servers if not s.healthy])
        async with self._update_lock:
            if self._released is not None:
                raise EngineError(
                    "weights pushed while the SGLang servers' memory is released: "
                    "call resume_memory() first (the update would write into freed memory)"
                )
            targets = self._in_rotation()
            if every_server:
                self._require_every_server(targets)
            self._update_targets = targets
            self._resumed.clear()
            self._epoch += 1
            try:
                if self.config.partial_rollouts:
                    await self._all("POST", "/pause_generation", {"mode": "retract"})
                    await self._flush_under_retract(targets)
                else:
                    await self._all("POST", "/pause_generation", {"mode": "abort"})
                    await self.flush_cache()
                yield
            finally:
                results = await self._each(
                    self._update_targets, "POST", "/continue_generation", {}, return_exceptions=True
                )
                self._update_targets = None
                self._resumed.set()
                failed = [r for r in results if isinstance(r, BaseException)]
                if failed and sys.exc_info()[0] is None:  # don't hide the body's own error
                    raise failed[0]

    async def _flush_under_retract(self, servers: list[ServerState]) -> None:
        """Flush the cache of servers paused in mode retract, once each (the requests they park
        stay until the update is done, retrying cannot help); see the module docstring."""
        results = await self._each(servers, "POST", "/flush_cache", tolerate=(400,))
        for s, r in zip(servers, results, strict=True):
            if r.status_code == 200 or s.url in self._stale_cache:
                continue
            self._stale_cache.add(s.url)
            log.warning(
                "SGLang server %s cannot flush its prefix cache while a retract pause parks "
                "requests (sgl-project/sglang#33783): prefixes it cached before a weight update "
                "keep the old weights' KV until evicted. Later updates are not reported again.",
                s.url,
            )

    def _update_flushes(self) -> bool:
        """Whether an update call may ask the server to flush its cache: not over requests parked
        by a retract pause (SGLang asserts the flush and its scheduler dies)."""
        return not self.config.partial_rollouts

    async def release_memory(self) -> None:
        """With `release_memory_during_training`: free the weights and KV cache of every server in
        rotation until `resume_memory`; generate() calls wait client-side meanwhile. A no-op
        otherwise. Raises `EngineError` for a server started without --enable-memory-saver."""
        if not self.config.release_memory_during_training:
            return
        async with self._update_lock:
            if self._released is not None:
                raise EngineError("release_memory() called twice without resume_memory()")
            servers = self._in_rotation()
            await self._require_memory_saver(servers)
            self._resumed.clear()
            self._epoch += 1  # what the pause aborts is resubmitted after resume_memory()
            try:
                await self._each(servers, "POST", "/pause_generation", {"mode": "abort"})
                await self._each(
                    servers,
                    "POST",
                    "/release_memory_occupation",
                    {"tags": ["kv_cache", "weights"]},
                    timeout=self.config.weight_update_timeout_s,
                )
            except (
                BaseException
            ):  # let generation go on where it still can; the error says what failed
                await self._each(
                    servers, "POST", "/continue_generation", {}, return_exceptions=True
                )
                self._resumed.set()
                raise
            self._released = servers

    async def resume_memory(self) -> None:
        """Take back what `release_memory` freed: weights, then KV cache, then continue generation
        (the weights are stale until the next push, which the training loop makes next; with
        SGLang's --enable-weights-cpu-backup they are the old ones). A no-op when nothing is
        released."""
        async with self._update_lock:
            servers, self._released = self._released, None
            if servers is None:
                return
            try:
                for tags in (["weights"], ["kv_cache"]):
                    await self._each(
                        servers,
                        "POST",
                        "/resume_memory_occupation",
                        {"tags": tags},
                        timeout=self.config.weight_update_timeout_s,
                    )
                await self._each(servers, "POST", "/continue_generation", {})
            finally:
                self._resumed.set()

    async def _require_memory_saver(self, servers: list[ServerState]) -> None:
        for s in servers:
            if s.url in self._memory_saver:
                continue
            if not (await self._server_info(s)).get("enable_memory_saver"):
                raise EngineError(
                    f"SGLang server {s.url} was started without --enable-memory-saver: with "
                    "release_memory_during_training it would accept the release and free nothing, "
                    "and the learner would run out of memory instead. Restart it with the flag or "
                    "turn release_memory_during_training off."
                )
            self._memory_saver.add(s.url)

    async def update_weights(self, weights: Any, *, version: str) -> None:
        """`Engine` protocol: `weights` must be a directory of safetensors files every server can
        read. An in-memory state dict cannot travel over HTTP: use
        `agentgrpo.engine.weight_sync`."""
        if isinstance(weights, str | os.PathLike):
            await self.update_weights_from_disk(weights, version=version)
            return
        raise TypeError(
            "SGLangEngine.update_weights takes a path to a safetensors directory; for a state "
            "dict use agentgrpo.engine.weight_sync.WeightSync (disk or distributed method)"
        )

    async def update_weights_from_disk(self, path: str | os.PathLike[str], version: str) -> None:
        """Load new weights on every server from `path` (same path on every machine) and set the
        weight version that later completions carry."""
        body = {"model_path": str(Path(path)), "weight_version": str(version), "flush_cache": True}
        async with self.paused():
            await self._all(
                "POST",
                "/update_weights_from_disk",
                {**body, "flush_cache": self._update_flushes()},
                timeout=self.config.weight_update_timeout_s,
            )
        self._weight_version, self._last_disk_update = str(version), body  # replayed unpaused

    async def weight_versions(self) -> dict[str, str | None]:
        """The weight version of each server in rotation, from `/model_info` (`/get_model_info`
        on old servers)."""
        out: dict[str, str | None] = {}
        for s in self._in_rotation():
            r = await self._control(s, "GET", "/model_info", allow_404=True)
            if r is None:
                r = await self._control(s, "GET", "/get_model_info")
            out[s.url] = r.json().get("weight_version")
        return out
