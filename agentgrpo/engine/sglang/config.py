"""`SGLangConfig`: the settings of `SGLangEngine`, apart from the client so that loading a run
config does not import httpx and the client's machinery. The pool's settings (servers, deadlines,
retries, balancing, health) are `PoolConfig`'s, shared with vLLM."""

from __future__ import annotations

from pydantic import Field, model_validator

from agentgrpo.engine.pool_config import PoolConfig


class SGLangConfig(PoolConfig):
    """Settings of `SGLangEngine` (the `engine:` block of a run config when `kind: sglang`)."""

    api_key_env: str | None = Field(
        "SGLANG_API_KEY",
        description="Name of the environment variable holding the servers' --api-key. The key "
        "itself never goes into a config file; unset variable = no Authorization header.",
    )
    context_length: int | None = Field(
        None,
        gt=1,
        description="The servers' context window; max_new_tokens is clamped so that "
        "prompt + max_new_tokens < context_length. Unset = learned from the servers (/server_info "
        "when launched with --context-length, else the first context-length 400, which names it).",
    )
    release_memory_during_training: bool = Field(
        False,
        description="The servers share GPUs with the learner: they free their weights and KV cache "
        "while the learner trains and take them back before each weight push. Needs SGLang's "
        "--enable-memory-saver (checked); not with train.max_staleness >= 1.",
    )
    partial_rollouts: bool = Field(
        False,
        description="Weight pushes keep the requests in flight (partial rollouts): pause with "
        "SGLang's mode 'retract' instead of aborting, update, continue; a request that ran across "
        "the push says which of its tokens each version sampled (Completion.version_runs). "
        "Requests are streamed to learn that split: start the servers with "
        "--incremental-streaming-output, else every chunk repeats the whole output so far. Needs "
        "SGLang >= 0.5.6. Off: a push aborts the requests in flight and sends them again under "
        "the new weights.",
    )

    @model_validator(mode="after")
    def _partial_needs_live_servers(self) -> SGLangConfig:
        if self.partial_rollouts and self.release_memory_during_training:
            raise ValueError(
                "partial_rollouts keeps requests running across a weight push, but "
                "release_memory_during_training frees the servers' memory while the learner "
                "trains, which needs them idle: choose one"
            )
        return self
