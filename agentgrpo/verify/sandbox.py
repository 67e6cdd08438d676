"""Run untrusted, model-written Python with limits and get a typed result back.

    sb = Sandbox()                       # strongest backend this host allows, probed once
    res = sb.run("print(input()[::-1])", stdin=b"abc", limits=Limits(wall_s=2))
    res.status, res.stdout               # ("ok", "cba\\n")
    res = await sb.arun(code)            # same, from asyncio (never blocks the event loop)

Statuses: ok | runtime_error (non-zero exit) | timeout (wall or CPU limit) | memory_limit (cgroup
OOM kill, or MemoryError) | output_limit (stdout or stderr passed `output_bytes`; the job is
killed and what came before is kept, `truncated=True`) | signaled (died of another signal) |
sandbox_error (the sandbox itself failed). `sandbox_error` is retried here (`retries`), and a
caller that still gets one must treat the sample as unscorable (reward NaN), never as 0.
Stdout and stderr are unbuffered inside the sandbox, so output printed before a timeout is kept.

Backends, chosen by probing once per process, in this order; every result names its `backend`:
- `namespaces` (root with CAP_SYS_ADMIN): a supervisor process and a fork server; each job is a
  fork of a warm interpreter in new mount, PID, IPC and UTS namespaces and its slot's empty
  network namespace, inside a read-only minimal root (`pivot_root`) with a fresh size- and
  inode-limited tmpfs on /tmp and a pid-only /proc, rlimits, its slot's own uid, no
  supplementary groups, `no_new_privs`, a seccomp deny-list (`_seccomp.py`), a PID-1 init under
  another uid that reaps and reports, and cgroups (v1 memory/pids, v2 `cgroup.kill`, v2
  memory/pids where delegated). Each free slot holds a job pre-started up to reading its
  payload, so a `print(1)` costs about 3.4 ms p50 on a 2-core VM (bench/sandbox.py).
- `bwrap` (bubblewrap, unprivileged user namespaces): the same namespaces and read-only binds,
  seccomp, all capabilities dropped; memory and processes bounded by rlimits only (RLIMIT_AS is
  coarser than a cgroup); a fresh interpreter per job (tens of ms).
- `remote`: `Sandbox(url=...)` or AGENTGRPO_SANDBOX_URL, one or several `serve-sandbox` servers
  (token from AGENTGRPO_SANDBOX_TOKEN); isolation is whatever that server's backend gives.
- `unsafe-local`: only when asked for by name. A subprocess with rlimits in a temp dir, nothing
  else: for trusted code in tests. Every result says `backend="unsafe-local"`.

Threat model (namespaces backend; bwrap differs where noted). The code is hostile. It cannot:
- read host files outside what it is given: the root is a read-only tree of /usr, /lib*, the
  Python installation and `ro_paths`, plus a synthetic /etc (no secrets, no host /etc); /proc
  shows only the job's own processes; /sys and /dev are absent but for null, zero, full,
  random and urandom;
- write outside its scratch space: everything is read-only but /tmp, a fresh tmpfs per job,
  bounded in bytes (`disk_mb`) and inodes; RLIMIT_FSIZE bounds single files;
- reach any network, loopback included: its network namespace has only a downed `lo`; socket
  families other than unix/inet/inet6 are refused (no netlink, vsock, packet); abstract unix
  sockets are per network namespace, so host ones are out of reach;
- see the trainer's environment: the fork server starts with a fixed, clean environment;
- signal, ptrace or inspect the trainer or other jobs: separate PID namespace, a uid per slot,
  ptrace and process_vm_* denied by seccomp;
- exhaust host memory, processes, disk, inodes or fds: memory and pids cgroups (rlimits as
  fallback: RLIMIT_AS, RLIMIT_NPROC per slot uid), tmpfs size and inodes, RLIMIT_NOFILE;
- flood the trainer: output is capped while read, and the job is killed at the cap;
- leave processes behind: when the job's main process exits, its init exits and the kernel
  kills every process of the PID namespace (daemons, double forks, orphans); at the wall limit
  the supervisor kills the init through a pidfd and the slot through `cgroup.kill`;
- persist state into the next job: fresh mount/IPC/PID/UTS namespaces and tmpfs per job; keyrings
  (per-uid state) are denied by seccomp;
- gain privileges: non-root uid without capabilities, `no_new_privs`, user namespaces and
  mount/unshare/setns/bpf/perf/io_uring/module/kexec syscalls denied by seccomp.
The sandbox always returns a typed result within the wall limit plus a small margin; it does
not raise for anything the code does.

Not covered (known limits): kernel vulnerabilities reachable through allowed syscalls (this is a
deny-list on a shared kernel, not a VM: use gVisor/Firecracker for hostile multi-tenant use);
CPU contention and timing side channels between concurrent jobs (no CPU quota; RLIMIT_CPU and
the wall limit bound each job's time); reading world-readable files under the exposed /usr and
Python trees; all jobs share the fork server's hash seed (`PYTHONHASHSEED`) and pre-imported
module state; code that games an in-process test harness (see `verify/code.py`, which runs
each test in a separate process for this reason). In the bwrap backend the job and its runner
share a uid, and limits are rlimits only. `unsafe-local` protects nothing.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
import warnings
from collections import deque
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from agentgrpo.verify import _supervisor

Status = Literal[
    "ok", "runtime_error", "timeout", "memory_limit", "output_limit", "signaled", "sandbox_error"
]
STATUSES: tuple[str, ...] = Status.__args__  # type: ignore[attr-defined]
BackendName = Literal["auto", "namespaces", "bwrap", "remote", "unsafe-local"]
_VERIFY_DIR = os.path.dirname(os.path.abspath(__file__))


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
    """What happened to one job. `exit_code` is set when it exited, `signal` when a signal ended it."""

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


class SandboxUnavailable(RuntimeError):
    """Raised by callers (e.g. the python tool) that cannot return a sandbox_error as a value.

    It marks an infrastructure failure: the episode is unscorable, not the model's fault.
    """


def sandbox_error(detail: str, backend: str, wall_s: float = 0.0) -> ExecResult:
    return ExecResult("sandbox_error", None, None, "", "", False, wall_s, backend, detail)


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
        description="uids from here on are the sandboxes': per supervisor a block of 256 (init, then slots)",
    )
    margin_s: float = Field(
        5.0, gt=0, description="client-side grace beyond wall_s before declaring the backend hung"
    )
    start_timeout_s: float = Field(60.0, gt=0, description="how long a backend may take to start")
    busy_wait_s: float = Field(
        120.0, ge=0, description="remote: how long to keep retrying busy servers (429/503)"
    )


# ---- local backends: a supervisor process ---------------------------------------------------------


class _LocalClient:
    """Client end of a supervisor process (`_supervisor.py`) for the namespaces / bwrap / unsafe backends.

    Dispatches at most `slots` jobs at a time, so a dispatched job starts at once and its deadline
    (wall_s + margin) is meaningful; the rest wait in a local queue. A supervisor that dies or misses
    a deadline is killed; its jobs come back as sandbox_error and the next call starts a new one.
    """

    def __init__(self, kind: str, cfg: SandboxConfig) -> None:
        self.kind, self.cfg = kind, cfg
        self.slots = cfg.slots or max(4, 4 * (os.cpu_count() or 1))
        self.python = cfg.python or _base_python()
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._queue: deque[tuple[int, bytes, float, Future]] = deque()
        self._inflight: dict[int, tuple[Future, float]] = {}
        self._next = 0
        self._proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self._closed = False
        self.info: dict = {}
        self._start()

    def _start(self) -> None:
        ours, theirs = socket.socketpair()
        cfg = {
            "backend": self.kind,
            "slots": self.slots,
            "python": self.python,
            "uid_base": self.cfg.uid_base,
            "ro_paths": self.cfg.ro_paths,
            "preimport": self.cfg.preimport,
            "default_limits": Limits().model_dump(),
        }
        boot = "import sys; sys.path.append(sys.argv[1]); import _supervisor; sys.exit(_supervisor.main(sys.argv[1:]))"
        self._proc = subprocess.Popen(
            [sys.executable, "-I", "-c", boot, _VERIFY_DIR, json.dumps(cfg), str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            env=_supervisor.CLEAN_ENV,
            cwd="/",
        )
        theirs.close()
        ours.settimeout(self.cfg.start_timeout_s)
        try:
            hello, _ = self._recv(ours)
        except (OSError, ConnectionError, struct.error, ValueError) as e:
            hello = {"ok": False, "error": f"supervisor did not start: {e}"}
        if not hello.get("ok"):
            ours.close()
            self._kill_proc()
            raise RuntimeError(f"{self.kind} sandbox backend unavailable: {hello.get('error')}")
        self.info = {k: hello[k] for k in ("backend", "slots", "features")}
        ours.settimeout(0.25)
        self._sock = ours
        threading.Thread(
            target=self._reader, args=(ours,), name=f"sandbox-{self.kind}", daemon=True
        ).start()

    @staticmethod
    def _recv(sock: socket.socket) -> tuple[dict, list[bytes]]:
        (n,) = struct.unpack("!I", _recv_exact(sock, 4))
        return _supervisor.unpack(_recv_exact(sock, n))

    def submit(
        self, code: bytes, stdin: bytes, files: list[tuple[str, bytes]], limits: Limits
    ) -> Future:
        fut: Future = Future()
        with self._lock:
            if self._closed:
                fut.set_result(sandbox_error("sandbox closed", self.kind))
                return fut
            self._next += 1
            header = {
                "id": self._next,
                "limits": limits.model_dump(),
                "files": [n for n, _ in files],
            }
            frame = _supervisor.pack(header, [code, stdin] + [b for _, b in files])
            self._queue.append((self._next, frame, limits.wall_s + self.cfg.margin_s, fut))
        self._pump()
        return fut

    def _pump(self) -> None:
        """Send queued jobs while slots are free (restarting the supervisor if it is gone)."""
        while True:
            with self._lock:
                if not self._queue or len(self._inflight) >= self.slots or self._closed:
                    return
                if self._sock is None:
                    try:
                        self._start()
                    except RuntimeError as e:  # cannot restart: fail what waits, retry later
                        waiting = list(self._queue)
                        self._queue.clear()
                        for _, _, _, fut in waiting:
                            fut.set_result(sandbox_error(str(e), self.kind))
                        return
                jid, frame, budget, fut = self._queue.popleft()
                self._inflight[jid] = (fut, time.monotonic() + budget)
                sock = self._sock
            try:
                with self._send_lock:
                    sock.sendall(frame)
            except OSError:  # supervisor gone; the reader thread fails in-flight jobs
                self._drop(sock, "supervisor connection lost")

    def _reader(self, sock: socket.socket) -> None:
        buf = bytearray()
        checked = time.monotonic()
        while True:
            try:
                chunk = sock.recv(1 << 20)
                if not chunk:
                    break
                buf += chunk
            except TimeoutError:
                pass
            except OSError:
                break
            while len(buf) >= 4:
                (n,) = struct.unpack_from("!I", buf)
                if len(buf) < 4 + n:
                    break
                header, blobs = _supervisor.unpack(bytes(buf[4 : 4 + n]))
                del buf[: 4 + n]
                with self._lock:
                    entry = self._inflight.pop(header["id"], None)
                if entry is not None:
                    entry[0].set_result(_result_from(header, blobs))
            if time.monotonic() - checked > 0.25:
                checked = time.monotonic()
                self._check_deadlines(sock)
            self._pump()
        self._drop(sock, "supervisor exited")

    def _check_deadlines(self, sock: socket.socket) -> None:
        now = time.monotonic()
        with self._lock:
            late = any(deadline < now for _, deadline in self._inflight.values())
        if late:
            self._drop(sock, "supervisor missed a job deadline; restarted")

    def _drop(self, sock: socket.socket, why: str) -> None:
        with self._lock:
            if self._sock is not sock:
                return
            self._sock = None
            failed = list(self._inflight.values())
            self._inflight.clear()
            sock.close()  # EOF: a healthy supervisor kills its jobs, cleans up and exits
            self._kill_proc(grace_s=5.0 if why == "sandbox closed" else 0.5)
        for fut, _ in failed:
            fut.set_result(sandbox_error(why, self.kind))
        self._pump()

    def _kill_proc(self, grace_s: float = 0.5) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        for stop in (None, proc.terminate, proc.kill):
            if stop is not None:
                stop()
            try:
                proc.wait(grace_s)
                return
            except subprocess.TimeoutExpired:
                continue
        proc.wait()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            sock = self._sock
        if sock is not None:
            self._drop(sock, "sandbox closed")


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("connection closed")
        buf += chunk
    return bytes(buf)


def _result_from(h: dict, blobs: list[bytes]) -> ExecResult:
    rss = h.get("maxrss_kb")
    return ExecResult(
        status=h["status"],
        exit_code=h.get("exit_code"),
        signal=h.get("signal"),
        stdout=blobs[0].decode("utf-8", "replace") if blobs else "",
        stderr=blobs[1].decode("utf-8", "replace") if len(blobs) > 1 else "",
        truncated=bool(h.get("truncated", False)) or h["status"] == "output_limit",
        wall_s=float(h.get("wall_s", 0.0)),
        backend=h.get("backend", "?"),
        detail=h.get("detail", ""),
        cpu_s=h.get("cpu_s"),
        max_rss_mb=None if rss is None else rss / 1024,
    )


def _base_python() -> str:
    """The base interpreter (not a venv shim): jobs see its stdlib, not the trainer's packages."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


# ---- remote backend -----------------------------------------------------------------------------------


class _RemoteClient:
    """Client of one or several `serve-sandbox` servers: least-loaded choice, retry on 429/5xx."""

    kind = "remote"

    def __init__(self, urls: Sequence[str], token: str | None, cfg: SandboxConfig) -> None:
        import httpx

        self.urls = [u.rstrip("/") for u in urls]
        self.cfg = cfg
        self.load = dict.fromkeys(self.urls, 0)
        self._lock = threading.Lock()
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._sync = httpx.Client(headers=self.headers, timeout=None)
        self._async: dict[int, object] = {}
        self.info = {
            "backend": "remote",
            "slots": None,
            "features": [f"remote: {', '.join(self.urls)}"],
        }

    def _pick(self) -> str:
        with self._lock:
            url = min(self.urls, key=lambda u: self.load[u])
            self.load[url] += 1
            return url

    def _done(self, url: str) -> None:
        with self._lock:
            self.load[url] -= 1

    @staticmethod
    def body(code: bytes, stdin: bytes, files: list[tuple[str, bytes]], limits: Limits) -> dict:
        import base64

        return {
            "code": code.decode("utf-8", "surrogateescape"),
            "stdin_b64": base64.b64encode(stdin).decode(),
            "files_b64": {n: base64.b64encode(b).decode() for n, b in files},
            "limits": limits.model_dump(),
        }

    def _parse(self, resp, url: str) -> ExecResult:
        if resp.status_code != 200:
            return sandbox_error(f"{url}: HTTP {resp.status_code}: {resp.text[:200]}", "remote")
        try:
            d = resp.json()
            d["backend"] = f"remote:{d.get('backend')}"
            return ExecResult(**{k: d[k] for k in ExecResult.__dataclass_fields__ if k in d})
        except (ValueError, TypeError, KeyError) as e:  # a broken server is an infrastructure error
            return sandbox_error(f"{url}: bad response: {e}", "remote")

    def _busy_wait(self, resp, attempt: int, deadline: float) -> float | None:
        """Seconds to wait before retrying a busy server (429/503), None to give up."""
        if resp is None or resp.status_code not in (429, 503) or time.monotonic() >= deadline:
            return None
        try:
            after = float(resp.headers.get("Retry-After", "0"))
        except ValueError:
            after = 0.0
        return min(max(after, 0.05 * 2**attempt), 2.0, max(deadline - time.monotonic(), 0.0))

    def run(self, payload: dict, limits: Limits) -> ExecResult:
        import httpx

        deadline = time.monotonic() + self.cfg.busy_wait_s
        for attempt in range(1000):
            url, resp = self._pick(), None
            try:
                resp = self._sync.post(
                    url + "/run", json=payload, timeout=limits.wall_s + self.cfg.margin_s + 30
                )
            except httpx.HTTPError as e:
                return sandbox_error(f"{url}: {type(e).__name__}: {e}", "remote")
            finally:
                self._done(url)
            wait = self._busy_wait(resp, attempt, deadline)
            if wait is None:
                return self._parse(resp, url)
            time.sleep(wait)
        return sandbox_error("servers busy", "remote")

    async def arun(self, payload: dict, limits: Limits) -> ExecResult:
        import httpx

        loop = asyncio.get_running_loop()
        client = self._async.get(id(loop))
        if client is None or client.is_closed:
            client = self._async[id(loop)] = httpx.AsyncClient(headers=self.headers, timeout=None)
        deadline = time.monotonic() + self.cfg.busy_wait_s
        for attempt in range(1000):
            url, resp = self._pick(), None
            try:
                resp = await client.post(
                    url + "/run", json=payload, timeout=limits.wall_s + self.cfg.margin_s + 30
                )
            except httpx.HTTPError as e:
                return sandbox_error(f"{url}: {type(e).__name__}: {e}", "remote")
            finally:
                self._done(url)
            wait = self._busy_wait(resp, attempt, deadline)
            if wait is None:
                return self._parse(resp, url)
            await asyncio.sleep(wait)
        return sandbox_error("servers busy", "remote")

    def close(self) -> None:
        self._sync.close()


# ---- probing and the public class -------------------------------------------------------------------

_PROBE_LOCK = threading.Lock()
_PROBED: dict[str, str] = {}  # backend -> "" if it worked, else why not (filled once per process)


def probe_report() -> dict[str, str]:
    """Which local backends were tried in this process and why those that failed failed."""
    return dict(_PROBED)


def _start_local(kind: str, cfg: SandboxConfig) -> _LocalClient:
    try:
        client = _LocalClient(kind, cfg)
    except (RuntimeError, OSError) as e:
        _PROBED[kind] = str(e)
        raise
    _PROBED[kind] = ""
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
        atexit.register(self.close)

    def _auto(self) -> _LocalClient:
        with _PROBE_LOCK:
            order = ["namespaces", "bwrap"]
            for kind in order:
                if _PROBED.get(kind):  # failed before in this process: do not pay for it again
                    continue
                if kind == "namespaces" and os.geteuid() != 0:
                    _PROBED[kind] = "needs root (CAP_SYS_ADMIN)"
                    continue
                if kind == "bwrap" and shutil.which("bwrap") is None:
                    _PROBED[kind] = "bwrap not installed"
                    continue
                try:
                    return _start_local(kind, self.config)
                except (RuntimeError, OSError):
                    continue
        reasons = "; ".join(f"{k}: {v}" for k, v in _PROBED.items() if v)
        raise RuntimeError(
            "no sandbox backend works on this host ("
            + reasons
            + "). Run as root, install bubblewrap "
            "with unprivileged user namespaces, point AGENTGRPO_SANDBOX_URL at a `agentgrpo serve-sandbox`, "
            "or pass backend='unsafe-local' for trusted code only."
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
    ) -> ExecResult:
        """Run `code` as a Python program (`__main__`, cwd = its scratch dir holding `files`)."""
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
                res = fut.result()
            if res.status != "sandbox_error":
                return res
        return res

    async def arun(
        self,
        code: str | bytes,
        *,
        stdin: bytes | str = b"",
        files: Mapping[str, str | bytes] | None = None,
        limits: Limits | None = None,
    ) -> ExecResult:
        """Async `run`: awaits the result without blocking the event loop."""
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
                res = await asyncio.wrap_future(self._impl.submit(code_b, stdin_b, files_l, limits))
            if res.status != "sandbox_error":
                return res
        return res

    def close(self) -> None:
        self._impl.close()

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_DEFAULT: Sandbox | None = None
_DEFAULT_LOCK = threading.Lock()


def default_sandbox() -> Sandbox:
    """A process-wide `Sandbox()` created on first use (verifiers and tools share it)."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            _DEFAULT = Sandbox()
        return _DEFAULT
