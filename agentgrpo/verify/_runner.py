"""The part of a sandboxed job that runs inside the jail: payload in, user code run, status out.

Stdlib only and self-contained on purpose: the fork server imports it (each job is a fork of a
warm interpreter), and the bubblewrap / unsafe-local backends pass this file's source to a fresh
`python -I -c` inside their jail, where nothing of agentgrpo is importable.

File descriptors of a job, the same for every backend:
    0 stdin   1 stdout   2 stderr   3 payload (read once, then closed)   4 status (init only)
Payload: 4-byte big-endian length of a JSON header, the header, then the code and the files'
bytes in the order the header lists them.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import struct
import sys
import time

_LEN = struct.Struct("!I")
# The whole environment of every job (and of the fork server): nothing of the trainer's.
CLEAN_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": "/tmp",
    "LANG": "C.UTF-8",
    "PYTHONUNBUFFERED": "1",
    "PYTHONDONTWRITEBYTECODE": "1",
}


def _read_exact(fd: int, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        b = os.read(fd, min(n - got, 1 << 20))
        if not b:
            raise EOFError("payload truncated")
        chunks.append(b)
        got += len(b)
    return b"".join(chunks)


def read_payload(fd: int) -> tuple[dict, bytes, list[tuple[str, bytes]]]:
    """Read the job's header, code and files from the payload pipe."""
    (hlen,) = _LEN.unpack(_read_exact(fd, 4))
    header = json.loads(_read_exact(fd, hlen))
    code = _read_exact(fd, header["code_len"])
    files = [(name, _read_exact(fd, size)) for name, size in header["files"]]
    return header, code, files


def write_files(files: list[tuple[str, bytes]], workdir: str) -> None:
    for name, data in files:
        path = os.path.join(workdir, name)
        os.makedirs(os.path.dirname(path) or workdir, exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)


def apply_rlimits(lim: dict, *, address_space: bool) -> None:
    """Lower this process's limits (inherited by its children; hard limits cannot be raised back).

    `address_space` adds RLIMIT_AS where no memory cgroup does the job: it counts virtual memory,
    so it is a coarse stand-in (the current size of the interpreter is added to the budget).
    """
    mb = 1 << 20
    cpu = int(lim["wall_s"]) + 2  # a backstop; the wall clock is enforced from outside
    rl = {
        resource.RLIMIT_CPU: (cpu, cpu + 1),
        resource.RLIMIT_FSIZE: (lim["disk_mb"] * mb, lim["disk_mb"] * mb),
        resource.RLIMIT_NOFILE: (lim["open_files"], lim["open_files"]),
        resource.RLIMIT_NPROC: (lim["processes"], lim["processes"]),
        resource.RLIMIT_CORE: (0, 0),
    }
    if address_space:
        with open("/proc/self/statm") as f:
            vsz = int(f.read().split()[0]) * resource.getpagesize()
        rl[resource.RLIMIT_AS] = (vsz + lim["memory_mb"] * mb, vsz + lim["memory_mb"] * mb)
    for k, v in rl.items():
        soft, hard = resource.getrlimit(k)
        v = tuple(x if hard == resource.RLIM_INFINITY else min(x, hard) for x in v)
        resource.setrlimit(k, v)


def _exit_code(e: SystemExit) -> int:
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code & 0xFF
    try:
        print(e.code, file=sys.stderr)
    except Exception:  # the user may have closed or replaced stderr
        pass
    return 1


def prepare_main(workdir: str) -> dict:
    """Everything of `python -c` that does not depend on the code: done before the payload arrives.

    stdout/stderr are unbuffered, so output printed before a kill (timeout, output cap) is kept.
    """
    import builtins
    import io
    import types

    sys.stdin = sys.__stdin__ = io.TextIOWrapper(
        io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding="utf-8", errors="replace"
    )
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(
        io.FileIO(1, "w", closefd=False),
        encoding="utf-8",
        errors="backslashreplace",
        write_through=True,
    )
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(
        io.FileIO(2, "w", closefd=False),
        encoding="utf-8",
        errors="backslashreplace",
        write_through=True,
    )
    sys.argv = ["-c"]
    sys.path = [workdir] + [p for p in sys.path if p and p != workdir]
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = main
    return main.__dict__


def run_main(code: bytes, namespace: dict) -> int:
    """Run `code` as `__main__` in this interpreter, like `python -c`; return the exit code."""
    import atexit
    import threading
    import traceback

    rc = 0
    try:
        exec(compile(code, "<string>", "exec"), namespace)
    except SystemExit as e:
        rc = _exit_code(e)
    except BaseException as e:  # noqa: BLE001 - any uncaught error is the program's own failure
        tb = e.__traceback__.tb_next if e.__traceback__ is not None else None
        try:
            traceback.print_exception(type(e), e, tb)
        except Exception:  # stderr may be gone; the exit code still says it failed
            pass
        rc = 1
    for finish in (threading._shutdown, atexit._run_exitfuncs):  # what interpreter exit does
        try:
            finish()
        except SystemExit as e:
            rc = _exit_code(e)
        except BaseException:  # noqa: BLE001 - a failing atexit hook must not skip os._exit
            rc = rc or 1
    for s in (sys.stdout, sys.stderr):
        try:
            s.flush()
        except Exception:  # closed or broken pipe: nothing more can be delivered
            pass
    return rc


def reap_until(child: int, deadline: float) -> int | None:
    """Reap every child (we may be PID 1) until `child` exits; its wait status, or None at deadline.

    SIGCHLD must already be blocked in the caller so `sigtimedwait` can wait for it.
    """
    status = None
    while True:
        while True:
            try:
                pid, st = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                pid = 0
            if pid == 0:
                break
            if pid == child:
                status = st
        if status is not None:
            return status
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        signal.sigtimedwait([signal.SIGCHLD], min(remaining, 1.0))


def write_status(fd: int, status: dict) -> None:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    status.update(cpu_s=ru.ru_utime + ru.ru_stime, maxrss_kb=ru.ru_maxrss)
    try:
        os.write(fd, json.dumps(status).encode() + b"\n")
    except OSError:  # the supervisor is gone; nobody is left to tell
        pass


def standalone_main() -> None:
    """Entry of a job in a fresh interpreter (bubblewrap, unsafe-local): init + job in one file.

    The parent stays as a small init that reaps and reports the job's wait status on fd 4; the
    job runs in a forked child so a crash by signal is still reported precisely.
    """
    header, code, files = read_payload(3)
    os.close(3)
    workdir = header.get("workdir") or os.getcwd()
    os.chdir(workdir)
    write_files(files, workdir)
    lim = header["limits"]
    apply_rlimits(lim, address_space=True)
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGCHLD])
    pid = os.fork()
    if pid == 0:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGCHLD])
        os.close(4)
        os._exit(run_main(code, prepare_main(workdir)))
    for fd in (0, 1, 2):
        os.close(fd)
    st = reap_until(pid, time.monotonic() + lim["wall_s"] + 1.0)
    write_status(4, {"timeout": True} if st is None else {"wstatus": st})
    os._exit(0)
