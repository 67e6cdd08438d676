"""The trainer's end of a sandbox session (`session.py`): starting its process (the namespaces
host or bubblewrap, the handshake) and the connection that carries its calls and their answers.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING

from agentgrpo.types import InfrastructureError
from agentgrpo.verify import _frames, _seccomp
from agentgrpo.verify._launchers import bwrap_jail, python_paths
from agentgrpo.verify._local_client import _recv_exact
from agentgrpo.verify._runner import CLEAN_ENV

if TYPE_CHECKING:
    from agentgrpo.verify.session import SessionLimits, WorkspaceMount

_VERIFY_DIR = os.path.dirname(os.path.abspath(__file__))
_JAIL_VERIFY_DIR = "/.agentgrpo-verify"  # where a bwrap session sees this folder (read-only)
_MARGIN_S = 10.0  # beyond a call's own limit before the session counts as hung


class SessionError(InfrastructureError):
    """The session could not start, died or hung: not the model's doing (unscorable)."""


class _Conn:
    """The trainer's end of a session: its process, its socket and a reader thread that hands each
    answer to the future of its call."""

    def __init__(self, proc: subprocess.Popen, sock: socket.socket, backend: str) -> None:
        self.proc, self.sock, self.backend = proc, sock, backend
        self.lock, self.send_lock = threading.Lock(), threading.Lock()
        self.pending: dict[int, tuple[Future, float]] = {}
        self.next_id = 0
        self.busy_until = 0.0
        self.dead: str | None = None
        self.reader = threading.Thread(target=self._read, name="agentgrpo-session", daemon=True)

    def request(self, header: dict, blobs: list[bytes], budget_s: float) -> tuple[int, Future]:
        fut: Future = Future()
        with self.lock:
            if self.dead is not None:
                fut.set_exception(SessionError(f"the session is gone: {self.dead}"))
                return 0, fut
            self.next_id += 1
            jid = self.next_id
            # calls run one at a time in the session: this one's clock starts after those ahead
            self.busy_until = max(time.monotonic(), self.busy_until) + budget_s + _MARGIN_S
            self.pending[jid] = (fut, self.busy_until)
        self.send(_frames.pack(dict(header, id=jid), blobs))
        return jid, fut

    def send(self, frame: bytes) -> None:
        try:
            with self.send_lock:
                self.sock.sendall(frame)
        except OSError as e:
            self.fail(f"cannot reach the session: {e}")

    def _read(self) -> None:
        buf = bytearray()
        while True:
            try:
                chunk = self.sock.recv(1 << 20)
            except TimeoutError:
                chunk = None
            except OSError:
                chunk = b""
            if chunk == b"":  # the init exited: its host cleans up and exits by itself
                self.fail("the session's process exited", kill=False)
                return
            if chunk:
                buf += chunk
            while len(buf) >= 4 and len(buf) >= 4 + struct.unpack_from("!I", buf)[0]:
                (n,) = struct.unpack_from("!I", buf)
                header, blobs = _frames.unpack(bytes(buf[4 : 4 + n]))
                del buf[: 4 + n]
                with self.lock:
                    entry = self.pending.pop(header.get("id"), None)
                if entry is not None and not entry[0].done():
                    entry[0].set_result((header, blobs))
            with self.lock:
                late = any(d < time.monotonic() for _, d in self.pending.values())
            if late:
                self.fail("a call passed its time limit without an answer: the session hung")
                return

    def fail(self, why: str, kill: bool = True) -> None:
        """Fail every waiting call; `kill`: stop the session's process too (it hung). Without,
        its host is left to reap its init and remove its cgroups (`close_sync` waits for it)."""
        with self.lock:
            self.dead = self.dead or why
            waiting = list(self.pending.values())
            self.pending.clear()
        for fut, _ in waiting:
            if not fut.done():
                fut.set_exception(SessionError(f"{why} (backend {self.backend})"))
        if kill:
            _stop(self.proc)


def _stop(proc: subprocess.Popen, grace_s: float = 0.0) -> None:
    try:
        proc.wait(grace_s)
        return
    except subprocess.TimeoutExpired:
        proc.kill()
    proc.wait()


def _recv_frame(sock: socket.socket) -> tuple[dict, list[bytes]]:
    (n,) = struct.unpack("!I", _recv_exact(sock, 4))
    return _frames.unpack(_recv_exact(sock, n))


def _launch(
    backend: str,
    python: str,
    ro_paths: Sequence[str],
    mount: WorkspaceMount,
    limits: SessionLimits,
    cfg: dict,
) -> tuple[subprocess.Popen, socket.socket]:
    """Start the session's process (its host under namespaces, bubblewrap under bwrap) and
    return it with the trainer's end of its socket."""
    ours, theirs = socket.socketpair()
    boot = (
        "import sys; sys.path.append(sys.argv[1]); import _session_boot; "
        "sys.exit(_session_boot.main(sys.argv[2:]))"
    )
    where = _JAIL_VERIFY_DIR if backend == "bwrap" else _VERIFY_DIR
    tail = [python, "-I", "-c", boot, where, backend, json.dumps(cfg), str(theirs.fileno())]
    jail, extra_fds = (
        _bwrap_jail(python, ro_paths, mount, limits) if backend == "bwrap" else ([], [])
    )
    try:
        proc = subprocess.Popen(
            [*jail, *tail],
            pass_fds=[theirs.fileno(), *extra_fds],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE if backend == "bwrap" else None,
            env=CLEAN_ENV,
            cwd="/",
        )
    finally:
        theirs.close()
        for fd in extra_fds:
            os.close(fd)
    return proc, ours


def _handshake(proc: subprocess.Popen, sock: socket.socket, backend: str, timeout_s: float) -> dict:
    """Wait for the host's frame (namespaces) and the init's hello; the host's frame. Raises
    SessionError, with bubblewrap's own message where it has one, when the session did not
    come up."""
    sock.settimeout(timeout_s)
    try:
        host = _recv_frame(sock)[0] if backend == "namespaces" else {}
        hello, _ = _recv_frame(sock)
    except (OSError, ConnectionError, ValueError, struct.error) as e:
        sock.close()
        _stop(proc, 1.0)
        why = proc.stderr.read().decode(errors="replace")[-500:] if proc.stderr else ""
        raise SessionError(f"the session did not start: {e} {why}".strip()) from None
    if not hello.get("ok"):
        sock.close()
        _stop(proc, 5.0)
        raise SessionError(f"the session did not start: {hello.get('error')}")
    if proc.stderr is not None:  # bwrap's own errors mattered only while it started
        proc.stderr.close()
        proc.stderr = None
    return host


def _bwrap_jail(
    python: str, ro_paths: Sequence[str], mount: WorkspaceMount, limits: SessionLimits
) -> tuple[list[str], list[int]]:
    """bubblewrap's arguments for a session (its fork bound at /workspace, or an empty tmpfs
    there; /tmp a tmpfs; seccomp), and the descriptors it must inherit (the filter's pipe)."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SessionError("bwrap not found (Debian: apt-get install bubblewrap)")
    argv = bwrap_jail(bwrap, [*_python_dirs(python), *ro_paths])
    argv += ["--ro-bind", _VERIFY_DIR, _JAIL_VERIFY_DIR]  # the init's own (public) source
    size = str(limits.disk_mb << 20)
    argv += ["--size", size, "--perms", "1777", "--tmpfs", "/tmp"]
    if mount.kind == "bind":
        argv += ["--bind", mount.path, "/workspace"]
    else:
        argv += ["--size", size, "--perms", "1777", "--tmpfs", "/workspace"]
    fds = []
    if _seccomp.supported():
        r, w = os.pipe()
        os.write(w, _seccomp.build_filter())
        os.close(w)
        argv += ["--seccomp", str(r)]
        fds.append(r)
    return [*argv, "--chdir", "/workspace", "--"], fds


@functools.lru_cache(maxsize=8)
def _python_dirs(python: str) -> tuple[str, ...]:
    return tuple(python_paths(python))


def _child_of(pid: int) -> int | None:
    """The first child of `pid` (bwrap's: the sandbox's own init), read from /proc."""
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        return int(name)
            except (OSError, ValueError, IndexError):
                continue
    return None


def _init_limits(lim: SessionLimits) -> dict:
    """The limits the init applies: cgroup (memory, processes), tmpfs size, rlimits."""
    return {
        "memory_mb": lim.memory_mb,
        "processes": lim.processes,
        "disk_mb": lim.disk_mb,
        "open_files": lim.open_files,
        "cpu_s": int(lim.episode_s) + 1,  # RLIMIT_CPU of each process: a backstop
        # RLIMIT_NPROC counts a uid's processes host-wide and sessions share one uid: the pids
        # cgroup bounds each session; this only stops a runaway across all of them
        "nproc": 64 * lim.processes,
    }


def _session_env(python: str) -> dict[str, str]:
    """The variables every process of a session sees (nothing of the trainer's)."""
    bin_dir = os.path.dirname(python)
    return {
        "PATH": f"{bin_dir}:/usr/local/bin:/usr/bin:/bin",
        "HOME": "/tmp",
        "USER": "sandbox",
        "LOGNAME": "sandbox",
        "TERM": "dumb",
        "PWD": "/workspace",
    }
