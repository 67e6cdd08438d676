"""How the supervisor starts a job, per backend: the fork server, or a fresh interpreter.

A launcher starts a job up to the point where it waits for its payload and returns a handle
holding a pidfd of the process whose exit ends the job (the PID-1 init, bwrap, or the runner).
`kill` takes the whole job down; `reap` collects what the supervisor itself forked.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile

try:
    from . import _runner, _seccomp
    from ._cgroups import Cgroups
except ImportError:  # started as a plain script: siblings are top-level modules
    import _runner
    import _seccomp
    from _cgroups import Cgroups

CLEAN_ENV = _runner.CLEAN_ENV


class LaunchError(Exception):
    """The sandbox could not start a job (an infrastructure failure, never the job's fault)."""


class ForkServerLauncher:
    """Jobs are forks of the fork server (see `_forkserver.py`); the strongest backend."""

    name = "namespaces"

    def __init__(self, cfg: dict, cgroups: Cgroups, verify_dir: str) -> None:
        self.cfg, self.cg, self.verify_dir = cfg, cgroups, verify_dir
        self.proc: subprocess.Popen | None = None
        self.sock: socket.socket | None = None
        self.pending: dict[int, asyncio.Future] = {}
        self.next_id = 0
        self.features: list[str] = []

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        slots = self.cfg["slots"]
        fs_cfg = {
            "slots": slots,
            "uid_base": self.cfg["job_uid_base"],
            "init_uid": self.cfg["init_uid"],
            "cgroup_procs": [self.cg.procs_paths(i) for i in range(slots)],
            "memory_cgroup": self.cg.memory,
            "ro_paths": self.cfg["ro_paths"],
            "preimport": self.cfg["preimport"],
        }
        boot = (
            "import sys; sys.path.append(sys.argv[1]); import _forkserver; "
            "sys.exit(_forkserver.main(sys.argv[2:]))"
        )
        self.proc = subprocess.Popen(
            [
                self.cfg["python"],
                "-I",
                "-c",
                boot,
                self.verify_dir,
                json.dumps(fs_cfg),
                str(theirs.fileno()),
            ],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            env=CLEAN_ENV,
            cwd="/",
        )
        theirs.close()
        ours.setblocking(False)
        try:
            msg = await asyncio.wait_for(loop.sock_recv(ours, 1 << 16), 60)
        except asyncio.TimeoutError:
            msg = b""
        hello = json.loads(msg) if msg else {"ready": False, "error": "fork server exited at start"}
        if not hello.get("ready"):
            ours.close()
            self.proc.kill()
            self.proc.wait()
            raise LaunchError(hello.get("error", "fork server failed"))
        self.sock = ours
        loop.add_reader(ours.fileno(), self._on_reply)
        self.features = [
            "namespaces(mnt,pid,ipc,uts,net)",
            "pivot_root",
            "per-slot-uid",
            "rlimits",
            "no_new_privs",
        ]
        self.features += ["seccomp"] if hello.get("seccomp") else []
        self.features += self.cg.features

    def _on_reply(self) -> None:
        while True:
            try:
                msg, fds, _, _ = socket.recv_fds(self.sock, 1 << 16, 2)
            except BlockingIOError:
                return
            except OSError:
                msg, fds = b"", []
            if not msg:  # the fork server died: fail waiting launches, restart on next use
                asyncio.get_running_loop().remove_reader(self.sock.fileno())
                self.sock.close()
                self.sock = None
                for fut in self.pending.values():
                    if not fut.done():
                        fut.set_exception(LaunchError("fork server died"))
                self.pending.clear()
                if self.proc is not None:
                    self.proc.kill()
                    self.proc.wait()
                    self.proc = None
                return
            rep = json.loads(msg)
            fut = self.pending.pop(rep["id"], None)
            if fut is None or fut.done():
                for fd in fds:
                    os.close(fd)
            elif "error" in rep or not fds:
                fut.set_exception(LaunchError(rep.get("error", "no pidfd")))
            else:
                fut.set_result(fds[0])

    async def launch(self, slot: int, lim: dict, fds: list[int]) -> dict:
        if self.sock is None:
            await self.start()
        self.next_id += 1
        fut = asyncio.get_running_loop().create_future()
        self.pending[self.next_id] = fut
        socket.send_fds(
            self.sock, [json.dumps({"id": self.next_id, "slot": slot, "limits": lim}).encode()], fds
        )
        pidfd = await fut
        return {"pidfd": pidfd, "pid": None}

    def reap(self, handle: dict) -> None:
        """Nothing to do: the fork server is the parent of every init and reaps them."""

    def kill(self, handle: dict, slot: int) -> None:
        try:
            signal.pidfd_send_signal(handle["pidfd"], signal.SIGKILL)
        except OSError:
            pass
        self.cg.kill(slot)

    def close(self) -> None:
        if self.sock is not None:
            try:
                asyncio.get_running_loop().remove_reader(self.sock.fileno())
            except RuntimeError:
                pass
            self.sock.close()
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()


def bwrap_jail(bwrap: str, ro_paths: list[str]) -> list[str]:
    """bubblewrap's arguments for the jail every job and session shares: all namespaces, no
    capabilities, a clean environment, the host's /usr and /lib* and `ro_paths` read-only, /proc
    and /dev; the caller adds /tmp (and a session its /workspace), then the command."""
    argv = [
        bwrap,
        "--unshare-all",
        "--die-with-parent",
        "--new-session",
        *(["--unshare-user", "--uid", "65534", "--gid", "65534"] if os.geteuid() == 0 else []),
        "--cap-drop",
        "ALL",
        "--clearenv",
        "--hostname",
        "sandbox",
    ]
    for k, v in CLEAN_ENV.items():
        argv += ["--setenv", k, v]
    for name in ("usr", "bin", "lib", "lib32", "lib64", "libx32", "sbin"):
        host = "/" + name
        if os.path.islink(host):
            argv += ["--symlink", os.readlink(host), host]
        elif os.path.isdir(host):
            argv += ["--ro-bind", host, host]
    for p in ro_paths:
        argv += ["--ro-bind-try", p, p]
    for p in ("/etc/ld.so.cache", "/etc/localtime"):
        argv += ["--ro-bind-try", p, p]
    return argv + ["--proc", "/proc", "--dev", "/dev"]


def python_paths(python: str) -> list[str]:
    """The directories an interpreter needs: its prefixes and its own directory."""
    out = subprocess.run(
        [python, "-I", "-c", "import sys; print(sys.prefix); print(sys.base_prefix)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return sorted({os.path.realpath(p) for p in out + [os.path.dirname(os.path.realpath(python))]})


def _world_readable(path: str) -> bool:
    """True if any uid may execute `path` (every parent directory searchable by others)."""
    path = os.path.realpath(path)
    parts = path.split("/")
    for i in range(2, len(parts)):
        if not os.stat("/".join(parts[:i])).st_mode & 0o001:
            return False
    return bool(os.stat(path).st_mode & 0o005 == 0o005)


class SubprocessLauncher:
    """A fresh interpreter per job, inside bubblewrap (`bwrap`) or nothing (`unsafe-local`)."""

    def __init__(self, kind: str, cfg: dict, cgroups: Cgroups) -> None:
        self.name, self.cfg, self.cg = kind, cfg, cgroups
        with open(_runner.__file__) as f:
            self.runner_src = f.read() + "\nstandalone_main()\n"
        self.python = cfg["python"]
        self.python_world_readable = _world_readable(self.python)
        self.features = ["rlimits"]
        self.seccomp = None
        if kind == "bwrap":
            self.bwrap = shutil.which("bwrap")
            if self.bwrap is None:
                raise LaunchError("bwrap not found (Debian: apt-get install bubblewrap)")
            self.seccomp = _seccomp.build_filter() if _seccomp.supported() else None
            self.features = ["bwrap(user,mnt,pid,ipc,uts,net,cgroup)", "rlimits", "cap-drop-all"]
            self.features += ["seccomp"] if self.seccomp else []
        if os.geteuid() == 0:
            self.features.append(
                "per-slot-uid" if self.python_world_readable else "host-uid-0-without-capabilities"
            )
        self.features += cgroups.features
        self.workdirs: set[str] = set()  # unsafe-local scratch dirs not yet removed

    async def start(self) -> None:
        """Prove bwrap can build its namespaces here (it needs unprivileged user namespaces)."""
        if self.name != "bwrap":
            return
        argv = self._bwrap_argv(self.cfg["default_limits"], probe=True)
        proc = await asyncio.create_subprocess_exec(
            *argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=CLEAN_ENV
        )
        try:
            _, err = await asyncio.wait_for(proc.communicate(), 30)
        except asyncio.TimeoutError:
            proc.kill()
            raise LaunchError("bwrap probe timed out") from None
        if proc.returncode != 0:
            raise LaunchError(
                f"bwrap cannot run here: {err.decode(errors='replace').strip()[:300]}"
            )

    def _bwrap_argv(self, lim: dict, probe: bool = False) -> list[str]:
        argv = bwrap_jail(self.bwrap, python_paths(self.python) + self.cfg["ro_paths"])
        argv += ["--size", str(lim["disk_mb"] << 20), "--perms", "1777", "--tmpfs", "/tmp"]
        argv += ["--chdir", "/tmp"]
        if probe:
            return argv + ["--", self.python, "-I", "-c", "pass"]
        if self.seccomp:
            argv += ["--seccomp", "5"]
        return argv + ["--", self.python, "-I", "-c", self.runner_src]

    async def launch(self, slot: int, lim: dict, fds: list[int]) -> dict:
        extra_fd = None
        workdir = None
        if self.name == "bwrap":
            argv, cwd = self._bwrap_argv(lim), "/"
            if self.seccomp:
                r, w = os.pipe()
                os.write(w, self.seccomp)
                os.close(w)
                extra_fd = r
        else:
            cwd = tempfile.mkdtemp(prefix="agentgrpo-unsafe-")
            self.workdirs.add(cwd)
            argv = [self.python, "-I", "-c", self.runner_src]
            workdir = cwd
        # As root, run the job (or bwrap) as the slot's uid when that uid can reach the interpreter;
        # a Python under /root cannot, and then bwrap keeps host uid 0 without capabilities
        # (mapped to nobody inside). The namespaces backend is the one to use as root.
        uid = (
            self.cfg["job_uid_base"] + slot
            if os.geteuid() == 0 and self.python_world_readable
            else None
        )
        if uid is not None and self.name != "bwrap":
            os.chown(cwd, uid, uid)
        cg_paths = self.cg.procs_paths(slot)
        pid = os.fork()
        if pid == 0:  # child: arrange fds 0-5, drop privileges, exec; nothing else may run here
            try:
                for path in cg_paths:  # join the slot's cgroups before anything can fork
                    with open(path, "w") as f:
                        f.write("0")
                moved = [os.dup(fd) for fd in fds + ([extra_fd] if extra_fd is not None else [])]
                for target, fd in enumerate(moved):
                    os.dup2(fd, target)
                os.closerange(len(moved), 1 << 16)
                os.setsid()
                if uid is not None:
                    os.setgroups([])
                    os.setresgid(uid, uid, uid)
                    os.setresuid(uid, uid, uid)
                os.chdir(cwd)
                os.execve(argv[0], argv, CLEAN_ENV)
            except BaseException as e:  # noqa: BLE001 - report on the status fd, then die
                try:
                    os.write(4, json.dumps({"error": f"exec {argv[0]}: {e}"}).encode() + b"\n")
                finally:
                    os._exit(127)
        if extra_fd is not None:
            os.close(extra_fd)
        return {"pidfd": os.pidfd_open(pid), "pid": pid, "pgid": pid, "workdir": workdir}

    def reap(self, handle: dict) -> None:
        """Collect the exit of what we forked, and remove an unsafe-local job's scratch dir."""
        if handle.get("pid") is not None:
            try:
                os.waitpid(handle["pid"], 0)
            except ChildProcessError:
                pass
            handle["pid"] = None
        if handle.get("workdir") in self.workdirs:
            self.workdirs.discard(handle["workdir"])
            shutil.rmtree(handle["workdir"], ignore_errors=True)

    def kill(self, handle: dict, slot: int) -> None:
        try:
            signal.pidfd_send_signal(handle["pidfd"], signal.SIGKILL)
        except OSError:
            pass
        if self.name == "unsafe-local":  # no PID namespace: take its process group down too
            try:
                os.killpg(handle["pgid"], signal.SIGKILL)
            except OSError:
                pass

    def close(self) -> None:
        for d in list(self.workdirs):
            shutil.rmtree(d, ignore_errors=True)
        self.workdirs.clear()
