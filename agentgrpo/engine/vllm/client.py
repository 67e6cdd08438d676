"""`VLLMEngine`: a client of vLLM's token-in/token-out route and RL API, for one or many servers.

`POST /inference/v1/generate` takes `token_ids` and answers with the sampled ids, their logprobs
and the weight version of each span of them (`engine/vllm/protocol.py`); no text crosses.
Balancing, failover, clamping to the window and the pause around an update are shared with SGLang
(`engine/pool.py`, `engine/remote.py`). What is vLLM's: `wait_ready()` refuses a server without
dev mode, `--enable-scale-out` or `--logprobs-mode processed_logprobs`; the window is
`max_model_len`; the pause is `/pause` (`abort`, or `keep` with `partial_rollouts`, then a
prefix-cache reset); updates are the `reload_weights` RPC from disk or the weight-transfer API
over NCCL (`nccl.py`); pushes are untied checkpoints on the CPU build; and a reload path that does
not exist is refused before it is sent (it would kill vLLM's engine). docs/rollouts.md and
docs/serving.md have the details.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agentgrpo.engine.base import Completion, EngineError, SamplingParams
from agentgrpo.engine.pool import ServerState, Wire, error_message
from agentgrpo.engine.remote import RemoteEngine
from agentgrpo.engine.vllm.config import VLLMConfig
from agentgrpo.engine.vllm.nccl import VLLMNcclUpdates
from agentgrpo.engine.vllm.protocol import (
    context_length_of,
    generate_body,
    is_context_length_error,
    parse_generate_response,
    score_body,
    score_result,
)

log = logging.getLogger(__name__)

WIRE = Wire(
    name="vLLM",
    generate_path="/inference/v1/generate",
    health_path="/health",
    request_id_key="request_id",
    error_message=error_message,
    is_context_length_error=is_context_length_error,
    not_ready_hint="A server refuses connections until it has loaded the model; check its log for "
    "'Application startup complete' or raise ready_timeout_s.",
)
# What wait_ready() requires of a server's configuration, and the flag that gives it.
_REQUIRED = "--logprobs-mode processed_logprobs"


class VLLMEngine(RemoteEngine, VLLMNcclUpdates):
    """Client of one or more vLLM servers, implementing the `Engine` protocol.

    Example:
        ```python
        engine = VLLMEngine(["http://10.0.0.5:8000", "http://10.0.0.6:8000"])
        await engine.wait_ready()
        c = await engine.generate(prompt_ids, SamplingParams(max_new_tokens=512,
                                                             stop_token_ids=(151645,)))
        c.token_ids, c.logprobs, c.finish_reason, c.weight_version
        await engine.update_weights_from_disk("/nfs/ckpt/step_10", version="10")
        await engine.aclose()
        ```

    `api_key` (or the variable named by `VLLMConfig.api_key_env` with `from_config`) is sent as
    `Authorization: Bearer`. Other keyword arguments are `VLLMConfig` fields.
    """

    _window_slack = 0  # vLLM admits prompt + max_tokens == max_model_len
    # Pushed checkpoints carry a tied output projection as a tensor of its own (WeightSync): on the
    # CPU the server runs an untied copy (`VLLMServer`), whose projection a reload does rebuild.
    untied_checkpoints = True

    def __init__(self, urls: Sequence[str], *, api_key: str | None = None, **settings: Any) -> None:
        config = VLLMConfig(urls=list(urls), **settings)
        super().__init__(config, api_key, WIRE)
        self.config: VLLMConfig = config

    # -- readiness ---------------------------------------------------------------------------

    async def wait_ready(self, timeout_s: float | None = None, *, seeded: bool = False) -> None:
        """Wait until every server answers 200 on `/health`, then check its configuration (see
        the module docstring) and read its context window and parallel size. vLLM honours
        per-request seeds, so `seeded` needs nothing more. Raises `EngineError` naming each
        server that was not ready or is not configured for RL."""
        await self._pool.wait_ready(timeout_s)
        for s in self._pool.servers:
            await self._read_server_info(s)

    async def _read_server_info(self, s: ServerState) -> None:
        r = await self._control(s, "GET", "/server_info?config_format=json", allow_404=True)
        if r is None:
            raise EngineError(
                f"vLLM server {s.url} has no /server_info: start it with VLLM_SERVER_DEV_MODE=1 "
                "(the RL API, weight updates included, exists only in dev mode)"
            )
        info = r.json()
        cfg = info.get("vllm_config") or {}
        model, parallel = cfg.get("model_config") or {}, cfg.get("parallel_config") or {}
        if model.get("logprobs_mode") != "processed_logprobs":
            raise EngineError(
                f"vLLM server {s.url} returns {model.get('logprobs_mode')} logprobs: restart it "
                f"with {_REQUIRED} (the logprobs of the distribution it samples from, which the "
                "rollouts record)"
            )
        s.version = (info.get("system_env") or {}).get("vllm_version")
        s.tp_size = int(parallel.get("tensor_parallel_size") or 1) * int(
            parallel.get("pipeline_parallel_size") or 1
        )
        s.dp_size = int(parallel.get("data_parallel_size") or 1)
        self._learn_context_length(model.get("max_model_len"))
        await self._check_route(s)
        log.info(
            "vLLM server %s: version %s, parallel size %s, max_model_len %s",
            s.url,
            s.version,
            s.tp_size,
            model.get("max_model_len"),
        )

    async def _check_route(self, s: ServerState) -> None:
        """One token through the generate route: vLLM answers 403 until `--enable-scale-out`."""
        body = generate_body([0], SamplingParams(max_new_tokens=1, temperature=0.0), 1)
        r = await self._control(s, "POST", WIRE.generate_path, body, tolerate=(403,))
        if r.status_code == 403:
            raise EngineError(
                f"vLLM server {s.url} refuses {WIRE.generate_path} "
                f"({error_message(r.content)}): start it with --enable-scale-out, or check the "
                "API key"
            )

    # -- generation and scoring --------------------------------------------------------------

    async def _send(
        self, prompt_ids: list[int], params: SamplingParams, max_new: int
    ) -> Completion:
        body = generate_body(prompt_ids, params, max_new)
        raw = await self._pool.post_generate(body, session_id=params.session_id)
        return parse_generate_response(raw, weight_version=self._weight_version)

    def _context_length_of(self, message: str) -> int | None:
        return context_length_of(message)

    def _score_body(
        self, prompt_ids: list[int], completion_ids: list[int], temperature: float
    ) -> dict[str, Any]:
        return score_body(prompt_ids, completion_ids, temperature)

    def _score_result(self, raw: dict[str, Any], body: dict[str, Any], start: int) -> list[float]:
        return score_result(raw, body, start)

    # -- weight updates ----------------------------------------------------------------------

    async def _pause(self, servers: list[ServerState]) -> None:
        mode = "keep" if self.config.partial_rollouts else "abort"  # abort also drops the cache
        await self._each(servers, "POST", f"/pause?mode={mode}")

    async def _continue(self, servers: list[ServerState]) -> list[Any]:
        """With partial rollouts, drop every cached KV first: the kept requests are preempted and
        recompute theirs under the new weights (mode keep leaves the cache alone)."""
        reset: list[Any] = [None] * len(servers)
        if self.config.partial_rollouts:
            path = "/reset_prefix_cache?reset_running_requests=true"
            reset = await self._each(servers, "POST", path, return_exceptions=True)
        resumed = await self._each(servers, "POST", "/resume", return_exceptions=True)
        return [r if isinstance(r, BaseException) else m for r, m in zip(reset, resumed)]

    async def _server_weight_version(self, s: ServerState) -> str | None:
        return (await self._control(s, "GET", "/weight_info")).json().get("weight_version")

    async def _reload(self, servers: Sequence[ServerState], path: str, version: str) -> None:
        """`reload_weights` from `path`, then the version label, on each of `servers`."""
        rpc = {"method": "reload_weights", "kwargs": {"weights_path": path}}
        timeout = self.config.weight_update_timeout_s
        await self._each(servers, "POST", "/collective_rpc", rpc, timeout=timeout)
        await self._each(servers, "POST", "/update_weight_version", {"new_version": version})

    async def _replay(self, s: ServerState) -> None:
        await self._reload([s], self._last_disk_update, str(self._weight_version))

    async def update_weights_from_disk(self, path: str | os.PathLike[str], version: str) -> None:
        """Load new weights on every server from `path` (a directory with the safetensors files
        and config.json, the same path on every machine) and set the weight version that later
        completions carry."""
        path = str(Path(path).absolute())
        if not (Path(path) / "config.json").is_file():
            raise EngineError(
                f"{path} has no config.json: not a checkpoint directory vLLM can reload from (a "
                "reload from a missing directory leaves a vLLM server dead)"
            )
        async with self.paused():
            await self._reload(self._in_rotation(), path, str(version))
        self._weight_version, self._last_disk_update = str(version), path
