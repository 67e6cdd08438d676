"""`VLLMConfig`: the settings of `VLLMEngine`, apart from the client so that loading a run config
does not import httpx. The pool's settings are `PoolConfig`'s, shared with SGLang."""

from __future__ import annotations

from pydantic import Field

from agentgrpo.engine.pool_config import PoolConfig


class VLLMConfig(PoolConfig):
    """Settings of `VLLMEngine` (the `engine:` block of a run config when `kind: vllm`)."""

    api_key_env: str | None = Field(
        "VLLM_API_KEY",
        description="Name of the environment variable holding the servers' --api-key. The key "
        "itself never goes into a config file; unset variable = no Authorization header.",
    )
    context_length: int | None = Field(
        None,
        gt=1,
        description="The servers' context window (vLLM's --max-model-len); max_new_tokens is "
        "clamped so that prompt + max_new_tokens <= context_length. Unset = read from the "
        "servers' /v1/models at wait_ready(), else learned from the first context-length 400.",
    )
    partial_rollouts: bool = Field(
        False,
        description="Weight pushes keep the requests in flight (partial rollouts): vLLM's pause "
        "mode 'keep' instead of 'abort', update, drop every cached KV (the kept requests "
        "recompute theirs under the new weights), resume; the server reports which weight "
        "version sampled which of a request's tokens (Completion.version_runs). Off: a push "
        "aborts the requests in flight and sends them again under the new weights.",
    )
