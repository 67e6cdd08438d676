"""Client end of the local sandbox backends (namespaces / bwrap / unsafe-local): the supervisor.

Separate from `sandbox.py` because it is the trainer's half of the supervisor protocol: it starts
(and restarts) the supervisor process (`_supervisor.py`) over a socketpair, sends jobs as
`_supervisor.pack` frames, queues what does not fit in the free slots and enforces the client's
deadline. The `Sandbox` facade only chooses a client and retries.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING

from agentgrpo.deadlines import start_wait
from agentgrpo.verify import _supervisor
from agentgrpo.verify._records import ExecResult, Limits, sandbox_error

if TYPE_CHECKING:
    from agentgrpo.verify.sandbox import SandboxConfig

_VERIFY_DIR = os.path.dirname(os.path.abspath(__file__))


class _LocalClient:
    """Client end of a supervisor process (`_supervisor.py`) for the namespaces / bwrap / unsafe
    backends.

    Dispatches at most `slots` jobs at a time, so a dispatched job starts at once and its deadline
    (wall_s + margin) is meaningful; the rest wait in a local queue. A supervisor that dies or
    misses a deadline is killed; its jobs come back as sandbox_error and the next call starts a new
    one.
    """

    def __init__(self, kind: str, cfg: SandboxConfig) -> None:
        self.kind, self.cfg = kind, cfg
        self.slots = cfg.slots or max(4, 4 * (os.cpu_count() or 1))
        self.python = cfg.python or _base_python()
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._queue: deque[tuple[int, bytes, float, Future, Callable[[], None]]] = deque()
        self._inflight: dict[int, tuple[Future, float]] = {}
        self._next = 0
        self._proc: subprocess.Popen | None = None
        self._sock: socket.socket | None = None
        self._closed = False
        self._starting = False  # a `_restart` thread is bringing a new supervisor up
        self._stopping: set[subprocess.Popen] = set()  # being killed by a `_drop`, outside `_lock`
        self.info: dict = {}
        self._start()

    def _start(self) -> None:
        """Start a supervisor and its reader thread; raises RuntimeError when it does not come up.
        Blocks up to `start_timeout_s` without holding `_lock`, and `_pump` runs a restart in a
        `_restart` thread of its own, so no submit (from an event loop, say) waits on it."""
        proc, sock, info = self._connect()
        with self._lock:
            closed = self._closed
            if not closed:
                self._proc, self._sock, self.info = proc, sock, info
        if closed:  # closed while it started
            sock.close()
            _kill(proc, grace_s=5.0)
            return
        threading.Thread(
            target=self._reader, args=(sock,), name=f"sandbox-{self.kind}", daemon=True
        ).start()

    def _connect(self) -> tuple[subprocess.Popen, socket.socket, dict]:
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
        boot = (
            "import sys; sys.path.append(sys.argv[1]); import _supervisor; "
            "sys.exit(_supervisor.main(sys.argv[1:]))"
        )
        proc = subprocess.Popen(
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
            _kill(proc)
            raise RuntimeError(f"{self.kind} sandbox backend unavailable: {hello.get('error')}")
        ours.settimeout(0.25)
        return proc, ours, {k: hello[k] for k in ("backend", "slots", "features")}

    def _restart(self) -> None:
        try:
            self._start()
        except Exception as e:  # cannot restart: fail what waits, retry on the next submit
            with self._lock:
                self._starting = False
                self._fail_queued(f"{self.kind} sandbox restart failed: {e!r}")
            return
        with self._lock:
            self._starting = False
        self._pump()

    @staticmethod
    def _recv(sock: socket.socket) -> tuple[dict, list[bytes]]:
        (n,) = struct.unpack("!I", _recv_exact(sock, 4))
        return _supervisor.unpack(_recv_exact(sock, n))

    def submit(
        self, code: bytes, stdin: bytes, files: list[tuple[str, bytes]], limits: Limits
    ) -> Future:
        """Queue a job. Inside a tool call, its time in the queue is a wait
        (`deadlines.start_wait`), which ends when it leaves the queue for a slot, or when it is
        answered without one."""
        fut: Future = Future()
        stop_wait = start_wait()
        fut.add_done_callback(lambda _: stop_wait())  # whatever path answers it
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
            self._queue.append(
                (self._next, frame, limits.wall_s + self.cfg.margin_s, fut, stop_wait)
            )
        self._pump()
        return fut

    def abandon(self, fut: Future) -> None:
        """Its caller no longer waits for `fut` (an awaiting `arun` was cancelled, e.g. by a tool's
        deadline): a queued job is never sent, a running one is killed, so its slot is free long
        before its wall limit. The slot stays counted until the supervisor answers."""
        if fut.cancel():  # still queued: `_pump` skips it
            return
        with self._lock:
            jid = next((j for j, (f, _) in self._inflight.items() if f is fut), None)
            sock = self._sock
        if jid is None or sock is None:  # answered already, or the supervisor is gone
            return
        try:
            with self._send_lock:
                _send(sock, _supervisor.pack({"op": "cancel", "id": jid}, []))
        except OSError:  # supervisor gone; the reader thread fails in-flight jobs
            self._drop(sock, "supervisor connection lost")

    def _pump(self) -> None:
        """Send queued jobs while slots are free (restarting the supervisor, in a thread of its
        own, if it is gone)."""
        while True:
            with self._lock:
                if not self._queue or len(self._inflight) >= self.slots or self._closed:
                    return
                if self._sock is None:
                    if not self._starting:
                        self._starting = True
                        threading.Thread(
                            target=self._restart, name=f"sandbox-{self.kind}-start", daemon=True
                        ).start()
                    return
                jid, frame, budget, fut, stop_wait = self._queue.popleft()
                # A future is cancellable until it runs (an awaiting `arun` cancelled by a deadline
                # cancels it); once running it is not, so the reader's set_result cannot fail.
                running = fut.set_running_or_notify_cancel()
                stop_wait()
                if not running:
                    continue  # its caller gave up while it queued: never sent
                self._inflight[jid] = (fut, time.monotonic() + budget)
                sock = self._sock
                # Taken before `_lock` is let go, so an `abandon` that finds `jid` in flight sends
                # its cancel after this frame: the supervisor ignores a cancel for an unknown id.
                self._send_lock.acquire()
            try:
                _send(sock, frame)
                lost = False
            except OSError:  # supervisor gone; the reader thread fails in-flight jobs
                lost = True
            finally:
                self._send_lock.release()
            if lost:
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
                    try:
                        res = _result_from(header, blobs)
                    except (
                        KeyError,
                        TypeError,
                        ValueError,
                    ) as e:  # one bad frame must not stop the reader
                        res = sandbox_error(
                            f"bad result frame from the supervisor: {e!r}", self.kind
                        )
                    entry[0].set_result(res)
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
            proc, self._proc = self._proc, None
            if proc is not None:
                self._stopping.add(proc)
        if proc is not None:  # outside `_lock`: a submit from an event loop does not wait on it
            _kill(proc, grace_s=5.0 if why == "sandbox closed" else 0.5)
            with self._lock:
                self._stopping.discard(proc)
        for fut, _ in failed:
            fut.set_result(sandbox_error(why, self.kind))
        self._pump()

    def _fail_queued(self, why: str) -> None:
        """Answer every queued job with a sandbox_error (call with `_lock` held)."""
        waiting = list(self._queue)
        self._queue.clear()
        for _, _, _, fut, stop_wait in waiting:
            stop_wait()
            if fut.set_running_or_notify_cancel():
                fut.set_result(sandbox_error(why, self.kind))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            sock = self._sock
            self._fail_queued("sandbox closed")  # queued jobs would otherwise wait forever
        if sock is not None:
            self._drop(sock, "sandbox closed")
        with self._lock:
            stopping = list(self._stopping)
        for (
            proc
        ) in stopping:  # another thread's `_drop` is still stopping it: do not leave it behind
            _kill(proc, grace_s=0.5)


_SEND_STALL_S = 30.0


def _send(sock: socket.socket, frame: bytes) -> None:
    """`sock.sendall(frame)` without the socket's 0.25 s timeout (the reader's polling interval)
    as its bound: a supervisor busy for a moment must not be dropped because a big frame, or
    several, did not fit its socket buffer in 0.25 s. Raises OSError once nothing went out for
    `_SEND_STALL_S`, or when the socket is closed (a hung supervisor, dropped by the deadline
    check); a timed-out `send` sent nothing, so the frame stays whole."""
    view, stalled = memoryview(frame), None
    while view:
        try:
            n = sock.send(view)
        except TimeoutError:
            stalled = stalled or time.monotonic()
            if time.monotonic() - stalled > _SEND_STALL_S:
                raise
            continue
        view, stalled = view[n:], None


def _kill(proc: subprocess.Popen, grace_s: float = 0.5) -> None:
    """Stop `proc`: wait for it (it exits on EOF), then SIGTERM, then SIGKILL."""
    for stop in (None, proc.terminate, proc.kill):
        if stop is not None:
            stop()
        try:
            proc.wait(grace_s)
            return
        except subprocess.TimeoutExpired:
            continue
    proc.wait()


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
