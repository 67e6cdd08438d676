"""PID 1 of a sandbox session: the jail that holds one episode's workspace and processes.

`_session_boot.py` starts it: forked by the namespaces host, or directly inside bubblewrap.
The init never runs user code. As root it builds the jail (`_session_jail.py`: cgroups, the
minimal read-only root with the workspace, /tmp, /proc, seccomp), then serves requests one at a
time (`_frames.py`): `run` (one bash for the session: cwd, variables and functions persist),
`python` (one REPL, `_session_repl.py`), `exec` (a fresh process with its own stdout and stderr)
and `close` (kill everything, answer, exit). User processes get their own process group, the
session's uid, rlimits, no_new_privs and the filter. A call past its time or output budget has
its process group killed (a shell or REPL restarts on the next call; files stay). When the init
exits, the kernel kills every process left in its PID namespace.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import selectors
import signal
import socket
import struct
import time

try:
    from . import _runner, _session_jail
    from ._frames import pack, unpack
except ImportError:  # started as a plain script: siblings are top-level modules
    import _runner
    import _session_jail
    from _frames import pack, unpack

_HERE = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(_HERE, "_session_repl.py")) as _f:  # read before pivot_root hides it
    REPL_SOURCE = _f.read()

_GRACE_S = 0.3  # how long output is still read after a process exits (its children may hold it)
_BASH = "/bin/bash"


class _Closing(Exception):
    """A `close` request (or the client's end of the socket closing) arrived mid-call."""


class Init:
    """The session's PID 1: sets the jail up (`setup`), then serves calls (`serve`)."""

    def __init__(self, cfg: dict, sock: socket.socket) -> None:
        self.cfg, self.sock = cfg, sock
        self.privileged = cfg["mode"] == "namespaces"
        self.uid = cfg.get("uid") if self.privileged else None
        self.lim = cfg["limits"]
        self.env = dict(_runner.CLEAN_ENV, **cfg["env"])
        self.inbox = bytearray()
        self.queue: list[tuple[dict, list[bytes]]] = []
        self.current: int | None = None  # id of the call being served
        self.cancelled = False
        self.closing: dict | None = None
        self.exited: dict[int, int] = {}  # pid -> wait status, for the processes we track
        self.tracked: set[int] = set()
        self.shell: tuple[int, int, int] | None = None  # pid, stdin, output
        self.repl: tuple[int, int, int] | None = None  # pid, requests, output
        self.sel = selectors.DefaultSelector()

    # ---- set-up ---------------------------------------------------------------------------------

    def setup(self, cgroup_fds: list[int]) -> None:
        """Join the cgroups, build the jail's root with the workspace, mount /tmp and /proc."""
        _session_jail.setup(self.cfg, self.uid, self.lim, cgroup_fds)

    # ---- the control socket ---------------------------------------------------------------------

    def reply(self, header: dict, blobs: list[bytes]) -> None:
        try:
            self.sock.sendall(pack(header, blobs))
        except OSError:  # the client is gone: the next read of the socket sees it
            pass

    def _read_control(self) -> None:
        """Take what the socket holds: calls are queued; a cancel of the current call or a close
        is acted on (a close raises `_Closing`)."""
        try:
            data = self.sock.recv(1 << 20)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self.closing = self.closing or {"op": "close", "id": None}
            raise _Closing
        self.inbox += data
        while len(self.inbox) >= 4:
            (n,) = struct.unpack_from("!I", self.inbox)
            if len(self.inbox) < 4 + n:
                break
            header, blobs = unpack(bytes(self.inbox[4 : 4 + n]))
            del self.inbox[: 4 + n]
            if header["op"] == "cancel":
                self.cancelled = self.cancelled or header["id"] == self.current
            elif header["op"] == "close":
                self.closing = header
                raise _Closing
            else:
                self.queue.append((header, blobs))

    def _select(self, reads: set[int], writes: set[int], until: float) -> tuple[set, set]:
        """Wait for `reads`/`writes` (or `until`), serving the socket and reaping meanwhile."""
        for fd in reads:
            self.sel.register(fd, selectors.EVENT_READ)
        for fd in writes:
            self.sel.register(fd, selectors.EVENT_WRITE)
        try:
            events = self.sel.select(max(0.0, min(until - time.monotonic(), 1.0)))
        finally:
            for fd in reads | writes:
                self.sel.unregister(fd)
        readable = {k.fd for k, ev in events if ev & selectors.EVENT_READ}
        writable = {k.fd for k, ev in events if ev & selectors.EVENT_WRITE}
        if self.wake_r in readable:
            self._drain_wake()
        self._reap()
        if self.sock.fileno() in readable:
            self._read_control()
        return readable & reads, writable & writes

    def _drain_wake(self) -> None:
        try:
            while os.read(self.wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def _reap(self) -> None:
        """Collect every exited child (we are PID 1: orphans are ours), keeping tracked ones."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid in self.tracked:
                self.exited[pid] = status

    # ---- the loop -------------------------------------------------------------------------------

    def serve(self) -> None:
        """Answer calls one at a time until a close (or the client going away)."""
        self.wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self.sock.setblocking(False)
        self.sel.register(self.wake_r, selectors.EVENT_READ)
        self.sel.register(self.sock.fileno(), selectors.EVENT_READ)
        ops = {"run": self.op_run, "python": self.op_python, "exec": self.op_exec}
        try:
            while True:
                while not self.queue:
                    self._select(set(), set(), time.monotonic() + 1.0)
                header, blobs = self.queue.pop(0)
                self.current, self.cancelled = header["id"], False
                t0 = time.monotonic()
                try:
                    res, out = ops[header["op"]](header, blobs)
                except _Closing:
                    raise
                except (OSError, KeyError, ValueError) as e:  # our failure: the client's error
                    res, out = {"status": "sandbox_error", "detail": f"session: {e!r}"}, []
                res.update(id=header["id"], wall_s=time.monotonic() - t0)
                self.current = None
                self.sock.setblocking(True)
                self.reply(res, out)
                self.sock.setblocking(False)
        except _Closing:
            pass
        self.kill_all()
        if self.closing and self.closing.get("id") is not None:
            self.sock.setblocking(True)
            self.reply({"id": self.closing["id"], "status": "ok"}, [])

    def kill_all(self) -> None:
        """SIGKILL every process of the session but ourselves (kill(-1) spares the caller and,
        in a PID namespace, its init: us), then reap them."""
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            try:
                os.waitpid(-1, 0)
            except ChildProcessError:
                return

    # ---- processes ------------------------------------------------------------------------------

    def spawn(self, argv: list[str], fds: list[int], cwd: str = "/workspace") -> int:
        """Fork a user process with `fds` as its 0, 1, 2, ...; it execs `argv` (PATH searched)."""
        env = self.env
        rl = {
            "wall_s": self.lim["cpu_s"],
            "disk_mb": self.lim["disk_mb"],
            "open_files": self.lim["open_files"],
            "processes": self.lim["nproc"],
            "memory_mb": self.lim["memory_mb"],
        }
        pid = os.fork()
        if pid == 0:
            try:
                os.setsid()
                high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 100) for fd in fds]
                for target, fd in enumerate(high):
                    os.dup2(fd, target)
                os.closerange(len(high), 1 << 16)
                signal.set_wakeup_fd(-1)
                with open("/proc/self/oom_score_adj", "w") as f:
                    f.write("1000")  # the cgroup's OOM killer takes user processes, not the init
                for sig in (signal.SIGCHLD, signal.SIGPIPE, signal.SIGXFSZ):
                    signal.signal(
                        sig, signal.SIG_DFL
                    )  # Python ignores the last two; exec keeps that
                if self.uid is not None:
                    os.setgroups([])
                    os.setresgid(self.uid, self.uid, self.uid)
                    os.setresuid(self.uid, self.uid, self.uid)
                _runner.apply_rlimits(rl, address_space=not self.cfg["memory_cgroup"])
                os.chdir(cwd)
                os.execvpe(argv[0], argv, env)
            except BaseException as e:  # noqa: BLE001 - say why on its stderr, then die
                try:
                    os.write(2, f"session: cannot start {argv[0]}: {e}\n".encode())
                finally:
                    os._exit(127)
        self.tracked.add(pid)
        return pid

    def kill_group(self, pid: int) -> None:
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
        deadline = time.monotonic() + 2.0
        while pid not in self.exited and time.monotonic() < deadline:
            self._select(set(), set(), time.monotonic() + 0.05)

    def forget(self, pid: int) -> int | None:
        self.tracked.discard(pid)
        return self.exited.pop(pid, None)

    def collect(
        self,
        pid: int,
        outs: list[int],
        req: dict,
        marker: bytes | None = None,
        writes: dict[int, bytes] | None = None,
        keep_open: frozenset = frozenset(),
    ):
        """Read `outs` (and feed `writes`) until `marker` shows in the first output, or `pid` has
        exited and its outputs closed; the outputs and why it stopped early (timeout, output,
        cancelled), or None."""
        deadline = time.monotonic() + req["timeout_s"]
        cap = req["output_bytes"]
        bufs = {fd: bytearray() for fd in outs}
        open_, pending = set(outs), {fd: memoryview(b) for fd, b in (writes or {}).items()}
        exited_at = None
        while True:
            if marker is not None and marker in bufs[outs[0]]:
                return bufs, None
            if pid in self.exited:
                exited_at = exited_at or time.monotonic()
                if not open_ or time.monotonic() > exited_at + _GRACE_S:
                    return bufs, None
            if self.cancelled:
                return bufs, "cancelled"
            if time.monotonic() >= deadline:
                return bufs, "timeout"
            until = deadline if exited_at is None else min(deadline, exited_at + _GRACE_S)
            readable, writable = self._select(open_, set(pending), until)
            for fd in writable:
                try:
                    n = os.write(fd, pending[fd][: 1 << 16])
                    pending[fd] = pending[fd][n:]
                except BlockingIOError:
                    continue
                except OSError:  # it closed its end: nothing more to feed it
                    pending[fd] = pending[fd][:0]
                if not pending[fd]:
                    del pending[fd]
                    if fd not in keep_open:
                        os.close(fd)
            for fd in readable:
                try:
                    data = os.read(fd, 1 << 16)
                except BlockingIOError:
                    continue
                if not data:
                    open_.discard(fd)
                    continue
                bufs[fd] += data
                if len(bufs[fd]) > cap + (len(marker) + 24 if marker else 0):
                    return bufs, "output"

    # ---- the calls ------------------------------------------------------------------------------

    def _pipes(self, n: int) -> list[tuple[int, int]]:
        return [os.pipe2(os.O_CLOEXEC) for _ in range(n)]

    def _start_shell(self) -> None:
        (in_r, in_w), (out_r, out_w) = self._pipes(2)
        pid = self.spawn([_BASH, "--noprofile", "--norc"], [in_r, out_w, out_w])
        os.close(in_r)
        os.close(out_w)
        os.set_blocking(in_w, False)
        os.set_blocking(out_r, False)
        self.shell = (pid, in_w, out_r)

    def _start_repl(self) -> None:
        (req_r, req_w), (out_r, out_w) = self._pipes(2)
        null = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
        pid = self.spawn([self.cfg["python"], "-c", REPL_SOURCE], [null, out_w, out_w, req_r])
        for fd in (null, req_r, out_w):
            os.close(fd)
        os.set_blocking(req_w, False)
        os.set_blocking(out_r, False)
        self.repl = (pid, req_w, out_r)

    def _stop(self, which: str) -> None:
        proc = getattr(self, which)
        if proc is None:
            return
        pid, w, r = proc
        self.kill_group(pid)
        self.forget(pid)
        os.close(w)
        os.close(r)
        setattr(self, which, None)

    def _interactive(self, which: str, req: dict, payload: bytes, nonce: bytes) -> tuple:
        """One call to the shell or the REPL: feed it, read up to the end marker."""
        if getattr(self, which) is None:
            self._start_shell() if which == "shell" else self._start_repl()
        pid, w, r = getattr(self, which)
        marker = b"\n" + nonce + b" "
        bufs, stop = self.collect(pid, [r], req, marker, {w: payload}, frozenset([w]))
        out = bytes(bufs[r])
        res = {"exit_code": None, "signal": None, "detail": ""}
        if stop is None and marker in out:
            out, _, tail = out.partition(marker)
            word = tail.split(b"\n", 1)[0].decode()
            res.update(_word_status(word))
        else:
            status = self.exited.get(pid)
            res.update(_stop_status(stop, status))
            what = "shell" if which == "shell" else "Python REPL"
            res["detail"] = (res["detail"] + "; " if res["detail"] else "") + (
                f"the {what} was stopped: the next call starts a new one (files are kept, "
                "its variables are not)"
            )
            self._stop(which)
        cap = req["output_bytes"]
        res["truncated"] = len(out) > cap
        return res, [out[:cap], b""]

    def op_run(self, req: dict, blobs: list[bytes]) -> tuple:
        nonce = ("__AGENTGRPO_" + secrets.token_hex(12)).encode()
        cmd = blobs[0]
        script = (
            b"IFS= read -r -d '' __agentgrpo_cmd <<'"
            + nonce
            + b"'\n"
            + cmd
            + b"\n"
            + nonce
            + b"\neval \"$__agentgrpo_cmd\" </dev/null; printf '\\n%s %d\\n' '"
            + nonce
            + b'\' "$?"\n'
        )
        return self._interactive("shell", req, script, nonce)

    def op_python(self, req: dict, blobs: list[bytes]) -> tuple:
        nonce = "__AGENTGRPO_" + secrets.token_hex(12)
        body = json.dumps({"nonce": nonce, "code": blobs[0].decode("utf-8", "replace")}).encode()
        return self._interactive("repl", req, struct.pack("!I", len(body)) + body, nonce.encode())

    def op_exec(self, req: dict, blobs: list[bytes]) -> tuple:
        (in_r, in_w), (out_r, out_w), (err_r, err_w) = self._pipes(3)
        pid = self.spawn(req["argv"], [in_r, out_w, err_w], req.get("cwd") or "/workspace")
        for fd in (in_r, out_w, err_w):
            os.close(fd)
        for fd in (in_w, out_r, err_r):
            os.set_blocking(fd, False)
        writes = {in_w: blobs[0]} if blobs and blobs[0] else {}
        if not writes:
            os.close(in_w)
        try:
            bufs, stop = self.collect(pid, [out_r, err_r], req, None, writes)
        finally:
            if in_w in writes and _is_open(in_w):
                os.close(in_w)
        if stop is not None or pid not in self.exited:
            self.kill_group(pid)
        status = self.forget(pid)
        os.close(out_r)
        os.close(err_r)
        res = {"exit_code": None, "signal": None, "detail": ""}
        res.update(_stop_status(stop, status))
        cap = req["output_bytes"]
        out, err = bytes(bufs[out_r]), bytes(bufs[err_r])
        res["truncated"] = len(out) > cap or len(err) > cap
        return res, [out[:cap], err[:cap]]


def _is_open(fd: int) -> bool:
    try:
        fcntl.fcntl(fd, fcntl.F_GETFD)
        return True
    except OSError:
        return False


def _word_status(word: str) -> dict:
    """The end marker's word (the shell's `$?`; the REPL's ok | error | exit:N) as a result."""
    if word == "ok":
        return {"status": "ok", "exit_code": 0}
    if word == "error":
        return {"status": "runtime_error", "exit_code": 1}
    code = int(word.removeprefix("exit:"))
    return {"status": "ok" if code == 0 else "runtime_error", "exit_code": code}


def _stop_status(stop: str | None, wstatus: int | None) -> dict:
    """A call that ended without its marker: stopped by us, or its process exited."""
    if stop == "timeout":
        return {"status": "timeout", "detail": "the call's time limit"}
    if stop == "output":
        return {"status": "output_limit", "detail": "the call's output limit"}
    if stop == "cancelled":
        return {"status": "sandbox_error", "detail": "cancelled: its caller gave up"}
    if wstatus is None:
        return {"status": "sandbox_error", "detail": "no exit status"}
    if os.WIFSIGNALED(wstatus):
        sig = os.WTERMSIG(wstatus)
        oom = " (the session's memory limit?)" if sig == signal.SIGKILL else ""
        return {"status": "signaled", "signal": sig, "detail": _signame(sig) + oom}
    code = os.WEXITSTATUS(wstatus)
    return {"status": "ok" if code == 0 else "runtime_error", "exit_code": code}


def _signame(n: int) -> str:
    try:
        return signal.Signals(n).name
    except ValueError:
        return f"signal {n}"


# ---- entry points -------------------------------------------------------------------------------


def _serve_init(cfg: dict, sock: socket.socket, cgroup_fds: list[int], go: int | None) -> int:
    """The init's whole life: set up, say hello (or why not), serve, and exit."""
    init = Init(cfg, sock)
    if go is not None:  # the host has sent its own frame first
        os.read(go, 1)
        os.close(go)
    try:
        if init.privileged:
            init.setup(cgroup_fds)
        os.chdir("/workspace")
    except BaseException as e:  # noqa: BLE001 - any set-up failure is reported, not raised
        init.reply({"op": "hello", "ok": False, "error": f"{type(e).__name__}: {e}"}, [])
        return 1
    init.reply({"op": "hello", "ok": True}, [])
    init.serve()
    return 0
