"""The `python` tool: the model runs a program in the sandbox and reads what it printed.

    from tools.python import python, make_python_tool
    python("print(2**10)")                 # 'status: ok (exit 0, 0.01 s)\\nstdout:\\n1024\\n'
    tool = make_python_tool(Sandbox(url=...), PythonToolConfig(max_output_chars=2000))

Each call is a fresh process in a fresh sandbox (no state carries over between calls: a model
that needs state must re-run its setup). The message is bounded: stdout and stderr are shown
head and tail, cut in the middle to `max_output_chars` with a marker saying how much was cut.
A sandbox failure (after the sandbox's own retries) raises `SandboxUnavailable`: that episode
is unscorable, which is not the model's fault and must not read as a tool error it caused.
"""

from __future__ import annotations

from collections.abc import Callable

from pydantic import BaseModel, ConfigDict, Field

from agentgrpo.verify.sandbox import (
    ExecResult,
    Limits,
    Sandbox,
    SandboxUnavailable,
    default_sandbox,
)


class PythonToolConfig(BaseModel):
    """Limits and message size of the python tool."""

    model_config = ConfigDict(extra="forbid")

    limits: Limits = Field(
        default_factory=lambda: Limits(wall_s=10.0, memory_mb=512, output_bytes=1 << 16),
        description="sandbox limits of one call",
    )
    max_output_chars: int = Field(4000, ge=200, description="size bound of the returned message")


def _clip(text: str, budget: int) -> str:
    if len(text) <= budget:
        return text
    head = budget * 2 // 3
    tail = budget - head
    return f"{text[:head]}\n... [{len(text) - budget} characters cut] ...\n{text[-tail:]}"


def format_result(res: ExecResult, max_chars: int) -> str:
    """The tool message: status line, then stdout and stderr (only those that are not empty)."""
    how = {
        "ok": f"exit 0, {res.wall_s:.2f} s",
        "runtime_error": f"exit {res.exit_code}",
        "timeout": f"killed after {res.wall_s:.1f} s",
        "memory_limit": "out of memory",
        "output_limit": "killed: too much output",
        "signaled": f"killed by signal {res.signal}",
    }.get(res.status, res.detail)
    parts = [f"status: {res.status} ({how})"]
    streams = [
        (n, t.rstrip("\n"))
        for n, t in (("stdout", res.stdout), ("stderr", res.stderr))
        if t.strip()
    ]
    budget = max(max_chars - len(parts[0]) - 40, 100)
    for name, text in streams:
        share = budget // len(streams) if len(streams) > 1 and len(text) > budget // 2 else budget
        parts.append(f"{name}:\n{_clip(text, share)}")
        budget -= min(len(text), share)
    if res.truncated:
        parts.append("(output was cut at the sandbox's limit)")
    return "\n".join(parts) + "\n"


def make_python_tool(
    sandbox: Sandbox | None = None, config: PythonToolConfig | None = None
) -> Callable[[str], str]:
    """A `python(code) -> str` tool bound to a sandbox (default: the process-wide one)."""
    cfg = config or PythonToolConfig()

    def python(code: str) -> str:
        """Run a Python 3 program in a fresh, isolated sandbox and return its output.

        Nothing persists between calls, there is no network, and only the standard library is
        available. Use print() to show results.

        Args:
            code: the complete program to run.
        """
        res = (sandbox or default_sandbox()).run(code, limits=cfg.limits)
        if res.status == "sandbox_error":
            raise SandboxUnavailable(f"sandbox unavailable: {res.detail}")
        return format_result(res, cfg.max_output_chars)

    return python


python = make_python_tool()
