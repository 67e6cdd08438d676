"""Fork server of the `namespaces` sandbox backend (runs as root, started by the supervisor).

At start it builds a minimal read-only root and `pivot_root`s into it, makes an empty network
namespace per slot, opens each slot's cgroup files, pre-imports the stdlib and builds the seccomp
filter; then it only forks. It never receives a job's code, files or output: the supervisor sends
a slot, the limits and five pipe ends. Per job it forks an init (PID 1 of a new PID namespace,
which sets the job's namespaces and mounts up, reaps, and reports its status) and the init forks
the job (rlimits, the slot's uid, `no_new_privs`, seccomp). docs/sandbox.md ("Inside the local
backends") has each step.

Started as `python -I -c ... _forkserver.py-dir CONFIG_JSON SOCKET_FD`; stdlib-only so a fork of it
stays small (fork cost grows with the parent's memory).
"""

from __future__ import annotations

import ctypes
import fcntl
import gc
import importlib
import json
import os
import selectors
import signal
import socket
import stat
import sys
import tempfile
import time

try:
    from . import _runner, _seccomp
except ImportError:  # started as a plain script by the supervisor: siblings are top-level
    import _runner
    import _seccomp

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG = 1

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_char_p,
    ctypes.c_ulong,
    ctypes.c_char_p,
]
_libc.prctl.argtypes = [
    ctypes.c_int,
    ctypes.c_ulong,
    ctypes.c_ulong,
    ctypes.c_ulong,
    ctypes.c_ulong,
]

PREIMPORT = (
    "abc array bisect collections copy dataclasses datetime decimal enum fractions functools "
    "hashlib heapq io itertools json math operator random re statistics string struct "
    "textwrap time traceback typing atexit threading types"
).split()


def _ok(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(
    src: str | None, dst: str, fstype: str | None, flags: int, data: str | None = None
) -> None:
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _ok(_libc.mount(enc(src), enc(dst), enc(fstype), flags, enc(data)), f"mount {src} -> {dst}")


def _bind_ro(src: str, dst: str) -> None:
    _mount(src, dst, None, MS_BIND)
    _mount(None, dst, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _mkdirs_in(root: str, path: str) -> str:
    target = root + path
    os.makedirs(target, mode=0o755, exist_ok=True)
    return target


def _staging_dir() -> str:
    """Where the new root is assembled: one fixed, root-owned directory reused by every fork server.

    The tmpfs is mounted over it only inside our private mount namespace, so the host sees an
    empty directory; a fixed one does not leave a new empty directory behind at every start.
    """
    path = "/tmp/.agentgrpo-sandbox-root"
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
        return tempfile.mkdtemp(prefix="agentgrpo-root-")  # someone else's: do not mount over it
    return path


def build_root(ro_paths: list[str], uids: list[int], init_uid: int) -> None:
    """Enter a private mount namespace whose root is a minimal read-only tree; `/` afterwards."""
    _ok(_libc.unshare(CLONE_NEWNS), "unshare(NEWNS)")
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    enter_root(assemble_root(ro_paths, uids, init_uid))


def assemble_root(
    ro_paths: list[str], uids: list[int], init_uid: int, home: str = "/tmp", extra_dirs=()
) -> str:
    """Build the minimal tree (read-only binds, a synthetic /etc, five devices) in a staging tmpfs
    of the current (private) mount namespace; returns its path, for `enter_root`. A session mounts
    its workspace into it in between (`_session_init.py`); `extra_dirs` are made for that."""
    root = _staging_dir()
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=2m,nr_inodes=512,mode=755")
    for name in ("usr", "bin", "lib", "lib32", "lib64", "libx32", "sbin"):
        host = "/" + name
        if os.path.islink(host):
            os.symlink(os.readlink(host), os.path.join(root, name))
        elif os.path.isdir(host):
            _bind_ro(host, _mkdirs_in(root, host))
    for path in ro_paths:
        path = os.path.realpath(path)
        if os.path.isdir(path) and not os.path.exists(root + path):
            _bind_ro(path, _mkdirs_in(root, path))
    etc = _mkdirs_in(root, "/etc")
    users = [("root", 0, "/root"), ("sandbox-init", init_uid, "/")]
    users += [(f"sandbox{i}", uid, home) for i, uid in enumerate(uids)]
    files = {
        "passwd": "".join(f"{n}:x:{u}:{u}::{h}:/bin/sh\n" for n, u, h in users),
        "group": "".join(f"{n}:x:{u}:\n" for n, u, _ in users),
        "hosts": "127.0.0.1 localhost\n::1 localhost\n",
        "hostname": "sandbox\n",
        "nsswitch.conf": "passwd: files\ngroup: files\nhosts: files\n",
        "resolv.conf": "",
    }
    for name, text in files.items():
        with open(os.path.join(etc, name), "w") as f:
            f.write(text)
    for name in ("ld.so.cache", "localtime"):  # loader cache and timezone: public, no secrets
        try:
            with open("/etc/" + name, "rb") as src, open(os.path.join(etc, name), "wb") as dst:
                dst.write(src.read())
        except OSError:
            pass
    dev = _mkdirs_in(root, "/dev")
    for name in ("null", "zero", "full", "random", "urandom"):
        open(os.path.join(dev, name), "w").close()
        _mount("/dev/" + name, os.path.join(dev, name), None, MS_BIND)
        _mount(None, os.path.join(dev, name), None, MS_BIND | MS_REMOUNT | MS_NOSUID | MS_NOEXEC)
    for name, target in (
        ("shm", "/tmp"),
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ):
        os.symlink(target, os.path.join(dev, name))
    for d in ("/tmp", "/proc", "/.old", *extra_dirs):
        _mkdirs_in(root, d)
    os.chmod(root + "/tmp", 0o1777)
    return root


def enter_root(root: str, detach: tuple[str, ...] = ()) -> None:
    """`pivot_root` into the tree `assemble_root` built, drop the old root (and the mounts in
    `detach`, paths in the new root), make `/` read-only."""
    _ok(
        _libc.syscall(
            155 if os.uname().machine == "x86_64" else 41, root.encode(), (root + "/.old").encode()
        ),
        "pivot_root",
    )
    os.chdir("/")
    for path in ("/.old", *detach):
        _ok(_libc.umount2(path.encode(), MNT_DETACH), f"umount {path}")
        os.rmdir(path)
    _mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


class ForkServer:
    def __init__(self, cfg: dict, sock: socket.socket) -> None:
        self.cfg = cfg
        self.sock = sock
        self.slots = cfg["slots"]
        self.uids = [cfg["uid_base"] + i for i in range(self.slots)]
        self.init_uid = cfg["init_uid"]
        self.rlimit_as = not cfg["memory_cgroup"]
        for name in PREIMPORT + cfg.get("preimport", []):
            try:
                importlib.import_module(name)
            except ImportError:
                pass
        # cgroup membership files: a job joins by writing "0" (= itself) before it runs anything
        self.cg_fds = [
            [os.open(p, os.O_WRONLY | os.O_CLOEXEC) for p in paths] for paths in cfg["cgroup_procs"]
        ]
        own_net = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        self.own_pid_ns = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
        self.net_fds = []
        for _ in range(self.slots):
            _ok(_libc.unshare(CLONE_NEWNET), "unshare(NEWNET)")
            self.net_fds.append(os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC))
        _ok(_libc.setns(own_net, CLONE_NEWNET), "setns(own net)")
        os.close(own_net)
        self.seccomp = _seccomp.Installer() if _seccomp.supported() else None
        python_dirs = [
            sys.prefix,
            sys.base_prefix,
            os.path.dirname(os.path.realpath(sys.executable)),
        ]
        build_root(python_dirs + cfg.get("ro_paths", []), self.uids, self.init_uid)
        sys.path = [p for p in sys.path if os.path.isdir(p)]
        os.nice(10)  # see _job: warming runs in the background, jobs at normal priority
        gc.collect()
        gc.freeze()  # children's collections then skip these objects: fewer copy-on-write faults
        self.devnull = os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC)

    def serve(self) -> None:
        # SIGCHLD wakes the loop so finished inits are reaped at once (a zombie init would still
        # count in its slot's pids cgroup when the next job starts).
        wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        sel = selectors.DefaultSelector()
        sel.register(self.sock, selectors.EVENT_READ)
        sel.register(wake_r, selectors.EVENT_READ)
        self.sock.send(json.dumps({"ready": True, "seccomp": self.seccomp is not None}).encode())
        while True:
            ready = [key.fileobj for key, _ in sel.select()]
            if wake_r in ready:
                while True:
                    try:
                        os.read(wake_r, 4096)
                    except BlockingIOError:
                        break
                self._reap()
            if self.sock not in ready:
                continue
            msg, fds, _, _ = socket.recv_fds(self.sock, 1 << 16, 8)
            if not msg:
                return  # the supervisor closed the socket: shut down (inits die by PDEATHSIG)
            req = json.loads(msg)
            try:
                pidfd = self._spawn(req, fds)
                socket.send_fds(self.sock, [json.dumps({"id": req["id"]}).encode()], [pidfd])
                os.close(pidfd)
            except OSError as e:  # fork/pidfd failure: an infrastructure error for this job only
                self.sock.send(json.dumps({"id": req["id"], "error": f"fork server: {e}"}).encode())
            finally:
                for fd in fds:
                    os.close(fd)
            self._reap()

    def _reap(self) -> None:
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return

    def _spawn(self, req: dict, fds: list[int]) -> int:
        # The next fork becomes PID 1 of a new PID namespace; setns() on our own namespace
        # afterwards resets that, so every job gets a fresh one without an extra fork.
        _ok(_libc.unshare(CLONE_NEWPID), "unshare(NEWPID)")
        try:
            pid = os.fork()
        except OSError:
            _ok(_libc.setns(self.own_pid_ns, CLONE_NEWPID), "setns(own pid ns)")
            raise
        if pid == 0:
            self._init(req, fds)  # never returns
        _ok(_libc.setns(self.own_pid_ns, CLONE_NEWPID), "setns(own pid ns)")
        return os.pidfd_open(pid)

    # ---- PID 1 of the job's namespace -------------------------------------------------------

    def _init(self, req: dict, fds: list[int]) -> None:
        status_fd = fds[4]
        try:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGCHLD])
            _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            slot, lim = req["slot"], req["limits"]
            for fd in self.cg_fds[slot]:
                os.write(fd, b"0")
            _ok(_libc.unshare(CLONE_NEWNS | CLONE_NEWIPC | CLONE_NEWUTS), "unshare(NS|IPC|UTS)")
            _ok(_libc.setns(self.net_fds[slot], CLONE_NEWNET), "setns(slot net)")
            _ok(_libc.sethostname(b"sandbox", 7), "sethostname")
            inodes = 1024 + 16 * lim["disk_mb"]
            _mount(
                "tmpfs",
                "/tmp",
                "tmpfs",
                MS_NOSUID | MS_NODEV,
                f"size={lim['disk_mb']}m,nr_inodes={inodes},mode=1777",
            )
            _mount(
                "proc",
                "/proc",
                "proc",
                MS_NOSUID | MS_NODEV | MS_NOEXEC,
                "hidepid=invisible,subset=pid",
            )
            # The supervisor enforces the wall limit from the moment it sends the payload; a
            # pre-started job may wait idle before that, so this is only a leak backstop.
            deadline = time.monotonic() + lim["wall_s"] + 3600.0
            child = os.fork()
            if child == 0:
                self._job(slot, lim, fds)  # never returns
            for fd in (0, 1, 2):
                os.dup2(self.devnull, fd)
            os.closerange(3, status_fd)
            os.closerange(status_fd + 1, 1 << 16)
            os.setgroups([])
            os.setresgid(self.init_uid, self.init_uid, self.init_uid)
            os.setresuid(self.init_uid, self.init_uid, self.init_uid)
            if self.seccomp is not None:
                self.seccomp.install()
            st = _runner.reap_until(child, deadline)
            _runner.write_status(status_fd, {"timeout": True} if st is None else {"wstatus": st})
        except BaseException as e:  # noqa: BLE001 - report any setup failure as a sandbox error
            try:
                os.write(
                    status_fd,
                    json.dumps({"error": f"init: {type(e).__name__}: {e}"}).encode() + b"\n",
                )
            finally:
                os._exit(1)
        os._exit(0)

    # ---- the job ------------------------------------------------------------------------------

    def _job(self, slot: int, lim: dict, fds: list[int]) -> None:
        """The job process: set up, wait for the payload (as root, reniced), drop, run."""
        status_fd, high = None, fds
        try:
            os.setsid()
            # move the five pipe ends clear of 0-4 first, then into place
            high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 100) for fd in fds]
            for target, fd in enumerate(high[:4]):
                os.dup2(fd, target)
            os.closerange(4, 100)
            status_fd = fcntl.fcntl(high[4], fcntl.F_DUPFD_CLOEXEC, 4)
            os.closerange(status_fd + 1, 1 << 16)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGCHLD])
            _runner.apply_rlimits(lim, address_space=self.rlimit_as)
            os.chdir("/tmp")
            os.umask(0o022)
            namespace = _runner.prepare_main("/tmp")
            header, code, files = _runner.read_payload(3)  # a pre-started job idles here
            os.close(3)
            # the fork server and pre-started jobs run niced so that warming slots never slows a
            # running job; a job that starts runs at normal priority, and so does its init
            os.setpriority(os.PRIO_PROCESS, 0, 0)
            os.setpriority(os.PRIO_PROCESS, 1, 0)
            uid = self.uids[slot]
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            if self.seccomp is not None:
                self.seccomp.install()
            _runner.write_files(files, "/tmp")
        except BaseException as e:  # noqa: BLE001 - setup failed before any user code ran
            try:  # on the status pipe, which user code never holds: it cannot fake this
                os.write(
                    high[4] if status_fd is None else status_fd,
                    json.dumps({"error": f"job setup: {type(e).__name__}: {e}"}).encode() + b"\n",
                )
            finally:
                os._exit(125)
        os.close(status_fd)
        os._exit(_runner.run_main(code, namespace))


def main(argv: list[str]) -> int:
    cfg = json.loads(argv[0])
    sock = socket.socket(fileno=int(argv[1]))
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    try:
        server = ForkServer(cfg, sock)
    except Exception as e:  # noqa: BLE001 - tell the supervisor why this host cannot run it
        sock.send(json.dumps({"ready": False, "error": f"{type(e).__name__}: {e}"}).encode())
        return 1
    server.serve()
    return 0
