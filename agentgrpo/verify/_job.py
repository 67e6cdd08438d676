"""The supervisor's side of one running job: its pipes, capped output, status, and typed end.

Separate from `_supervisor.py`, which manages slots (pre-starting, handing out and recycling them)
and the connection to the client: this module is one job from the payload write to a classified
result, and knows nothing of slots, launchers or cgroups (the supervisor tells `_classify` whether
the slot's cgroup saw an OOM kill).

Stdlib only, like the supervisor that imports it (as a top-level module when the supervisor runs
as a plain script).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal


class _Job:
    """The supervisor's side of one running job: its pipes, deadline and output buffers."""

    def __init__(self, loop: asyncio.AbstractEventLoop, lim: dict) -> None:
        self.loop, self.lim = loop, lim
        self.cap = lim["output_bytes"]
        self.out, self.err = bytearray(), bytearray()
        self.truncated = False
        self.killed_for: str | None = None
        self.open_streams = 0
        self.done = loop.create_future()  # init exited, or it reported and the streams closed
        self.streams_closed = loop.create_future()
        self.fds: set[int] = set()  # pipe ends this job still owns
        self.status: list[dict] = []
        self.final = False  # the init reported the job's end (wstatus or timeout)
        self._status_buf = bytearray()
        self._status_fd = -1
        self._pidfd: int | None = None
        self._init_exited = False

    def _check_done(self) -> None:
        if not self.done.done() and (self._init_exited or (self.final and self.open_streams == 0)):
            self.done.set_result(None)

    def watch_init(self, pidfd: int) -> None:
        def on_exit() -> None:
            self.loop.remove_reader(pidfd)
            self._init_exited = True
            self._check_done()

        self.loop.add_reader(pidfd, on_exit)
        self._pidfd = pidfd

    def read_status(self, fd: int) -> None:
        self._status_fd = fd
        self.fds.add(fd)
        self.loop.add_reader(fd, self.drain_status)

    def drain_status(self) -> None:
        """Collect the init's JSON lines; the job may end before its init does (see `done`)."""
        fd = self._status_fd
        while fd in self.fds:
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:
                break
            if not chunk:
                self._close_fd(fd)
                break
            self._status_buf.extend(chunk)
        *lines, rest = bytes(self._status_buf).split(b"\n")
        self._status_buf = bytearray(rest)
        for line in lines:
            try:
                d = json.loads(line)
            except ValueError:
                d = {"error": "garbled status from the sandbox"}
            self.status.append(d)
            self.final = self.final or "wstatus" in d or "timeout" in d
        self._check_done()

    def _close_fd(self, fd: int) -> None:
        if fd in self.fds:
            self.fds.discard(fd)
            self.loop.remove_reader(fd)
            self.loop.remove_writer(fd)
            os.close(fd)

    def close(self) -> None:
        for fd in list(self.fds):
            self._close_fd(fd)
        if self._pidfd is not None and not self._init_exited:
            self.loop.remove_reader(self._pidfd)

    def read_stream(self, fd: int, buf: bytearray, on_over) -> None:
        self.open_streams += 1
        self.fds.add(fd)

        def on_readable() -> None:
            try:
                data = os.read(fd, 1 << 16)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                self._close_fd(fd)
                self.open_streams -= 1
                if self.open_streams == 0 and not self.streams_closed.done():
                    self.streams_closed.set_result(None)
                self._check_done()
                return
            room = self.cap - len(buf)
            if len(data) > room:
                buf.extend(data[: max(room, 0)])
                self.truncated = True
                on_over()
            else:
                buf.extend(data)

        self.loop.add_reader(fd, on_readable)

    def write_all(self, fd: int, data: bytes) -> None:
        view = memoryview(data)
        self.fds.add(fd)

        def on_writable() -> None:
            nonlocal view
            try:
                n = os.write(fd, view[: 1 << 16])
                view = view[n:]
            except BlockingIOError:
                return
            except OSError:  # the job closed its end or died: stop feeding it
                view = view[:0]
            if not view:
                self._close_fd(fd)

        if not data:
            self._close_fd(fd)
            return
        on_writable()  # usually all of it fits in the pipe at once: no loop round trip
        if fd in self.fds:
            self.loop.add_writer(fd, on_writable)


def _classify(job: _Job, status: list[dict], oom: bool) -> dict:
    """Map what happened to (status, exit_code, signal, detail); precedence matters here."""
    errors = [s["error"] for s in status if "error" in s]
    final = next((s for s in status if "wstatus" in s or "timeout" in s), None)
    res = {
        "exit_code": None,
        "signal": None,
        "detail": "",
        "cpu_s": final.get("cpu_s") if final else None,
        "maxrss_kb": final.get("maxrss_kb") if final else None,
    }
    if final is not None and "wstatus" in final:
        st = final["wstatus"]
        if os.WIFEXITED(st):
            res["exit_code"] = os.WEXITSTATUS(st)
        elif os.WIFSIGNALED(st):
            res["signal"] = os.WTERMSIG(st)
    if job.killed_for == "cancelled":  # nobody waits for this answer but the slot's bookkeeping
        return dict(res, status="sandbox_error", detail="cancelled: its caller gave up")
    if job.killed_for == "output":
        return dict(res, status="output_limit", detail="output cap reached")
    if job.killed_for == "timeout" or (final is not None and final.get("timeout")):
        return dict(res, status="timeout", detail="wall-clock limit")
    if errors:
        return dict(res, status="sandbox_error", detail="; ".join(errors))
    if oom:
        return dict(res, status="memory_limit", detail="cgroup OOM kill")
    if final is None:
        return dict(res, status="sandbox_error", detail="no exit status from the sandbox init")
    if res["signal"] is not None:
        if res["signal"] == signal.SIGXCPU:
            return dict(res, status="timeout", detail="CPU-time limit")
        return dict(res, status="signaled", detail=_signal_name(res["signal"]))
    if res["exit_code"] == 0:
        return dict(res, status="ok")
    tail = bytes(job.err[-2048:]).rstrip().rsplit(b"\n", 1)[-1]
    if tail.startswith(b"MemoryError"):
        return dict(res, status="memory_limit", detail="MemoryError raised")
    return dict(res, status="runtime_error")


def _signal_name(n: int) -> str:
    """SIGKILL, SIGSEGV, ...; real-time signals (35-63), which the enum does not name, by number."""
    try:
        return signal.Signals(n).name
    except ValueError:
        return f"signal {n}"
