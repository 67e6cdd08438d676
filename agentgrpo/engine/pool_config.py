"""`PoolConfig`: the settings every client of inference servers shares (which servers, deadlines,
retries, balancing, health), apart from the clients so that loading a run config imports neither
httpx nor aiohttp. `SGLangConfig` and `VLLMConfig` add what is their engine's own."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator


class PoolConfig(BaseModel):
    """Servers, deadlines, retries, balancing and health of a pool of inference servers."""

    model_config = ConfigDict(extra="forbid")

    urls: list[str] = Field(
        min_length=1, description="Base URLs of the servers, e.g. http://10.0.0.5:30000."
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
        900.0, gt=0, description="How long wait_ready() waits for the servers (model loading)."
    )
    ready_poll_s: float = Field(2.0, gt=0, description="Poll interval of wait_ready().")
    weight_update_timeout_s: float = Field(
        1800.0, gt=0, description="Deadline of one weight-update HTTP call (disk load, broadcast)."
    )

    @field_validator("urls")
    @classmethod
    def _strip_urls(cls, urls: list[str]) -> list[str]:
        out = [u.rstrip("/") for u in urls]
        for u in out:
            if not u.startswith(("http://", "https://")):
                raise ValueError(f"server url must start with http:// or https://, got {u!r}")
        if len(set(out)) != len(out):
            raise ValueError(f"duplicate server urls: {out}")
        return out
