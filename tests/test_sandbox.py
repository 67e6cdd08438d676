"""The sandbox against hostile programs: one test per attack, each with its exact expected outcome.

The threat model these cover is in docs/sandbox.md; the comment on each
test names the item. They run on the `namespaces` backend (root with CAP_SYS_ADMIN, as in CI) and
skip with the reason when this host cannot start it. Network attacks only target loopback and
this test's own sockets. A smaller set checks the bubblewrap and unsafe-local fallbacks.
"""

from __future__ import annotations

import asyncio
import errno
import os
import shutil
import signal
import socket
import struct
import time

import pytest

from agentgrpo.verify import _seccomp
from agentgrpo.verify._job import _classify, _Job
from agentgrpo.verify.sandbox import ExecResult, Limits, Sandbox, SandboxConfig

SLOT_UID_BASE = 1_500_000  # SandboxConfig().uid_base
FAST = Limits(wall_s=3.0, memory_mb=128, processes=16, disk_mb=8, output_bytes=4096)


def _start(backend: str, **cfg) -> Sandbox:
    try:
        return Sandbox(backend=backend, config=SandboxConfig(**cfg))
    except (RuntimeError, OSError) as e:
        pytest.skip(f"{backend} sandbox backend cannot start on this host: {e}")


@pytest.fixture(scope="module")
def sb():
    if os.geteuid() != 0:
        pytest.skip("the namespaces backend needs root (CAP_SYS_ADMIN); CI runs as root")
    box = _start("namespaces", slots=4)
    yield box
    box.close()


def run(sb: Sandbox, code: str, limits: Limits = FAST, **kw) -> ExecResult:
    res = sb.run(code, limits=limits, **kw)
    assert res.backend == "namespaces"
    return res


def out(res: ExecResult) -> str:
    assert res.status == "ok", (res.status, res.stderr[-500:], res.detail)
    return res.stdout.strip()


def _slot_processes() -> list[int]:
    """Host pids running under a job uid of any sandbox (pre-started jobs wait as root; each
    supervisor's block of 256 uids starts with its init's)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                uid = int(next(line for line in f if line.startswith("Uid:")).split()[1])
        except (OSError, StopIteration):
            continue
        if SLOT_UID_BASE <= uid < SLOT_UID_BASE + 256 * 65536 and (uid - SLOT_UID_BASE) % 256:
            found.append(int(pid))
    return found


def _wait_no_slot_processes(timeout: float = 3.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while (left := _slot_processes()) and time.monotonic() < deadline:
        time.sleep(0.02)
    return left


# ---- sanity: the plain path works and is typed ---------------------------------------------


def test_print_ok_and_typed(sb):
    res = run(sb, "print(1)")
    assert (res.status, res.exit_code, res.signal, res.stdout, res.stderr, res.truncated) == (
        "ok",
        0,
        None,
        "1\n",
        "",
        False,
    )
    assert res.wall_s < 3.0


def test_stdin_files_and_exit_codes(sb):
    assert out(run(sb, "print(input()[::-1])", stdin=b"abc")) == "cba"
    assert (
        out(
            run(
                sb,
                "import helper; print(helper.X + open('d/x.txt').read())",
                files={"helper.py": "X = 'h:'", "d/x.txt": b"data"},
            )
        )
        == "h:data"
    )
    res = run(sb, "import sys; sys.exit(3)")
    assert (res.status, res.exit_code) == ("runtime_error", 3)
    res = run(sb, "raise KeyError('boom')")
    assert (res.status, res.exit_code) == ("runtime_error", 1)
    assert res.stderr.rstrip().endswith("KeyError: 'boom'")


# ---- read host files outside what it is given ------------------------------------------------


def test_cannot_read_planted_host_secrets(sb, tmp_path):
    # item: host files (secrets, other jobs' files). A secret in host /tmp and one in /root.
    secret = tmp_path / "secret.txt"
    secret.write_text("TOPSECRET")
    root_secret = "/root/agentgrpo-sandbox-test-secret"
    with open(root_secret, "w") as f:
        f.write("TOPSECRET")
    try:
        code = (
            f"import os\nfor p in [{str(secret)!r}, {root_secret!r}, '/etc/shadow', "
            "'/proc/1/environ']:\n"
            "    print(os.path.exists(p))"
        )
        assert out(run(sb, code)).split() == ["False", "False", "False", "False"]
    finally:
        os.unlink(root_secret)


def test_cannot_read_trainer_source(sb):
    # item: the trainer's source
    import agentgrpo.verify.sandbox as mod

    code = (
        f"import os\nprint(os.path.exists({mod.__file__!r}), os.path.exists('/work'), "
        "os.path.exists('/sys'))"
    )
    assert out(run(sb, code)) == "False False False"


def test_root_is_minimal(sb):
    # item: host files; the whole visible tree is the read-only minimal root
    code = (
        "import os\nprint(sorted(os.listdir('/')))\nprint(sorted(os.listdir('/dev')))\n"
        "print(os.listdir('/root'))"
    )
    lines = out(run(sb, code)).splitlines()
    assert set(eval(lines[0])) <= {
        "bin",
        "dev",
        "etc",
        "lib",
        "lib32",
        "lib64",
        "libx32",
        "proc",
        "root",
        "sbin",
        "tmp",
        "usr",
    }
    assert eval(lines[1]) == [
        "fd",
        "full",
        "null",
        "random",
        "shm",
        "stderr",
        "stdin",
        "stdout",
        "urandom",
        "zero",
    ]
    assert set(eval(lines[2])) <= {
        ".pyenv"
    }  # only the way to the Python installation, if it is there


def test_symlink_and_chroot_escape_fail(sb):
    # item: host files, via a symlink in scratch space and the classic chroot("..") escape
    code = (
        "import os, errno\nos.symlink('/', 'up')\nprint(sorted(os.listdir('up/etc')))\n"
        "try:\n    os.chroot('.')\nexcept OSError as e:\n    print(errno.errorcode[e.errno])"
    )
    lines = out(run(sb, code)).splitlines()
    assert "shadow" not in lines[0] and "passwd" in lines[0]
    assert lines[1] == "EPERM"


def test_proc_shows_only_own_processes(sb):
    # item: other jobs and the trainer are invisible (pid namespace, hidepid)
    code = (
        "import os\nprint(sorted(p for p in os.listdir('/proc') if p.isdigit()), os.getpid(), "
        "os.getppid())"
    )
    assert out(run(sb, code)) == "['2'] 2 1"


# ---- write outside its scratch space ----------------------------------------------------------


def test_writes_outside_tmp_fail(sb):
    # item: writes outside scratch space
    code = (
        "import errno\nfor p in ['/x', '/usr/x', '/etc/passwd', '/root/x']:\n"
        "    try:\n        open(p, 'a').write('x')\n        print('wrote', p)\n"
        "    except OSError as e:\n        print(errno.errorcode[e.errno])"
    )
    assert out(run(sb, code)).split() == ["EROFS", "EROFS", "EROFS", "EROFS"]


def test_disk_space_bounded(sb):
    # item: disk exhaustion: several files up to the tmpfs size -> ENOSPC; one big file -> EFBIG
    code = (
        "import errno\ntry:\n    for i in range(4):\n"
        "        open(f'f{i}', 'wb').write(b'x' * (3 << 20))\n"
        "except OSError as e:\n    print(errno.errorcode[e.errno], i)"
    )
    assert out(run(sb, code)) == "ENOSPC 2"
    code = (
        "import errno\ntry:\n    open('big', 'wb').write(b'x' * (9 << 20))\n"
        "except OSError as e:\n    print(errno.errorcode[e.errno])"
    )
    assert out(run(sb, code)) == "EFBIG"


def test_inodes_bounded(sb):
    # item: inode exhaustion of the host: the job's tmpfs has its own inode limit
    code = (
        "import errno\nn = 0\ntry:\n    while n < 100000:\n"
        "        open(f'f{n}', 'w').close(); n += 1\n"
        "except OSError as e:\n    print(errno.errorcode[e.errno], n)"
    )
    name, n = out(run(sb, code)).split()
    assert name == "ENOSPC" and 1000 < int(n) < 2000


# ---- network -----------------------------------------------------------------------------------


def test_no_loopback_to_host_services(sb):
    # item: network, including loopback services of the host (a listener of this test)
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    srv.setblocking(False)
    port = srv.getsockname()[1]
    try:
        code = (
            "import socket, errno\ns = socket.socket()\ntry:\n"
            f"    s.connect(('127.0.0.1', {port}))\n"
            "    print('connected')\nexcept OSError as e:\n    print(errno.errorcode[e.errno])\n"
            "s6 = socket.socket(socket.AF_INET6)\ntry:\n    s6.connect(('::1', 22))\n"
            "except OSError as e:\n    print(errno.errorcode[e.errno])"
        )
        assert out(run(sb, code)).split() == ["ENETUNREACH", "EADDRNOTAVAIL"]
        with pytest.raises(BlockingIOError):
            srv.accept()
    finally:
        srv.close()


def test_no_dns_no_udp(sb):
    # item: network (the package registry proxy and any resolver are unreachable)
    code = (
        "import socket, errno\ntry:\n    socket.getaddrinfo('pypi.org', 443)\n"
        "except socket.gaierror as e:\n"
        "    print('gaierror')\nu = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\ntry:\n"
        "    u.sendto(b'x', ('127.0.0.1', 53))\nexcept OSError as e:\n"
        "    print(errno.errorcode[e.errno])"
    )
    assert out(run(sb, code)).split() == ["gaierror", "ENETUNREACH"]


def test_host_abstract_unix_socket_unreachable(sb):
    # item: network: abstract unix sockets belong to the network namespace
    name = f"\0agentgrpo-test-{os.getpid()}"
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(name)
    srv.listen()
    try:
        code = (
            "import socket, errno\ns = socket.socket(socket.AF_UNIX)\ntry:\n"
            f"    s.connect({name!r})\n"
            "    print('connected')\nexcept OSError as e:\n    print(errno.errorcode[e.errno])"
        )
        assert out(run(sb, code)) == "ECONNREFUSED"
    finally:
        srv.close()


def test_exotic_socket_families_refused(sb):
    # item: network: netlink, packet and vsock (the hypervisor) are refused by seccomp
    code = (
        "import socket, errno\nfor fam, typ in [(16, 3), (17, 3), (40, 1)]:\n    try:\n"
        "        socket.socket(fam, typ)\n        print('opened', fam)\n"
        "    except OSError as e:\n        print(errno.errorcode[e.errno])"
    )
    assert out(run(sb, code)).split() == ["EAFNOSUPPORT"] * 3


# ---- environment ------------------------------------------------------------------------------


def test_trainer_environment_invisible(sb):
    # item: the trainer's environment variables (set here, after the sandbox started, and before)
    os.environ["AGENTGRPO_TEST_SECRET"] = "hunter2"
    try:
        env = eval(out(run(sb, "import os; print(dict(os.environ))")))
        assert "AGENTGRPO_TEST_SECRET" not in env and "hunter2" not in str(env)
        assert sorted(env) == [
            "HOME",
            "LANG",
            "PATH",
            "PYTHONDONTWRITEBYTECODE",
            "PYTHONUNBUFFERED",
        ]
    finally:
        del os.environ["AGENTGRPO_TEST_SECRET"]


# ---- signals and ptrace -----------------------------------------------------------------------


def test_cannot_signal_trainer(sb):
    # item: signalling the trainer: its pid does not exist in the job's pid namespace
    me = os.getpid()
    code = (
        f"import os, errno\ntry:\n    os.kill({me}, 9)\nexcept OSError as e:\n"
        "    print(errno.errorcode[e.errno])"
    )
    assert out(run(sb, code)) == "ESRCH"
    res = run(sb, "import os\nos.kill(-1, 9)")  # nothing else to signal
    assert res.status == "runtime_error" and res.stderr.rstrip().endswith(
        "ProcessLookupError: [Errno 3] No such process"
    )
    assert os.getpid() == me  # still here


def test_cannot_kill_own_init(sb):
    # item: signals: the init runs as another uid and ignores signals from inside its namespace
    code = (
        "import os, errno\ntry:\n    os.kill(1, 9)\nexcept OSError as e:\n"
        "    print(errno.errorcode[e.errno])"
    )
    assert out(run(sb, code)) == "EPERM"


def test_ptrace_and_process_vm_denied(sb):
    # item: ptrace of the trainer/other jobs (and of its own init) is denied by seccomp
    code = (
        "import ctypes, errno\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "print(libc.ptrace(16, 1, 0, 0), errno.errorcode[ctypes.get_errno()])\n"  # PTRACE_ATTACH
        "print(libc.syscall(310, 1, 0, 0, 0, 0, 0), errno.errorcode[ctypes.get_errno()])"
    )  # process_vm_readv
    assert out(run(sb, code)).split() == ["-1", "EPERM", "-1", "EPERM"]


def test_concurrent_jobs_cannot_see_each_other(sb):
    # item: other jobs: a victim sleeps while an attacker scans and signals every pid it can name
    victim = "import time; time.sleep(1.0); print('survived')"
    attacker = (
        "import os\nhits = 0\nfor pid in range(1, 4096):\n    if pid == os.getpid():\n"
        "        continue\n"
        "    try:\n        os.kill(pid, 9); hits += 1\n    except OSError:\n        pass\n"
        "print(hits)"
    )

    async def both():
        return await asyncio.gather(sb.arun(victim, limits=FAST), sb.arun(attacker, limits=FAST))

    v, a = asyncio.run(both())
    assert out(v) == "survived"
    assert out(a) == "0"


# ---- resource exhaustion -----------------------------------------------------------------------


def test_memory_bomb(sb):
    # item: memory: a cgroup OOM kill (or MemoryError) ends it as memory_limit
    res = run(sb, "x = bytearray(1 << 30)", limits=Limits(wall_s=5, memory_mb=64))
    assert res.status == "memory_limit" and res.detail in ("cgroup OOM kill", "MemoryError raised")
    res = run(
        sb,
        "import os\nif os.fork() == 0:\n    x = bytearray(1 << 30)\nos.wait()",
        limits=Limits(wall_s=5, memory_mb=64),
    )
    assert res.status == "memory_limit"


def test_fork_bomb_bounded(sb):
    # item: processes: at most `processes` of them, and everything is gone afterwards
    code = (
        "import os, time\nn = 0\ntry:\n    for i in range(500):\n        if os.fork() == 0:\n"
        "            time.sleep(30)\n            os._exit(0)\n        n += 1\n"
        "except OSError as e:\n    print(n, e.errno)"
    )
    n, err = out(run(sb, code)).split()
    assert 1 <= int(n) < FAST.processes and int(err) == errno.EAGAIN
    assert _wait_no_slot_processes() == []


def test_thread_bomb_bounded(sb):
    # item: processes: threads count too
    code = (
        "import threading, time\nn = 0\ntry:\n    for i in range(1000):\n"
        "        threading.Thread(target=time.sleep, args=(5,), daemon=True).start(); n += 1\n"
        "except RuntimeError:\n    print(n)"
    )
    assert 1 <= int(out(run(sb, code))) < FAST.processes


def test_file_descriptors_bounded(sb):
    # item: file descriptors
    code = (
        "import os, errno\nfds = []\ntry:\n    while len(fds) < 100000:\n"
        "        fds.append(os.open('/dev/null', os.O_RDONLY))\nexcept OSError as e:\n"
        "    print(errno.errorcode[e.errno], len(fds))"
    )
    name, n = out(run(sb, code)).split()
    assert name == "EMFILE" and int(n) == FAST.open_files - 3


def test_raise_own_limits_refused(sb):
    # item: processes/memory: hard rlimits cannot be raised back
    code = (
        "import resource\ntry:\n    resource.setrlimit(resource.RLIMIT_NPROC, (10**6, 10**6))\n"
        "except ValueError:\n    print('refused')"
    )
    assert out(run(sb, code)) == "refused"


# ---- output flooding --------------------------------------------------------------------------


def test_stdout_flood_capped(sb):
    # item: flooding the trainer: killed at the cap, the first output_bytes kept
    t0 = time.monotonic()
    res = run(sb, "while True:\n    print('y' * 999)")
    assert (res.status, res.truncated) == ("output_limit", True)
    assert res.stdout == ("y" * 999 + "\n") * 4 + "y" * 96 and len(res.stdout) == FAST.output_bytes
    assert time.monotonic() - t0 < FAST.wall_s


def test_stderr_flood_without_newlines_capped(sb):
    # item: flooding via stderr, one write without any newline
    res = run(sb, "import sys\nsys.stderr.write('e' * (1 << 22))\nimport time; time.sleep(10)")
    assert (res.status, res.truncated, len(res.stderr)) == ("output_limit", True, FAST.output_bytes)


# ---- leftovers and persistence -----------------------------------------------------------------


def test_daemon_double_fork_killed(sb):
    # item: leaving processes behind: a setsid double-forked daemon dies with the job
    code = (
        "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
        "        os.close(1); os.close(2)\n        time.sleep(300)\n    os._exit(0)\n"
        "os.wait()\nprint('parent done')"
    )
    assert out(run(sb, code)) == "parent done"
    assert _wait_no_slot_processes() == []


def test_no_state_persists_between_jobs():
    # item: persisting state into the next job (one slot, so both jobs use the same one)
    if os.geteuid() != 0:
        pytest.skip("the namespaces backend needs root (CAP_SYS_ADMIN); CI runs as root")
    box = _start("namespaces", slots=1)
    try:
        write = (
            "import ctypes\nopen('/tmp/mark', 'w').write('1')\n"
            "open('/dev/shm/mark', 'w').write('1')\n"
            "libc = ctypes.CDLL(None)\nprint(libc.shmget(4242, 4096, 0o1000 | 0o666) >= 0)"
        )  # IPC_CREAT
        assert out(box.run(write, limits=FAST)) == "True"
        check = (
            "import os, ctypes\nlibc = ctypes.CDLL(None)\n"
            "print(os.listdir('/tmp'), os.path.exists('/dev/shm/mark'), libc.shmget(4242, 0, 0))"
        )
        assert out(box.run(check, limits=FAST)) == "[] False -1"
    finally:
        box.close()


# ---- never hang, keep output, no fake verdicts ------------------------------------------------


def test_timeout_keeps_earlier_output(sb):
    # item: always returns within the wall limit plus a margin; output before a timeout is kept
    t0 = time.monotonic()
    res = run(
        sb,
        "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('started')\n"
        "while True:\n    pass",
        limits=Limits(wall_s=0.5),
    )
    assert (res.status, res.stdout) == ("timeout", "started\n")
    assert 0.5 <= time.monotonic() - t0 < 2.0


def test_closed_streams_sleeping_job_times_out(sb):
    # item: never hang: closing stdout/stderr and blocking is still bounded
    res = run(
        sb, "import os, time\nos.close(1); os.close(2)\ntime.sleep(60)", limits=Limits(wall_s=0.5)
    )
    assert res.status == "timeout"


def test_cannot_fake_a_sandbox_error(sb):
    # a job must not make itself unscorable: the status pipe is closed before user code runs
    code = (
        'import os, sys, errno\ntry:\n    os.write(4, b\'{"error": "x"}\\n\')\n'
        "except OSError as e:\n"
        "    print(errno.errorcode[e.errno])\nsys.stderr.write('job setup: fake\\n')\nsys.exit(125)"
    )
    res = run(sb, code)
    assert (res.status, res.exit_code, res.stdout) == ("runtime_error", 125, "EBADF\n")


# ---- privilege escalation ---------------------------------------------------------------------


def test_namespace_and_mount_syscalls_denied(sb):
    # item: gaining privileges: user namespaces, mount, setuid, keyrings, io_uring, bpf
    code = (
        "import ctypes, errno, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "def e(r):\n    return errno.errorcode[ctypes.get_errno()] if r == -1 else 'ok'\n"
        "print(e(libc.unshare(0x10000000)))\n"  # CLONE_NEWUSER
        "print(e(libc.mount(b'none', b'/tmp', b'tmpfs', 0, None)))\n"
        "print(e(libc.setuid(0)))\n"
        "print(e(libc.syscall(250, 0, 0, 0, 0)))\n"  # keyctl
        "print(e(libc.syscall(425, 8, 0)))\n"  # io_uring_setup
        "print(e(libc.syscall(321, 0, 0, 0)))\n"  # bpf
        "print(e(libc.syscall(56, 0x10000000 | 17, 0, 0, 0, 0)))"
    )  # clone(CLONE_NEWUSER|SIGCHLD)
    assert out(run(sb, code)).split() == ["EPERM"] * 7


def test_capabilities_and_seccomp_in_effect(sb):
    code = (
        "for line in open('/proc/self/status'):\n"
        "    if line.startswith(('CapEff', 'CapPrm', 'NoNewPrivs', 'Seccomp:')):\n"
        "        print(line.split()[1])\n"
        "import os; print(os.getuid() >= 1500000, os.getgroups())"
    )
    assert out(run(sb, code)).split() == [
        "0000000000000000",
        "0000000000000000",
        "1",
        "2",
        "True",
        "[]",
    ]


def test_foreign_syscall_abi_killed(sb):
    # item: seccomp bypass through the x32 ABI numbers kills the process (SIGSYS)
    res = run(sb, "import ctypes\nctypes.CDLL(None).syscall(39 | 0x40000000)\nprint('survived')")
    assert (res.status, res.signal, res.stdout) == ("signaled", signal.SIGSYS, "")


def test_real_time_signal_is_a_typed_result(sb):
    # signal 40 has no name in Python's enum: classifying it once raised in the supervisor, which
    # left the job unanswered until its deadline and restarted the supervisor (NaN for its jobs)
    res = run(sb, "import os\nos.kill(os.getpid(), 40)")
    assert (res.status, res.signal, res.detail) == ("signaled", 40, "signal 40")


def test_tiocsti_denied(sb):
    # item: injecting input into a terminal (TIOCSTI) is denied even on an fd that is not a tty
    code = (
        "import ctypes, errno\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "libc.ioctl(0, 0x5412, b'x')\nprint(errno.errorcode[ctypes.get_errno()])"
    )
    assert out(run(sb, code)) == "EPERM"


# ---- the sandbox's own failures are retried and typed -----------------------------------------


def test_supervisor_death_is_retried():
    if os.geteuid() != 0:
        pytest.skip("the namespaces backend needs root (CAP_SYS_ADMIN); CI runs as root")
    box = _start("namespaces", slots=2, retries=2)
    try:
        box.run("print(1)", limits=FAST)
        os.kill(box._impl._proc.pid, signal.SIGKILL)  # infrastructure failure mid-session
        res = box.run("print(2)", limits=FAST)
        assert (res.status, res.stdout) == ("ok", "2\n")
    finally:
        box.close()
    assert _wait_no_slot_processes() == []


def test_fork_server_death_is_recovered():
    if os.geteuid() != 0:
        pytest.skip("the namespaces backend needs root (CAP_SYS_ADMIN); CI runs as root")
    box = _start("namespaces", slots=2)
    try:
        assert box.run("print(1)", limits=FAST).stdout == "1\n"
        sup = box._impl._proc.pid
        with open(f"/proc/{sup}/task/{sup}/children") as f:
            (fork_server,) = [int(p) for p in f.read().split()]
        os.kill(fork_server, signal.SIGKILL)  # its pre-started jobs die with it (PDEATHSIG)
        res = box.run("print(2)", limits=FAST)
        assert (res.status, res.stdout) == ("ok", "2\n")
    finally:
        box.close()


def test_hung_supervisor_is_replaced_within_the_margin():
    # never hang: a supervisor that stops answering is killed after wall_s + margin_s
    if os.geteuid() != 0:
        pytest.skip("the namespaces backend needs root (CAP_SYS_ADMIN); CI runs as root")
    box = _start("namespaces", slots=2, margin_s=0.5, retries=1)
    try:
        os.kill(box._impl._proc.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        res = box.run("print('after')", limits=Limits(wall_s=0.5))
        assert (res.status, res.stdout) == ("ok", "after\n")
        assert 1.0 <= time.monotonic() - t0 < 6.0
    finally:
        box.close()
    assert _wait_no_slot_processes() == []


def test_no_retries_gives_sandbox_error_not_a_verdict():
    if os.geteuid() != 0:
        pytest.skip("the namespaces backend needs root (CAP_SYS_ADMIN); CI runs as root")
    box = _start("namespaces", slots=1, retries=0)
    try:

        async def main():
            job = asyncio.ensure_future(box.arun("import time; time.sleep(2)", limits=FAST))
            await asyncio.sleep(0.3)
            os.kill(box._impl._proc.pid, signal.SIGKILL)
            return await job

        res = asyncio.run(main())
        assert res.status == "sandbox_error" and res.exit_code is None and res.detail
    finally:
        box.close()


# ---- pure units: seccomp program and classification -------------------------------------------


def _bpf_eval(prog: bytes, nr: int, arch: int, args: tuple[int, ...] = (0,) * 6) -> int:
    """A tiny classic-BPF interpreter for the instructions the filter uses."""
    data = struct.pack("=iIQ6Q", nr, arch, 0, *args)
    ins = [struct.unpack_from("=HBBI", prog, i) for i in range(0, len(prog), 8)]
    pc, acc = 0, 0
    while True:
        code, jt, jf, k = ins[pc]
        if code == 0x20:
            acc = struct.unpack_from("=I", data, k)[0]
            pc += 1
        elif code == 0x06:
            return k
        else:
            cond = {0x15: acc == k, 0x35: acc >= k, 0x45: bool(acc & k)}[code]
            pc += 1 + (jt if cond else jf)


@pytest.mark.parametrize("machine", ["x86_64", "aarch64"])
def test_seccomp_program_decisions(machine):
    prog = _seccomp.build_filter(machine)
    arch, table, _ = _seccomp._ARCHES[machine]
    allow, kill = 0x7FFF0000, 0x80000000
    eperm, enosys, eafnosupport = (
        0x50000 | errno.EPERM,
        0x50000 | errno.ENOSYS,
        0x50000 | errno.EAFNOSUPPORT,
    )
    for name in _seccomp._DENY_NAMES:
        if name in table:
            assert _bpf_eval(prog, table[name], arch) == eperm, name
    assert _bpf_eval(prog, 0, arch) == allow  # read / io_setup
    assert _bpf_eval(prog, table["clone"], arch, (0x11,) + (0,) * 5) == allow  # fork-like clone
    assert (
        _bpf_eval(prog, table["clone"], arch, (0x10000011,) + (0,) * 5) == eperm
    )  # + CLONE_NEWUSER
    assert _bpf_eval(prog, table["clone3"], arch) == enosys
    for fam, want in [(1, allow), (2, allow), (10, allow), (16, eafnosupport), (40, eafnosupport)]:
        assert _bpf_eval(prog, table["socket"], arch, (fam,) + (0,) * 5) == want
        assert _bpf_eval(prog, table["socketpair"], arch, (fam,) + (0,) * 5) == want
    assert _bpf_eval(prog, table["ioctl"], arch, (0, 0x5412) + (0,) * 4) == eperm
    assert _bpf_eval(prog, table["ioctl"], arch, (0, 0x5401) + (0,) * 4) == allow  # TCGETS
    assert _bpf_eval(prog, 0, 0x40000003) == kill  # i386 ABI
    if machine == "x86_64":
        assert _bpf_eval(prog, 39 | 0x40000000, arch) == kill  # x32 ABI


def test_classification_precedence():
    job = _Job.__new__(_Job)
    job.err, job.killed_for = bytearray(), None
    exit3, sigsegv = {"wstatus": 3 << 8}, {"wstatus": signal.SIGSEGV}
    assert _classify(job, [exit3], oom=False)["status"] == "runtime_error"
    assert _classify(job, [exit3], oom=True)["status"] == "memory_limit"
    assert _classify(job, [sigsegv], oom=False)["status"] == "signaled"
    assert _classify(job, [{"wstatus": signal.SIGXCPU}], oom=False)["status"] == "timeout"
    assert _classify(job, [{"error": "x"}, exit3], oom=False)["status"] == "sandbox_error"
    assert _classify(job, [], oom=False)["status"] == "sandbox_error"
    job.killed_for = "output"
    assert _classify(job, [{"wstatus": signal.SIGKILL}], oom=True)["status"] == "output_limit"
    job.killed_for = "timeout"
    assert _classify(job, [], oom=False)["status"] == "timeout"


def test_limits_validated():
    with pytest.raises(ValueError):
        Limits(wall_s=0)
    with pytest.raises(ValueError):
        Limits(memory_mb=1)
    with pytest.raises(ValueError):
        Limits(bogus=1)
    with pytest.raises(ValueError):
        Sandbox._prepare("", b"", {"../x": "y"})


# ---- fallbacks ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bwrap_sb():
    import shutil

    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed (scripts/system-deps.sh installs it)")
    box = _start("bwrap", slots=2)
    yield box
    box.close()


def test_bwrap_basic_isolation(bwrap_sb, tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("x")
    res = bwrap_sb.run(
        f"import os, socket\nprint(os.path.exists({str(secret)!r}), os.environ.get('HOME'))\n"
        "print(sorted(os.listdir('/dev'))[:3])",
        limits=FAST,
    )
    assert (res.status, res.backend) == ("ok", "bwrap")
    assert res.stdout.splitlines()[0] == "False /tmp"


def test_bwrap_limits(bwrap_sb):
    res = bwrap_sb.run("while True:\n    print('y' * 999)", limits=FAST)
    assert (res.status, len(res.stdout)) == ("output_limit", FAST.output_bytes)
    # 3 s of wall time: under load bwrap and python took more than 0.5 s to print (CI, 2026-12-05)
    res = bwrap_sb.run("print('a', flush=True)\nwhile True: pass", limits=Limits(wall_s=3.0))
    assert (res.status, res.stdout) == ("timeout", "a\n")
    res = bwrap_sb.run("x = bytearray(1 << 30)", limits=Limits(memory_mb=64))
    assert res.status == "memory_limit"
    res = bwrap_sb.run("import socket, errno\ns = socket.socket(16, 3)", limits=FAST)
    assert res.status == "runtime_error" and "Address family not supported" in res.stderr


def test_unsafe_local_is_opt_in_and_marked():
    with pytest.warns(UserWarning, match="WITHOUT isolation"):
        box = Sandbox(backend="unsafe-local", config=SandboxConfig(slots=1))
    try:
        res = box.run("print(6 * 7)", limits=FAST)
        assert (res.status, res.stdout, res.backend) == ("ok", "42\n", "unsafe-local")
        res = box.run("import time; time.sleep(5)", limits=Limits(wall_s=0.3))
        assert res.status == "timeout"
    finally:
        box.close()


@pytest.mark.parametrize("backend", ["namespaces", "bwrap"])
def test_broken_backend_fails_at_construction(backend):
    import shutil

    if backend == "namespaces" and os.geteuid() != 0:
        pytest.skip("the namespaces backend needs root (CAP_SYS_ADMIN); CI runs as root")
    if backend == "bwrap" and shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed (scripts/system-deps.sh installs it)")
    with pytest.raises(RuntimeError, match=f"{backend} sandbox backend unavailable"):
        Sandbox(backend=backend, config=SandboxConfig(slots=1, python="/nonexistent/python3"))


def test_a_config_that_cannot_start_does_not_rule_the_backend_out_for_others():
    if os.geteuid() != 0 and shutil.which("bwrap") is None:
        pytest.skip("no isolating backend on this host")
    with pytest.raises(RuntimeError, match="no sandbox backend works"):
        Sandbox(config=SandboxConfig(slots=1, python="/nonexistent/python3"))
    box = Sandbox(config=SandboxConfig(slots=1))  # auto, a config that works: probed again
    try:
        assert box.run("print(6*7)").stdout == "42\n"
    finally:
        box.close()
