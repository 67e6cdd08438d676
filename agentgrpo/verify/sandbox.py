"""Run untrusted, model-written Python with limits and get a typed result back.

    sb = Sandbox()                       # strongest backend this host allows, probed once
    res = sb.run("print(input()[::-1])", stdin=b"abc", limits=Limits(wall_s=2))
    res.status, res.stdout               # ("ok", "cba\\n")
    res = await sb.arun(code)            # same, from asyncio (never blocks the event loop)

Backends, probed once per process in this order: `namespaces` (root: a supervisor, a fork server,
per-job namespaces, seccomp and cgroups), `bwrap` (unprivileged, rlimits only), `remote`
(`serve-sandbox` servers), and `unsafe-local` (only by name: no isolation). Every result is an
`ExecResult` naming its status and backend, within the wall limit plus a margin; nothing the code
does raises. A `sandbox_error` is retried here, and one that remains makes the sample unscorable
(reward NaN), never 0. Jobs past the free slots queue, uncharged to a tool's deadline.
docs/sandbox.md has the statuses, the backends and the threat model; docs/security.md the rest.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import shutil
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout  # not the builtin before 3.11
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from agentgrpo.deadlines import waiting_for_capacity
from agentgrpo.env.tool import to_user_thread
from agentgrpo.types import InfrastructureError
from agentgrpo.verify._local_client import _LocalClient
from agentgrpo.verify._records import STATUSES, ExecResult, Limits, Status, sandbox_error
from agentgrpo.verify._remote_client import _RemoteClient
from agentgrpo.verify.session import Session, SessionLimits, WorkspaceMount
from agentgrpo.verify.workspace import ForkMode, PreparedWorkspace, Workspace, WorkspaceStore

# The public API of the sandbox; the records are defined in `_records.py` and re-exported here.
__all__ = [
    "STATUSES",
    "BackendName",
    "ExecResult",
    "Limits",
    "Sandbox",
    "SandboxConfig",
    "Session",
    "SessionLimits",
    "Workspace",
    "SandboxUnavailable",
    "Status",
    "adefault_sandbox",
    "default_sandbox",
    "sandbox_error",
]

_GAVE_UP = "cancelled: its caller gave up"  # as the supervisor words a cancelled job (_job.py)
_GAVE_UP_POLL_S = 0.2

BackendName = Literal["auto", "namespaces", "bwrap", "remote", "unsafe-local"]


class SandboxUnavailable(InfrastructureError):
    """Raised by callers (e.g. the python tool) that cannot return a sandbox_error as a value.

    It marks an infrastructure failure: the episode is unscorable, not the model's fault.
    """


class SandboxConfig(BaseModel):
    """How a `Sandbox` is set up. Limits are per call (`Limits`); this is per sandbox."""

    model_config = ConfigDict(extra="forbid")

    slots: int | None = Field(
        None, ge=1, le=255, description="jobs run at once (default 4 x CPUs, at least 4)"
    )
    retries: int = Field(2, ge=0, le=10, description="extra attempts after a sandbox_error")
    python: str | None = Field(
        None, description="interpreter jobs run under (default: this one's base interpreter)"
    )
    ro_paths: list[str] = Field(
        default_factory=list,
        description="extra host directories visible read-only (e.g. a site-packages)",
    )
    preimport: list[str] = Field(
        default_factory=list, description="modules imported once in the fork server (e.g. numpy)"
    )
    uid_base: int = Field(
        1_500_000,
        ge=1000,
        le=(1 << 31) - (1 << 24) - 1,
        description="uids from here on are the sandboxes': per supervisor a block of 256 (init, "
        "then slots)",
    )
    margin_s: float = Field(
        5.0, gt=0, description="client-side grace beyond wall_s before declaring the backend hung"
    )
    start_timeout_s: float = Field(60.0, gt=0, description="how long a backend may take to start")
    busy_wait_s: float = Field(
        120.0, ge=0, description="remote: how long to keep retrying busy servers (429/503)"
    )
    fork: ForkMode = Field(
        "overlay",
        description="how a session forks a prepared workspace: overlay (copy-on-write), "
        "hardlink (linked read-only files) or copy (docs/sandbox.md, Sessions)",
    )
    state_dir: str | None = Field(
        None, description="where prepared workspaces and forks live (default: the temp dir)"
    )
    keep_prepared: int = Field(
        16, ge=0, description="unused prepared workspaces kept (the most recently used)"
    )


# ---- probing and the public class ----------------------------------------------------------------

_PROBE_LOCK = threading.Lock()
# (backend, config) pairs that failed to start: `auto` does not pay for them again. Keyed by the
# config too, so a SandboxConfig that cannot start (a wrong `python`) does not rule the backend out
# for every other Sandbox of the process.
_FAILED: dict[tuple[str, str], str] = {}


def _start_local(kind: str, cfg: SandboxConfig) -> _LocalClient:
    try:
        client = _LocalClient(kind, cfg)
    except (RuntimeError, OSError) as e:
        _FAILED[kind, cfg.model_dump_json()] = str(e)
        raise
    return client


class Sandbox:
    """Runs code in the strongest sandbox available; see the module docstring for what each gives.

    Create one and share it (it owns a supervisor process and its slots); it is thread-safe and
    asyncio-safe. `close()` (or the context manager, or interpreter exit) stops it.
    """

    def __init__(
        self,
        url: str | Sequence[str] | None = None,
        *,
        token: str | None = None,
        backend: BackendName = "auto",
        config: SandboxConfig | None = None,
    ) -> None:
        self.config = config or SandboxConfig()
        url = url or os.environ.get("AGENTGRPO_SANDBOX_URL") or None
        if backend == "remote" or (url and backend == "auto"):
            if not url:
                raise ValueError("backend='remote' needs url=... or AGENTGRPO_SANDBOX_URL")
            urls = [url] if isinstance(url, str) else list(url)
            urls = [u.strip() for part in urls for u in part.split(",") if u.strip()]
            token = token or os.environ.get("AGENTGRPO_SANDBOX_TOKEN") or None
            self._impl: _LocalClient | _RemoteClient = _RemoteClient(urls, token, self.config)
        elif backend == "unsafe-local":
            warnings.warn(
                "Sandbox(backend='unsafe-local') runs code WITHOUT isolation; trusted code only",
                stacklevel=2,
            )
            self._impl = _start_local("unsafe-local", self.config)
        elif backend in ("namespaces", "bwrap"):
            self._impl = _start_local(backend, self.config)
        elif backend == "auto":
            self._impl = self._auto()
        else:
            raise ValueError(
                f"unknown sandbox backend {backend!r}; choose from {BackendName.__args__}"
            )
        self.backend: str = self._impl.info["backend"]
        self._workspaces: WorkspaceStore | None = None
        self._store_lock = threading.Lock()
        atexit.register(self.close)

    def _auto(self) -> _LocalClient:
        key = self.config.model_dump_json()
        why: dict[str, str] = {}
        with _PROBE_LOCK:
            for kind in ("namespaces", "bwrap"):
                if (kind, key) in _FAILED:  # failed before in this process: do not pay for it again
                    why[kind] = _FAILED[kind, key]
                elif kind == "namespaces" and os.geteuid() != 0:
                    why[kind] = "needs root (CAP_SYS_ADMIN)"
                elif kind == "bwrap" and shutil.which("bwrap") is None:
                    why[kind] = "bwrap not installed"
                else:
                    try:
                        return _start_local(kind, self.config)
                    except (RuntimeError, OSError) as e:
                        why[kind] = str(e)
        reasons = "; ".join(f"{k}: {v}" for k, v in why.items())
        raise RuntimeError(
            "no sandbox backend works on this host ("
            + reasons
            + "). Run as root, install bubblewrap with unprivileged user namespaces, point "
            "AGENTGRPO_SANDBOX_URL at a `agentgrpo serve-sandbox`, or pass backend='unsafe-local' "
            "for trusted code only."
        )

    @property
    def info(self) -> dict:
        """Backend name, slots and the isolation features actually in effect."""
        return dict(self._impl.info)

    @staticmethod
    def _prepare(
        code: str | bytes, stdin: bytes | str, files: Mapping[str, str | bytes] | None
    ) -> tuple[bytes, bytes, list[tuple[str, bytes]]]:
        code_b = code.encode() if isinstance(code, str) else bytes(code)
        stdin_b = stdin.encode() if isinstance(stdin, str) else bytes(stdin)
        out = []
        for name, data in (files or {}).items():
            parts = name.split("/")
            if not name or name.startswith("/") or any(p in ("", ".", "..") for p in parts):
                raise ValueError(f"sandbox file name must be a plain relative path, got {name!r}")
            out.append((name, data.encode() if isinstance(data, str) else bytes(data)))
        return code_b, stdin_b, out

    def run(
        self,
        code: str | bytes,
        *,
        stdin: bytes | str = b"",
        files: Mapping[str, str | bytes] | None = None,
        limits: Limits | None = None,
        gave_up: Callable[[], bool] | None = None,
    ) -> ExecResult:
        """Run `code` as a Python program (`__main__`, cwd = its scratch dir holding `files`).

        `gave_up`, on a local backend, is asked about every 0.2 s while the job queues or runs;
        once it says True the job is killed (or never started) and the result is a sandbox_error
        "cancelled: its caller gave up", not retried (`serve-sandbox` passes "the client hung
        up")."""
        limits = limits or Limits()
        code_b, stdin_b, files_l = self._prepare(code, stdin, files)
        res = sandbox_error("not run", self.backend)
        for attempt in range(self.config.retries + 1):
            if attempt:
                time.sleep(min(0.05 * 2**attempt, 1.0))
            if isinstance(self._impl, _RemoteClient):
                res = self._impl.run(_RemoteClient.body(code_b, stdin_b, files_l, limits), limits)
            else:
                fut = self._impl.submit(code_b, stdin_b, files_l, limits)
                res = self._wait(fut, gave_up)
                if res is None:
                    return sandbox_error(_GAVE_UP, self.backend)
            if res.status != "sandbox_error":
                return res
        return res

    def _wait(self, fut: Future, gave_up: Callable[[], bool] | None) -> ExecResult | None:
        """`fut`'s result, or None once `gave_up()` (the job then abandoned)."""
        if gave_up is None:
            return fut.result()
        while True:
            try:
                return fut.result(timeout=_GAVE_UP_POLL_S)
            except FutureTimeout:
                if gave_up():
                    self._impl.abandon(fut)
                    return None

    async def arun(
        self,
        code: str | bytes,
        *,
        stdin: bytes | str = b"",
        files: Mapping[str, str | bytes] | None = None,
        limits: Limits | None = None,
    ) -> ExecResult:
        """Async `run`: awaits the result without blocking the event loop. Cancelling the awaiting
        task (a deadline) kills the job, so it stops holding a slot: on a local backend at once,
        on a remote one when the server sees the connection close (within about 0.2 s)."""
        limits = limits or Limits()
        code_b, stdin_b, files_l = self._prepare(code, stdin, files)
        res = sandbox_error("not run", self.backend)
        for attempt in range(self.config.retries + 1):
            if attempt:
                await asyncio.sleep(min(0.05 * 2**attempt, 1.0))
            if isinstance(self._impl, _RemoteClient):
                res = await self._impl.arun(
                    _RemoteClient.body(code_b, stdin_b, files_l, limits), limits
                )
            else:
                fut = self._impl.submit(code_b, stdin_b, files_l, limits)
                try:
                    res = await asyncio.wrap_future(fut)
                except asyncio.CancelledError:  # the caller gave up: free the slot now
                    self._impl.abandon(fut)
                    raise
            if res.status != "sandbox_error":
                return res
        return res

    # ---- sessions (verify/session.py, verify/workspace.py) --------------------------------------

    async def session(
        self, workspace: Workspace | None = None, *, limits: SessionLimits | None = None
    ) -> Session:
        """A session for one episode: a fork of `workspace` (prepared once, then cached by its
        content) at /workspace, or an empty one, and a shell and a REPL that live until its
        `close`. Needs the namespaces or bwrap backend (SandboxUnavailable otherwise; bwrap forks
        by copying); a setup command that fails raises `WorkspaceSetupError`. Starting it runs in
        a worker thread."""
        return await to_user_thread(self.session_sync, workspace, limits=limits)

    def session_sync(
        self, workspace: Workspace | None = None, *, limits: SessionLimits | None = None
    ) -> Session:
        """`session` for code without an event loop (blocking)."""
        limits = limits or SessionLimits()
        if workspace is None:
            return self._start_session(WorkspaceMount("empty"), limits, None, "empty")
        store = self._store()
        prepared = store.acquire(workspace)
        try:
            mount, remove_fork = store.mount(prepared)
        except BaseException:
            store.release(prepared)
            raise

        def done() -> None:
            remove_fork()
            store.release(prepared)

        try:
            session = self._start_session(mount, limits, prepared.checksum, prepared.fork)
        except BaseException:
            done()
            raise
        session._on_close = done
        return session

    def prepare(self, workspace: Workspace) -> PreparedWorkspace:
        """Prepare `workspace` now (or find it prepared): its tree and checksum. Blocking."""
        store = self._store()
        prepared = store.acquire(workspace)
        store.release(prepared)
        return prepared

    def _start_session(
        self, mount: WorkspaceMount, limits: SessionLimits, checksum: str | None, fork: str
    ) -> Session:
        if self.backend not in ("namespaces", "bwrap"):
            raise SandboxUnavailable(
                f"sandbox sessions need the namespaces (root) or bwrap backend; this sandbox is "
                f"{self.backend!r}"
            )
        return Session.start(
            backend=self.backend,
            python=self._impl.python,
            ro_paths=self.config.ro_paths,
            uid=self._session_uid(),
            mount=mount,
            limits=limits,
            workspace_checksum=checksum,
            fork=fork,
            start_timeout_s=self.config.start_timeout_s,
        )

    def _session_uid(self) -> int:
        """The uid a session's files belong to: under namespaces one past every supervisor's uid
        block; under bwrap this process's own (bubblewrap maps the jail's user to it)."""
        return self.config.uid_base + (1 << 24) if self.backend == "namespaces" else os.geteuid()

    def _store(self) -> WorkspaceStore:
        with self._store_lock:
            if self._workspaces is None:
                cfg = self.config
                # bwrap: no overlay mount without root, and hard links would share inodes that
                # the jail's user owns (and could chmod): a copy per session
                fork = cfg.fork if self.backend == "namespaces" else "copy"
                self._workspaces = WorkspaceStore(
                    cfg.state_dir, fork, self._session_uid(), cfg.keep_prepared, self._start_session
                )
            return self._workspaces

    def close(self) -> None:
        self._impl.close()
        if self._workspaces is not None:
            self._workspaces.close()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_sandbox(sandbox: object, owner: str, *methods: str) -> None:
    """Refuse, where it is given, a `sandbox` (None = the default one) that lacks one of `methods`.

    Anything with the `Sandbox` methods a caller uses may stand in for one (a test double, a
    wrapper); without this check a stand-in with only `run` would fail as an AttributeError
    inside the first tool call or reward, mid-rollout, instead of when the env is built."""
    missing = [
        m for m in methods if sandbox is not None and not callable(getattr(sandbox, m, None))
    ]
    if missing:
        raise TypeError(
            f"{owner}: sandbox {type(sandbox).__name__} has no {', '.join(missing)} method; pass "
            f"an agentgrpo Sandbox (or an object with {' and '.join(methods)} like Sandbox's), or "
            "None for the default one"
        )


_DEFAULT: Sandbox | None = None
_DEFAULT_LOCK = threading.Lock()


def default_sandbox() -> Sandbox:
    """A process-wide `Sandbox()` created on first use (verifiers and tools share it)."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            _DEFAULT = Sandbox()
        return _DEFAULT


async def adefault_sandbox() -> Sandbox:
    """`default_sandbox()` for coroutines: its first call probes the backends and starts one
    (seconds on a host where some fail) in a worker thread, so the event loop keeps running, and
    inside a tool call that start is a wait (not charged to `tool_timeout_s`)."""
    if _DEFAULT is not None:
        return _DEFAULT
    with waiting_for_capacity():
        return await asyncio.to_thread(default_sandbox)
