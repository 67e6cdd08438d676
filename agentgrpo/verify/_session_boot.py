"""The entry point of a sandbox session's process, and its `namespaces` host.

`_session_client.py` starts it as `python -I -c BOOT VERIFY_DIR MODE CONFIG SOCKET_FD`, as a plain
script whose siblings are top-level modules. Under `namespaces` (root) the host makes the
session's cgroups, unshares the PID, network, IPC and UTS namespaces and forks the init
(`_session_init.py`); it waits for the init, then removes the cgroups. Under `bwrap` the init
runs directly, inside bubblewrap.
"""

from __future__ import annotations

import json
import os
import socket
import time

try:
    from . import _forkserver
    from ._cgroups import Cgroups
    from ._frames import pack
    from ._session_init import _serve_init
except ImportError:  # started as a plain script: siblings are top-level modules
    import _forkserver
    from _cgroups import Cgroups
    from _frames import pack
    from _session_init import _serve_init

_NS = {"pid": 0x20000000, "net": 0x40000000, "ipc": 0x08000000, "uts": 0x04000000}


def _host(cfg: dict, sock_fd: int) -> int:
    """The `namespaces` host: cgroups, namespaces, the init; then wait and clean up."""
    sock = socket.socket(fileno=sock_fd)
    cg = Cgroups(1)
    cg.prepare(0, cfg["limits"])
    fds = [os.open(p, os.O_WRONLY | os.O_CLOEXEC) for p in cg.procs_paths(0)]
    cfg["memory_cgroup"] = cg.memory
    fs = _forkserver
    flags = _NS["pid"] | _NS["net"] | _NS["ipc"] | _NS["uts"]
    fs._ok(fs._libc.unshare(flags), "unshare(PID|NET|IPC|UTS)")
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(go_w)
        os._exit(_serve_init(cfg, sock, fds, go_r))
    os.close(go_r)
    for fd in fds:
        os.close(fd)
    sock.sendall(pack({"op": "host", "init_pid": pid, "features": cg.features}, []))
    sock.close()
    os.write(go_w, b"1")
    os.close(go_w)
    while True:
        try:
            os.waitpid(pid, 0)
            break
        except InterruptedError:
            continue
    empty = False
    for i in range(500):  # the PID namespace is gone with its init; the cgroup says so
        if cg.empty(0):
            empty = True
            break
        if i % 50 == 0:
            cg.kill(0)
        time.sleep(0.01)
    cg.close()
    return 0 if empty else 3


def main(argv: list[str]) -> int:
    mode, cfg, fd = argv[0], json.loads(argv[1]), int(argv[2])
    cfg["mode"] = mode
    if mode == "namespaces":
        return _host(cfg, fd)
    cfg.setdefault("memory_cgroup", False)
    return _serve_init(cfg, socket.socket(fileno=fd), [], None)
