"""`SGLangEngine`: a client of SGLang's native `/generate` API, for one or many servers.

Token in, token out: it sends `input_ids` and reads the sampled ids and their logprobs from
`meta_info.output_token_logprobs`, with exactly the RL sampling settings of docs/serving.md (an
unknown `sampling_params` key is a 500). Balancing and failover are `engine/pool.py`'s; clamping
to the context window, resubmitting and the pause around an update are `engine/remote.py`'s.
This module holds what is SGLang's: the context window from `/server_info` or its 400, the pause
modes (`abort`, or `retract` with `partial_rollouts`, whose streamed chunks carry the weight
version of their tokens: `StreamFold`), the cache flush after a retract pause (stock SGLang
cannot flush inside the update then: sgl-project/sglang#33783), releasing the servers' memory
while the learner trains (refused without `--enable-memory-saver`), and the update calls from disk
or over NCCL. docs/rollouts.md (rollouts on SGLang, partial rollouts), docs/many-gpus.md (memory)
and docs/serving.md (the server side) have the details.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agentgrpo.engine.base import Completion, EngineError, SamplingParams
from agentgrpo.engine.pool import ServerState, Wire
from agentgrpo.engine.remote import RemoteEngine
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

WIRE = Wire(
    name="SGLang",
    generate_path="/generate",
    health_path="/health_generate",
    request_id_key="rid",
    error_message=error_message,
    is_context_length_error=is_context_length_error,
    not_ready_hint="A server answers 503 while it loads the model and refuses connections before "
    "it binds; check its log for 'The server is fired up and ready to roll!' or raise "
    "ready_timeout_s.",
    new_stream=StreamFold,
)


class SGLangEngine(RemoteEngine, NcclUpdates):
    """Client of one or more SGLang servers, implementing the `Engine` protocol.

    Example:
        ```python
        engine = SGLangEngine(["http://10.0.0.5:30000", "http://10.0.0.6:30000"])
        await engine.wait_ready()
        c = await engine.generate(prompt_ids, SamplingParams(max_new_tokens=512,
                                                             stop_token_ids=(151645,)))
        c.token_ids, c.logprobs, c.finish_reason, c.weight_version
        await engine.update_weights_from_disk("/nfs/ckpt/step_10", version="10")
        await engine.aclose()
        ```

    `api_key` (or the variable named by `SGLangConfig.api_key_env` with `from_config`) is sent as
    `Authorization: Bearer`. Other keyword arguments are `SGLangConfig` fields.
    """

    _window_slack = 1  # SGLang refuses prompt + max_new_tokens >= context_length

    def __init__(self, urls: Sequence[str], *, api_key: str | None = None, **settings: Any) -> None:
        config = SGLangConfig(urls=list(urls), **settings)
        super().__init__(config, api_key, WIRE)
        self.config: SGLangConfig = config
        self._memory_saver: set[str] = set()  # urls seen with --enable-memory-saver
        self._stale_cache: set[str] = set()  # urls that could not flush under a retract pause

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

    # -- generation --------------------------------------------------------------------------

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
        """Sample a completion of `prompt_ids` on the least loaded healthy server.

        `max_new_tokens` is clamped to the servers' context window (see the module docstring).
        """
        if params.seed is not None:
            self._check_seed_support()
        return await super().generate(prompt_ids, params)

    async def _send(
        self, prompt_ids: list[int], params: SamplingParams, max_new: int
    ) -> Completion:
        stream = self.config.partial_rollouts  # the version of every chunk, see above
        body: dict[str, Any] = {
            "rid": "",
            "input_ids": prompt_ids,
            "sampling_params": sampling_body(params, max_new),
            "return_logprob": True,
            "logprob_start_len": -1,
            "stream": stream,
        }
        sid = params.session_id  # sticky routing (engine/pool.py); never sent to SGLang
        if not stream:
            raw = await self._pool.post_generate(body, session_id=sid)
            return parse_generate_output(raw, weight_version=self._weight_version)
        fold = await self._pool.post_generate_stream(body, session_id=sid)
        assert isinstance(fold, StreamFold)
        c = parse_generate_output(fold.output(), weight_version=self._weight_version)
        if len(runs := fold.version_runs(self._weight_version)) > 1:
            c.version_runs = runs
        return c

    def _context_length_of(self, message: str) -> int | None:
        return context_length_of(message)

    # At temperature 1 every SGLang version returns plain log_softmax(logits) as prompt logprobs;
    # other temperatures depend on the server version.
    def _score_body(
        self, prompt_ids: list[int], completion_ids: list[int], temperature: float
    ) -> dict[str, Any]:
        return {**score_body(prompt_ids, completion_ids, temperature), "rid": ""}

    def _score_result(self, raw: dict[str, Any], body: dict[str, Any], start: int) -> list[float]:
        return score_result(raw, body)  # the body's logprob_start_len says where

    def _check_seed_support(self) -> None:
        for s in self._pool.servers:
            if s.version is not None and _version_tuple(s.version) < (0, 5, 9):
                raise EngineError(
                    f"SamplingParams.seed needs SGLang >= 0.5.9 (sampling_seed); {s.url} runs "
                    f"{s.version}. Use seed=None with this server."
                )

    # -- control and weight updates ----------------------------------------------------------

    async def _server_weight_version(self, s: ServerState) -> str | None:
        r = await self._control(s, "GET", "/model_info", allow_404=True)
        if r is None:  # old servers only have /get_model_info
            r = await self._control(s, "GET", "/get_model_info")
        return r.json().get("weight_version")

    async def _replay(self, s: ServerState) -> None:
        await self._control(
            s,
            "POST",
            "/update_weights_from_disk",
            self._last_disk_update,
            timeout=self.config.weight_update_timeout_s,
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

    async def _pause(self, servers: list[ServerState]) -> None:
        """SGLang's pause: mode retract with partial rollouts (the requests stay), else abort (this
        client sends them again); then flush the prefix cache (see the module docstring)."""
        if self.config.partial_rollouts:
            await self._each(servers, "POST", "/pause_generation", {"mode": "retract"})
            await self._flush_under_retract(servers)
        else:
            await self._each(servers, "POST", "/pause_generation", {"mode": "abort"})
            await self.flush_cache()

    async def _continue(self, servers: list[ServerState]) -> list[Any]:
        return await self._each(servers, "POST", "/continue_generation", {}, return_exceptions=True)

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
