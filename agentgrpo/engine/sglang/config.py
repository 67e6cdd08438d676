"""`SGLangConfig`: the settings of `SGLangEngine`, apart from the client so that loading a run
config does not import httpx and the client's machinery."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class SGLangConfig(BaseModel):
    """Settings of `SGLangEngine` (the `engine:` block of a run config when `kind: sglang`)."""

    model_config = ConfigDict(extra="forbid")

    urls: list[str] = Field(
        min_length=1, description="Base URLs of the SGLang servers, e.g. http://10.0.0.5:30000."
    )
    api_key_env: str | None = Field(
        "SGLANG_API_KEY",
        description="Name of the environment variable holding the servers' --api-key. The key "
        "itself never goes into a config file; unset variable = no Authorization header.",
    )
    request_timeout_s: float = Field(
        900.0, gt=0, description="Deadline of one generate() call, retries and backoff included."
    )
    connect_timeout_s: float = Field(10.0, gt=0, description="TCP connect timeout per attempt.")
    max_retries: int = Field(
        6,
        ge=0,
        description="Retries of one request after transport errors / 5xx (within the deadline).",
    )
    backoff_initial_s: float = Field(0.2, ge=0, description="First retry delay; doubles per retry.")
    backoff_max_s: float = Field(10.0, ge=0, description="Upper bound of one retry delay.")
    max_inflight_per_server: int = Field(
        256, ge=1, description="Requests in flight per server; more callers wait for a free slot."
    )
    max_sticky_sessions: int = Field(
        100_000,
        ge=0,
        description="Sticky routing: every request of an episode (SamplingParams.session_id) goes "
        "to the server of its first request while that server is healthy, where its prefix cache "
        "holds the episode. The client remembers this many sessions, the least recently used "
        "forgotten first; 0 = no sticky routing (each request to the least loaded server).",
    )
    probe_interval_s: float = Field(
        5.0, gt=0, description="Longest wait between two health probes of a server taken out."
    )
    ready_timeout_s: float = Field(
        900.0, gt=0, description="How long wait_ready() waits for /health_generate (model loading)."
    )
    ready_poll_s: float = Field(2.0, gt=0, description="Poll interval of wait_ready().")
    context_length: int | None = Field(
        None,
        gt=1,
        description="The servers' context window; max_new_tokens is clamped so that "
        "prompt + max_new_tokens < context_length. Unset = learned from the servers (/server_info "
        "when launched with --context-length, else the first context-length 400, which names it).",
    )
    weight_update_timeout_s: float = Field(
        1800.0, gt=0, description="Deadline of one weight-update HTTP call (disk load, broadcast)."
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

    @field_validator("urls")
    @classmethod
    def _strip_urls(cls, urls: list[str]) -> list[str]:
        out = [u.rstrip("/") for u in urls]
        for u in out:
            if not u.startswith(("http://", "https://")):
                raise ValueError(f"SGLang url must start with http:// or https://, got {u!r}")
        if len(set(out)) != len(out):
            raise ValueError(f"duplicate SGLang urls: {out}")
        return out
