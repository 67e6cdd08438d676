"""The `python` tool: the model runs a program in the sandbox and reads what it printed.

    from tools.python import python, make_python_tool, make_async_python_tool
    python("print(2**10)")                 # 'status: ok (exit 0, 0.01 s)\\nstdout:\\n1024\\n'
    tool = make_python_tool(Sandbox(url=...), PythonToolConfig(max_output_chars=2000))

Each call is a fresh process in a fresh sandbox (no state carries over between calls: a model
that needs state must re-run its setup). The message never exceeds `max_output_chars`: stdout and
stderr are shown head and tail, cut in the middle with a marker saying how much was cut (the
marker counts); a short stream is shown whole and the long one gets the rest of the room.
A sandbox failure (after the sandbox's own retries) raises `SandboxUnavailable`: that episode
is unscorable, which is not the model's fault and must not read as a tool error it caused.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from pydantic import BaseModel, ConfigDict, Field

from agentgrpo.verify.sandbox import (
    ExecResult,
    Limits,
    Sandbox,
    SandboxUnavailable,
    adefault_sandbox,
    check_sandbox,
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
    """`text` in at most `budget` characters: head and tail around a marker saying how much was cut
    (the marker counts against the budget; a budget too small for it keeps only the head)."""
    if len(text) <= budget:
        return text
    longest_marker = len(f"\n... [{len(text)} characters cut] ...\n")  # the count has fewer digits
    keep = budget - longest_marker
    if keep < 10:
        return text[:budget]
    head = keep * 2 // 3
    tail = keep - head
    return f"{text[:head]}\n... [{len(text) - keep} characters cut] ...\n{text[len(text) - tail :]}"


_MAX_STATUS_CHARS = 120  # the status line (an unknown status shows the sandbox's detail)


def format_result(res: ExecResult, max_chars: int) -> str:
    """The tool message: status line, then stdout and stderr (only those that are not empty), in at
    most `max_chars` characters. When the streams do not fit, each is cut in the middle
    (`_clip`); the shorter one keeps up to half of the room and the longer gets the rest."""
    how = {
        "ok": f"exit 0, {res.wall_s:.2f} s",
        "runtime_error": f"exit {res.exit_code}",
        "timeout": f"killed after {res.wall_s:.1f} s",
        "memory_limit": "out of memory",
        "output_limit": "killed: too much output",
        "signaled": f"killed by signal {res.signal}",
    }.get(res.status, res.detail)
    status = f"status: {res.status} ({how})"
    if len(status) > _MAX_STATUS_CHARS:
        status = status[: _MAX_STATUS_CHARS - 4] + "...)"
    streams = [
        (n, t.rstrip("\n"))
        for n, t in (("stdout", res.stdout), ("stderr", res.stderr))
        if t.strip()
    ]
    trailer = ["(output was cut at the sandbox's limit)"] if res.truncated else []
    # every part is followed by one newline (the joins and the final one)
    fixed = len(status) + 1 + sum(len(t) + 1 for t in trailer)
    room = max(max_chars - fixed - sum(len(f"{n}:\n") + 1 for n, _ in streams), 0)
    shares = [len(t) for _, t in streams]
    if sum(shares) > room:
        if len(streams) == 1:
            shares = [room]
        else:
            short = min(range(2), key=lambda i: shares[i])
            shares[short] = min(shares[short], room // 2)
            shares[1 - short] = room - shares[short]
    parts = [
        status,
        *(f"{n}:\n{_clip(t, share)}" for (n, t), share in zip(streams, shares, strict=True)),
    ]
    return "\n".join(parts + trailer) + "\n"


_DOC = """Run a Python 3 program in a fresh, isolated sandbox and return its output.

Nothing persists between calls, there is no network, and only the standard library is available.
Use print() to show results.

Args:
    code: the complete program to run.
"""


def _message(res: ExecResult, cfg: PythonToolConfig) -> str:
    if res.status == "sandbox_error":
        raise SandboxUnavailable(f"sandbox unavailable: {res.detail}")
    return format_result(res, cfg.max_output_chars)


def make_python_tool(
    sandbox: Sandbox | None = None, config: PythonToolConfig | None = None
) -> Callable[[str], str]:
    """A `python(code) -> str` tool bound to a sandbox (default: the process-wide one). A ToolEnv
    runs it in a worker thread, and a call past its deadline runs on to the sandbox's wall limit;
    `make_async_python_tool` does neither."""
    check_sandbox(sandbox, "make_python_tool", "run")
    cfg = config or PythonToolConfig()

    def python(code: str) -> str:
        return _message((sandbox or default_sandbox()).run(code, limits=cfg.limits), cfg)

    python.__doc__ = _DOC
    return python


def make_async_python_tool(
    sandbox: Sandbox | None = None, config: PythonToolConfig | None = None
) -> Callable[[str], Awaitable[str]]:
    """The same tool as a coroutine function: no worker thread per call, and a call cancelled at
    its deadline kills its job (a remote server's once it sees the connection close), so the slot
    is free for the next call at once."""
    check_sandbox(sandbox, "make_async_python_tool", "arun")
    cfg = config or PythonToolConfig()

    async def python(code: str) -> str:
        sb = sandbox or await adefault_sandbox()
        return _message(await sb.arun(code, limits=cfg.limits), cfg)

    python.__doc__ = _DOC
    return python


python = make_python_tool()
