"""Per-slot cgroups for the sandbox supervisor, in whatever hierarchies this host lets us write.

Hosts differ: this project's machines have cgroup v1 `memory` and `pids` plus a v2 tree without
controllers but with `cgroup.kill`; a modern host has only v2 (memory.max, pids.max, cgroup.kill)
where our own cgroup may or may not delegate controllers. Every feature is probed, used when
present and listed in `Cgroups.features`; the sandbox falls back to rlimits for what is missing.
"""

from __future__ import annotations

import os
import signal
import time


def _write(path: str, text: str) -> bool:
    try:
        with open(path, "w") as f:
            f.write(text)
        return True
    except OSError:
        return False


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _counter(path: str, key: str) -> int:
    for line in _read(path).splitlines():
        k, _, v = line.partition(" ")
        if k == key:
            return int(v)
    return 0


class Cgroups:
    """Per-slot cgroups in every hierarchy this host lets us write; each part is optional.

    Layout: <mount>/<our own cgroup>/agentgrpo-sandbox-<pid>/slot<i>. Hosts differ (this one has
    v1 memory and pids plus a v2 tree without controllers but with `cgroup.kill`; a modern host
    has only v2), so every feature is probed and recorded in `features`.
    """

    def __init__(self, slots: int, enabled: bool = True) -> None:
        self.slots = slots
        self.name = f"agentgrpo-sandbox-{os.getpid()}"
        self.mem_v1: list[str] | None = None
        self.pids_v1: list[str] | None = None
        self.v2: list[str] | None = None
        self.mem_v2 = self.pids_v2 = False
        self._bases: list[str] = []
        self._oom0 = [0] * slots
        self.kill_v2 = False
        if not enabled or slots == 0 or os.geteuid() != 0:
            return
        own: dict[str, str] = {}
        for line in _read("/proc/self/cgroup").splitlines():
            _, ctrls, path = line.split(":", 2)
            for c in ctrls.split(",") if ctrls else [""]:
                own[c] = path
        mounts: dict[str, str] = {}
        for line in _read("/proc/self/mountinfo").splitlines():
            pre, _, post = line.partition(" - ")
            fstype, _, opts = post.split(" ", 2)
            mnt = pre.split(" ")[4]
            if fstype == "cgroup2":
                mounts.setdefault("", mnt)
            elif fstype == "cgroup":
                for c in ("memory", "pids"):
                    if c in opts.split(",") or c in opts.split(" ")[-1].split(","):
                        mounts.setdefault(c, mnt)
        if "memory" in mounts and "memory" in own:
            self.mem_v1 = self._make(mounts["memory"] + own["memory"], "memory.limit_in_bytes")
        if "pids" in mounts and "pids" in own:
            self.pids_v1 = self._make(mounts["pids"] + own["pids"], "pids.max")
        if "" in mounts and "" in own:
            parent = mounts[""] + own[""]
            self.v2 = self._make(parent, "cgroup.procs", v2=True)
            if self.v2:
                self.mem_v2 = self.mem_v1 is None and os.path.exists(self.v2[0] + "/memory.max")
                self.pids_v2 = self.pids_v1 is None and os.path.exists(self.v2[0] + "/pids.max")
                self.kill_v2 = os.path.exists(self.v2[0] + "/cgroup.kill")

    def _make(self, parent: str, probe: str, v2: bool = False) -> list[str] | None:
        if not os.path.isdir(parent):
            return None
        self._reap_stale(parent)
        base = os.path.join(parent, self.name)
        try:
            os.makedirs(base, exist_ok=True)
            if v2:  # best effort: delegate memory/pids if our parent lets us (no error otherwise)
                ctrls = _read(base + "/cgroup.controllers").split()
                want = [c for c in ("memory", "pids") if c in ctrls]
                if want:
                    _write(base + "/cgroup.subtree_control", " ".join("+" + c for c in want))
            dirs = []
            for i in range(self.slots):
                d = os.path.join(base, f"slot{i}")
                os.makedirs(d, exist_ok=True)
                dirs.append(d)
        except OSError:
            self._rmtree(base)
            return None
        if not os.path.exists(os.path.join(dirs[0], probe)):
            self._rmtree(base)
            return None
        self._bases.append(base)
        return dirs

    @staticmethod
    def _reap_stale(parent: str) -> None:
        """Remove cgroups left by supervisors that died without cleaning up."""
        for entry in os.listdir(parent):
            if not entry.startswith("agentgrpo-sandbox-"):
                continue
            try:
                pid = int(entry.rsplit("-", 1)[1])
                os.kill(pid, 0)
                continue  # still alive
            except (ValueError, ProcessLookupError):
                pass
            except PermissionError:
                continue
            Cgroups._rmtree(os.path.join(parent, entry), kill=True)

    @staticmethod
    def _rmtree(base: str, kill: bool = False) -> None:
        for root, _dirs, _ in os.walk(base, topdown=False):
            if kill:
                for pid in _read(root + "/cgroup.procs").split():
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except OSError:
                        pass
                _write(root + "/cgroup.kill", "1")
            for _ in range(50):
                try:
                    os.rmdir(root)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.01)

    @property
    def memory(self) -> bool:
        return self.mem_v1 is not None or self.mem_v2

    @property
    def features(self) -> list[str]:
        f = []
        if self.mem_v1:
            f.append("cgroup-v1-memory")
        if self.pids_v1:
            f.append("cgroup-v1-pids")
        if self.v2:
            f.append("cgroup-v2" + ("-kill" if self.kill_v2 else ""))
        if self.mem_v2:
            f.append("cgroup-v2-memory")
        if self.pids_v2:
            f.append("cgroup-v2-pids")
        return f

    def procs_paths(self, slot: int) -> list[str]:
        return [d[slot] + "/cgroup.procs" for d in (self.mem_v1, self.pids_v1, self.v2) if d]

    def prepare(self, slot: int, lim: dict) -> None:
        mem = lim["memory_mb"] << 20
        npids = str(lim["processes"] + 2)  # + the init and a margin for its fork
        if self.mem_v1:
            d = self.mem_v1[slot]
            # memsw (memory+swap) must stay >= memory: try both orders
            for _ in range(2):
                ok = _write(d + "/memory.limit_in_bytes", str(mem))
                if os.path.exists(d + "/memory.memsw.limit_in_bytes"):
                    ok = _write(d + "/memory.memsw.limit_in_bytes", str(mem)) and ok
                if ok:
                    break
            self._oom0[slot] = _counter(d + "/memory.oom_control", "oom_kill")
        if self.pids_v1:
            _write(self.pids_v1[slot] + "/pids.max", npids)
        if self.v2:
            d = self.v2[slot]
            if self.mem_v2:
                _write(d + "/memory.max", str(mem))
                _write(d + "/memory.swap.max", "0")
                self._oom0[slot] = _counter(d + "/memory.events", "oom_kill")
            if self.pids_v2:
                _write(d + "/pids.max", npids)

    def oom_killed(self, slot: int) -> bool:
        if self.mem_v1:
            return (
                _counter(self.mem_v1[slot] + "/memory.oom_control", "oom_kill") > self._oom0[slot]
            )
        if self.mem_v2:
            return _counter(self.v2[slot] + "/memory.events", "oom_kill") > self._oom0[slot]
        return False

    def kill(self, slot: int) -> None:
        if self.kill_v2 and _write(self.v2[slot] + "/cgroup.kill", "1"):
            return
        for d in (self.pids_v1, self.mem_v1):
            if d:
                for pid in _read(d[slot] + "/cgroup.procs").split():
                    try:
                        os.kill(int(pid), signal.SIGKILL)
                    except OSError:
                        pass

    def empty(self, slot: int) -> bool:
        if self.v2 and "populated 1" in _read(self.v2[slot] + "/cgroup.events"):
            return False
        return not any(
            _read(d[slot] + "/cgroup.procs").strip() for d in (self.pids_v1, self.mem_v1) if d
        )

    def close(self) -> None:
        for base in self._bases:
            self._rmtree(base, kill=True)
        self._bases = []
