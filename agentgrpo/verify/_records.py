"""The records every sandbox backend shares: the limits a job runs under and the result it returns.

Separate from `sandbox.py` so that the `Sandbox` facade and its two clients (`_local_client.py`,
`_remote_client.py`) can all build them without importing one another. `sandbox.py` re-exports
every name here; callers import them from there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Status = Literal[
    "ok", "runtime_error", "timeout", "memory_limit", "output_limit", "signaled", "sandbox_error"
]
STATUSES: tuple[str, ...] = Status.__args__  # type: ignore[attr-defined]


class Limits(BaseModel):
    """Per-job resource limits (validated; all bounded so one job cannot starve the host)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    wall_s: float = Field(5.0, gt=0, le=3600, description="wall-clock limit of the whole job")
    memory_mb: int = Field(256, ge=16, le=1 << 20, description="memory of all the job's processes")
    processes: int = Field(64, ge=1, le=4096, description="processes and threads the job may hold")
    disk_mb: int = Field(64, ge=1, le=1 << 16, description="size of the job's /tmp (its cwd)")
    output_bytes: int = Field(
        1 << 20, ge=0, le=1 << 30, description="bytes kept of stdout and of stderr each"
    )
    open_files: int = Field(256, ge=16, le=65536, description="file descriptors per process")


@dataclass(frozen=True)
class ExecResult:
    """What happened to one job. `exit_code` is set when it exited, `signal` when a signal ended
    it."""

    status: Status
    exit_code: int | None
    signal: int | None
    stdout: str
    stderr: str
    truncated: bool
    wall_s: float
    backend: str
    detail: str = ""  # why, for sandbox_error / memory_limit / timeout; empty when ok
    cpu_s: float | None = None
    max_rss_mb: float | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def sandbox_error(detail: str, backend: str, wall_s: float = 0.0) -> ExecResult:
    return ExecResult("sandbox_error", None, None, "", "", False, wall_s, backend, detail)
