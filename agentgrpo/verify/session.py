"""Sandbox sessions: one episode's workspace and long-lived sandboxed processes.

    ws = await sandbox.session(workspace)        # a fork of the task's prepared workspace
    res = await ws.run("python -m pytest -q")    # one bash: cwd, variables, background jobs persist
    res = await ws.python("x = 41\\nx + 1")       # one Python REPL: its names persist
    await ws.close()                             # with the episode: nothing of it survives

A session is a jail of its own (`_session_init.py`) with the one-shot jobs' isolation, /workspace
and /tmp kept for the episode; `_session_client.py` starts it and carries its calls. Budgets are
per call (`call_timeout_s`, `output_bytes`) and per episode (`episode_s`, `max_calls`: past them
a call raises `SessionBudgetExceeded`, a `ToolError` the model reads). A session that dies or
hangs raises `SessionError`, an `InfrastructureError`: the episode is unscorable. docs/sandbox.md
has the API, the limits and the threat model of sessions.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from agentgrpo.env.tool import ToolError
from agentgrpo.verify import _frames
from agentgrpo.verify._records import ExecResult
from agentgrpo.verify._session_client import (  # SessionError: re-exported
    _MARGIN_S,
    SessionError,
    _child_of,
    _Conn,
    _handshake,
    _init_limits,
    _launch,
    _session_env,
)

_VERIFY_DIR = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(_VERIFY_DIR, "_tree.py")) as _f:
    _TREE_SOURCE = _f.read()
_WRITE = r"""set -e
p=$1
case $p in */*) d=${p%/*};; *) d=.;; esac
mkdir -p -- "$d"
t=$(mktemp -- "$d/.agentgrpo-write.XXXXXX")
cat > "$t"
if [ -x "$p" ]; then chmod 755 "$t"; else chmod 644 "$t"; fi
mv -f -- "$t" "$p"
"""


class SessionBudgetExceeded(ToolError):
    """The episode's budget of calls or seconds is spent; the model reads this as a tool error."""


class SessionFileError(ToolError):
    """`read` or `write` failed (no such file, a directory, a full disk): told to the model."""


class SessionLimits(BaseModel):
    """What one session may use: per call, and for the whole episode."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    call_timeout_s: float = Field(
        60.0, gt=0, le=3600, description="wall-clock limit of one call (command, code, program)"
    )
    output_bytes: int = Field(
        1 << 16, ge=0, le=1 << 26, description="bytes kept of a call's output (per stream)"
    )
    episode_s: float = Field(
        1800.0, gt=0, description="wall-clock seconds of all calls of the episode together"
    )
    max_calls: int = Field(1000, ge=1, description="calls in one episode")
    memory_mb: int = Field(
        1024, ge=16, le=1 << 20, description="memory of all the session's processes (cgroup)"
    )
    processes: int = Field(
        256, ge=4, le=4096, description="processes and threads the session holds at once"
    )
    disk_mb: int = Field(
        512, ge=1, le=1 << 16, description="size of the workspace's writes, and of /tmp, each"
    )
    open_files: int = Field(1024, ge=16, le=65536, description="file descriptors per process")


@dataclass(frozen=True)
class WorkspaceMount:
    """What the session's /workspace is: an overlay on a prepared tree (`lower`), a bind of a
    fork directory, or an empty tmpfs of its own."""

    kind: Literal["overlay", "bind", "empty"]
    path: str = ""


class Session:
    """One episode's sandbox: a workspace and long-lived processes (see the module docstring).

    Made by `Sandbox.session`; every method may be awaited from any event loop or thread.
    `workspace_checksum` is the checksum of the prepared workspace it forked (`None` for an empty
    one): every session of a group that shows the same value started from the same bytes.
    """

    def __init__(
        self,
        conn: _Conn,
        *,
        limits: SessionLimits,
        python: str,
        init_pid: int | None,
        workspace_checksum: str | None,
        fork: str,
        on_close: Callable[[], None] | None,
    ) -> None:
        self._conn, self.limits, self._python = conn, limits, python
        self.init_pid, self.workspace_checksum, self.fork = init_pid, workspace_checksum, fork
        self.backend = conn.backend
        self._on_close = on_close
        self.calls, self.spent_s = 0, 0.0
        try:  # read now: once the init has exited its pid may name another process
            self._pid_ns: str | None = os.readlink(f"/proc/{init_pid}/ns/pid")
        except (OSError, TypeError):
            self._pid_ns = None
        self.closed = False
        self._close_lock = threading.Lock()

    # ---- starting ------------------------------------------------------------------------------

    @classmethod
    def start(
        cls,
        *,
        backend: str,
        python: str,
        ro_paths: Sequence[str],
        uid: int,
        mount: WorkspaceMount,
        limits: SessionLimits,
        workspace_checksum: str | None = None,
        fork: str = "empty",
        env: dict[str, str] | None = None,
        on_close: Callable[[], None] | None = None,
        start_timeout_s: float = 60.0,
    ) -> Session:
        """Start the session's jail and wait until it answers (blocking; `Sandbox.session` runs
        it in a worker thread). `backend`: namespaces or bwrap (which takes a "bind" or "empty"
        mount only). Raises SessionError when it does not come up."""
        if backend not in ("namespaces", "bwrap") or (
            backend == "bwrap" and mount.kind == "overlay"
        ):
            raise SessionError(
                f"sessions run under the namespaces or bwrap backend (overlay forks under "
                f"namespaces only); asked for {backend!r} with a {mount.kind} workspace"
            )
        cfg = {
            "python": python,
            "ro_paths": list(ro_paths),
            "uid": uid,
            "workspace": {"kind": mount.kind, "path": mount.path, "lower": mount.path},
            "limits": _init_limits(limits),
            "env": _session_env(python) | (env or {}),
        }
        proc, ours = _launch(backend, python, ro_paths, mount, limits, cfg)
        host = _handshake(proc, ours, backend, start_timeout_s)
        ours.settimeout(0.25)  # the reader's polling interval for call deadlines
        conn = _Conn(proc, ours, backend)
        conn.reader.start()
        return cls(
            conn,
            limits=limits,
            python=python,
            init_pid=host.get("init_pid") or _child_of(proc.pid),
            workspace_checksum=workspace_checksum,
            fork=fork,
            on_close=on_close,
        )

    @property
    def interpreter(self) -> str:
        """The session's interpreter (the sandbox's base Python), as a path inside the jail."""
        return self._python

    # ---- calls ---------------------------------------------------------------------------------

    def _budget(self, timeout_s: float | None) -> float:
        """This call's time limit, within what the episode has left; raises when it is spent."""
        lim = self.limits
        if self.closed:
            raise SessionError("the session is closed")
        left = lim.episode_s - self.spent_s
        if self.calls >= lim.max_calls or left <= 0:
            raise SessionBudgetExceeded(
                f"the episode's sandbox budget is spent ({self.calls} calls, {self.spent_s:.1f} s "
                f"of {lim.max_calls} calls and {lim.episode_s:g} s)"
            )
        return min(timeout_s or lim.call_timeout_s, lim.call_timeout_s, left)

    async def _call_raw(
        self,
        op: str,
        blobs: list[bytes],
        timeout_s: float | None,
        output_bytes: int | None = None,
        **extra: object,
    ) -> tuple[dict, list[bytes]]:
        budget = self._budget(timeout_s)
        header = {
            "op": op,
            "timeout_s": budget,
            "output_bytes": self.limits.output_bytes if output_bytes is None else output_bytes,
            **extra,
        }
        self.calls += 1
        jid, fut = self._conn.request(header, blobs, budget)
        try:
            res, out = await asyncio.wrap_future(fut)
        except asyncio.CancelledError:  # the caller gave up (a tool deadline): stop the call
            if jid:
                self._conn.send(_frames.pack({"op": "cancel", "id": jid}, []))
            raise
        self.spent_s += float(res.get("wall_s", 0.0))
        return res, out

    async def _call(
        self,
        op: str,
        blobs: list[bytes],
        timeout_s: float | None,
        output_bytes: int | None = None,
        **extra: object,
    ) -> ExecResult:
        res, out = await self._call_raw(op, blobs, timeout_s, output_bytes, **extra)
        return ExecResult(
            status=res["status"],
            exit_code=res.get("exit_code"),
            signal=res.get("signal"),
            stdout=out[0].decode("utf-8", "replace") if out else "",
            stderr=out[1].decode("utf-8", "replace") if len(out) > 1 else "",
            truncated=bool(res.get("truncated")),
            wall_s=float(res.get("wall_s", 0.0)),
            backend=self.backend,
            detail=res.get("detail", ""),
        )

    async def run(self, cmd: str, *, timeout_s: float | None = None) -> ExecResult:
        """Run `cmd` in the session's bash (cwd, variables, functions and background jobs
        persist; stdin is /dev/null). stdout holds stdout and stderr as a terminal shows them."""
        return await self._call("run", [cmd.encode()], timeout_s)

    async def python(self, code: str, *, timeout_s: float | None = None) -> ExecResult:
        """Run `code` in the session's Python REPL (its names persist); a final expression's
        value is printed, as the interactive interpreter does."""
        return await self._call("python", [code.encode()], timeout_s)

    async def exec(
        self,
        argv: Sequence[str],
        *,
        stdin: bytes | str = b"",
        cwd: str = "/workspace",
        timeout_s: float | None = None,
        output_bytes: int | None = None,
    ) -> ExecResult:
        """Run a program (PATH searched) as a fresh process of the session, with its own
        stdout and stderr: the shell's state does not reach it, nor it the shell's."""
        data = stdin.encode() if isinstance(stdin, str) else bytes(stdin)
        return await self._call("exec", [data], timeout_s, output_bytes, argv=list(argv), cwd=cwd)

    async def read_bytes(self, path: str, *, max_bytes: int = 1 << 20) -> bytes:
        """The file's bytes (relative paths are under /workspace); SessionFileError when it
        cannot be read or is longer than `max_bytes`."""
        res, out = await self._call_raw(
            "exec", [b""], None, max_bytes, argv=["cat", "--", path], cwd="/workspace"
        )
        if res["status"] != "ok" or res.get("truncated"):
            why = out[1].decode("utf-8", "replace").strip() or res.get("detail") or res["status"]
            if res["status"] in ("ok", "output_limit"):
                why = f"longer than {max_bytes} bytes"
            raise SessionFileError(f"cannot read {path}: {why[:500]}")
        return out[0]

    async def read(self, path: str, *, max_bytes: int = 1 << 20) -> str:
        """The file as text (UTF-8; undecodable bytes replaced)."""
        return (await self.read_bytes(path, max_bytes=max_bytes)).decode("utf-8", "replace")

    async def write(self, path: str, data: str | bytes) -> None:
        """Write the file (parent directories made; replaced as a whole, so a hard-linked fork's
        shared bytes are never written through). SessionFileError when it cannot."""
        res = await self.exec(["sh", "-c", _WRITE, "sh", path], stdin=data)
        if res.status != "ok":
            why = res.stderr.strip() or res.detail or res.status
            raise SessionFileError(f"cannot write {path}: {why[:500]}")

    async def checksum(self) -> str:
        """The checksum of /workspace as it is now, computed inside the jail (`_tree.py`)."""
        res = await self.exec(
            [self._python, "-I", "-c", _TREE_SOURCE, "/workspace"], output_bytes=4096
        )
        if res.status != "ok":
            raise SessionError(f"checksum failed: {res.status} {res.detail} {res.stderr[-300:]}")
        return res.stdout.strip()

    def processes(self) -> list[int]:
        """Host pids of the session's live processes (its init included): every process in its
        PID namespace but those that exited and wait to be reaped. Empty once it is closed."""
        ns = self._pid_ns
        if ns is None:
            return []
        found = []
        for name in os.listdir("/proc"):
            if name.isdigit():
                try:
                    with open(f"/proc/{name}/stat") as f:
                        exited = f.read().rsplit(")", 1)[1].split()[0] == "Z"
                    if not exited and os.readlink(f"/proc/{name}/ns/pid") == ns:
                        found.append(int(name))
                except OSError:
                    continue
        return sorted(found)

    # ---- closing -------------------------------------------------------------------------------

    def close_sync(self, timeout_s: float = 10.0) -> None:
        """Kill every process of the session, wait until its jail is gone, remove its fork.
        Raises SessionError when something of it outlived the close."""
        with self._close_lock:
            if self.closed:
                return
            self.closed = True
        conn = self._conn
        _, fut = conn.request({"op": "close"}, [], timeout_s)
        try:
            fut.result(timeout_s + _MARGIN_S)
        except Exception:  # noqa: BLE001 - dead or hung: killed below either way
            pass
        try:
            code = conn.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            conn.proc.kill()
            code = conn.proc.wait()
        conn.sock.close()
        # the namespace's last processes may still be on their way out when the jail's process is
        # reaped (a CI run under load saw one alive at that moment): wait for them, within bounds
        deadline = time.monotonic() + timeout_s
        while (alive := self.processes()) and time.monotonic() < deadline:
            time.sleep(0.01)
        if self._on_close is not None:
            self._on_close()
        if code == 3 or alive:
            raise SessionError(
                f"processes of the session were still alive after its close: {alive or 'its init'}"
            )

    async def close(self) -> None:
        """`close_sync` from a coroutine (in a worker thread)."""
        await asyncio.to_thread(self.close_sync)

    def __del__(self) -> None:  # a session nobody closed: its socket's end stops the jail
        if not getattr(self, "closed", True):
            self._conn.sock.close()


__all__ = [
    "Session",
    "SessionBudgetExceeded",
    "SessionError",
    "SessionFileError",
    "SessionLimits",
    "WorkspaceMount",
]
