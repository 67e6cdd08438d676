"""A session's jail, built once by its init as root (`_session_init.py`, namespaces backend):
join the cgroups, assemble the one-shot jobs' minimal read-only root with the workspace at
/workspace (an overlay on the prepared tree with a size-limited tmpfs upper layer, a bind of a
fork directory, or an empty tmpfs), `pivot_root`, mount /tmp and a pid-only /proc, and install
the seccomp filter. Stdlib only: it runs from its source, imported as a plain script's sibling.
"""

from __future__ import annotations

import os
import signal
import sys

try:
    from . import _forkserver, _seccomp
except ImportError:  # started as a plain script: siblings are top-level modules
    import _forkserver
    import _seccomp


def setup(cfg: dict, uid: int, lim: dict, cgroup_fds: list[int]) -> None:
    """Join the cgroups, build the jail's root with the workspace, mount /tmp and /proc."""
    fs = _forkserver
    for fd in cgroup_fds:
        os.write(fd, b"0")
        os.close(fd)
    fs._libc.prctl(fs.PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # the host died: so do we
    fs._ok(fs._libc.unshare(fs.CLONE_NEWNS), "unshare(NEWNS)")
    fs._mount(None, "/", None, fs.MS_REC | fs.MS_PRIVATE)
    exe_dir = os.path.dirname(os.path.realpath(sys.executable))
    root = fs.assemble_root(
        [sys.prefix, sys.base_prefix, exe_dir, *cfg["ro_paths"]],
        [uid],
        uid + 1,
        home="/workspace",
        extra_dirs=("/workspace", "/.session"),
    )
    detach = _mount_workspace(cfg, uid, lim, root)
    fs.enter_root(root, detach)
    inodes = 1024 + 16 * lim["disk_mb"]
    tmp_opts = f"size={lim['disk_mb']}m,nr_inodes={inodes},mode=1777"
    fs._mount("tmpfs", "/tmp", "tmpfs", fs.MS_NOSUID | fs.MS_NODEV, tmp_opts)
    flags = fs.MS_NOSUID | fs.MS_NODEV | fs.MS_NOEXEC
    fs._mount("proc", "/proc", "proc", flags, "hidepid=invisible,subset=pid")
    fs._ok(fs._libc.sethostname(b"sandbox", 7), "sethostname")
    if _seccomp.supported():
        _seccomp.Installer().install()  # inherited by every process started from here


def _mount_workspace(cfg: dict, uid: int, lim: dict, root: str) -> tuple[str, ...]:
    """Mount the workspace at `root`/workspace; the mounts to detach after `pivot_root`."""
    fs, ws = _forkserver, cfg["workspace"]
    target = root + "/workspace"
    flags = fs.MS_NOSUID | fs.MS_NODEV
    if ws["kind"] == "bind":
        fs._mount(ws["path"], target, None, fs.MS_BIND)
        fs._mount(None, target, None, fs.MS_BIND | fs.MS_REMOUNT | flags)
        os.rmdir(root + "/.session")
        return ()
    staging = root + "/.session"  # the upper layer's tmpfs: reachable by the overlay only
    inodes = 1024 + 16 * lim["disk_mb"]
    opts = f"size={lim['disk_mb']}m,nr_inodes={inodes},mode=700"
    fs._mount("tmpfs", staging, "tmpfs", flags, opts)
    upper, work = staging + "/upper", staging + "/work"
    os.mkdir(upper)
    os.mkdir(work)
    if ws["kind"] == "overlay":
        st = os.stat(ws["lower"])
        os.chown(upper, st.st_uid, st.st_gid)
        os.chmod(upper, st.st_mode & 0o7777)
        data = f"lowerdir={ws['lower']},upperdir={upper},workdir={work}"
        fs._mount("overlay", target, "overlay", flags, data)
    else:  # "empty": a writable workspace of its own, in the session's tmpfs
        os.chown(upper, uid, uid)
        fs._mount(upper, target, None, fs.MS_BIND)
    return ("/.session",)
