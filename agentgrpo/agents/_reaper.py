"""Runs an MCP stdio server so that no process of it outlives its episode (Linux).

    python -I _reaper.py COMMAND [ARGS...]

`mcp` kills a server's process group only when the server does not exit within 2 s of its stdin
closing, and a daemon that left the group escapes even that: both outlived their episode. This
wrapper makes itself a child subreaper (`PR_SET_CHILD_SUBREAPER`), so every process the server
starts stays its descendant, orphans and double-forked daemons included. It starts the server
with its own stdin, stdout and stderr, then keeps only stderr. When the server exits, or the
wrapper gets SIGTERM, SIGINT or SIGHUP (`mcp`'s escalation) or loses its parent, it SIGKILLs
every descendant left, reaps them and exits with the server's status. Stdlib only.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


def descendants(root: int) -> list[int]:
    """Every live process below `root`, read from /proc."""
    parent: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parent[int(name)] = int(fields[1])
    below, todo = [], [root]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        below += kids
        todo += kids
    return below


def kill_all() -> None:
    """SIGKILL every descendant until none is left (one that forks meanwhile leaves its child
    to us, the subreaper: the next round finds it), reaping as they die."""
    me = os.getpid()
    for _ in range(1000):
        left = descendants(me)
        if not left:
            break
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _reap(block=True)
    _reap(block=False)


def _reap(block: bool) -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, 0 if block else os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0 or block:
            return


def _stop(signum: int, _frame: object) -> None:
    kill_all()
    os._exit(128 + signum)


def main(argv: list[str]) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _stop)
    server = os.fork()
    if server == 0:
        try:
            signal.signal(signal.SIGPIPE, signal.SIG_DFL)
            os.execvp(argv[0], argv)
        finally:
            os._exit(127)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)  # the server's pipes are its own: their ends close when it and its
    os.dup2(null, 1)  # children are gone
    status = 0
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        if pid == server:
            break
    kill_all()
    code = os.waitstatus_to_exitcode(status)
    return code if code >= 0 else 128 - code  # a signal's death, as a shell reports it


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
