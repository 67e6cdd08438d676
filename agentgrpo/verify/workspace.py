"""Task workspaces: prepared once per task, forked for each trajectory, identical at the start.

    spec = Workspace(files={"calc.py": "...", "tests/test_calc.py": "..."}, setup=["make"])
    ws = await sandbox.session(spec)   # prepares `spec` once (cached by its content), then forks it
    ws.workspace_checksum              # "sha256:...": the same for every fork of `spec`

Preparing writes the files into a fresh directory of the sandbox's state directory (root only),
runs the setup commands there in a session (sandboxed, no network), takes the tree's checksum
(`_tree.py`) and never writes the tree again. A fork (`SandboxConfig.fork`) is an overlay in the
session's mount namespace (nothing copied; a write copies up), a tree of hard links to the
prepared files made read-only and root-owned (a write must replace the file), or a full copy
(the baseline). Unused trees are kept, the `keep_prepared` most recent, so a group whose members
start one after another prepares once. Threat model and measurements: docs/sandbox.md.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import stat
import tempfile
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator

from agentgrpo.verify._tree import tree_checksum
from agentgrpo.verify.session import Session, SessionError, SessionLimits, WorkspaceMount

ForkMode = Literal["overlay", "hardlink", "copy"]


class WorkspaceSetupError(RuntimeError):
    """A setup command of a task's workspace failed: the task is broken, not the model."""


class Workspace(BaseModel):
    """A task's workspace: its files and the commands that set it up, run once when prepared."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    files: dict[str, str | bytes] = Field(
        default_factory=dict, description="relative path -> content (text is written as UTF-8)"
    )
    executable: tuple[str, ...] = Field((), description="paths among `files` made executable")
    setup: tuple[str, ...] = Field(
        (), description="shell commands run once in the prepared tree, in the sandbox, in order"
    )
    setup_timeout_s: float = Field(300.0, gt=0, description="time limit of each setup command")
    _key: str | None = PrivateAttr(None)

    @field_validator("files")
    @classmethod
    def _relative(cls, files: dict[str, str | bytes]) -> dict[str, str | bytes]:
        for name in files:
            parts = name.split("/")
            if not name or name.startswith("/") or any(p in ("", ".", "..") for p in parts):
                raise ValueError(f"workspace file names are plain relative paths, got {name!r}")
        return files

    def key(self) -> str:
        """A digest of everything that decides the prepared tree (same key, same tree); computed
        once per instance (a group's members share theirs)."""
        if self._key is None:
            self._key = self._digest()
        return self._key

    def _digest(self) -> str:
        h = hashlib.sha256()
        for name in sorted(self.files):
            data = self.files[name]
            raw = data.encode() if isinstance(data, str) else data
            h.update(f"{name}\0{len(raw)}\0".encode() + raw)
        h.update(repr((sorted(self.executable), self.setup)).encode())
        return h.hexdigest()[:32]

    @classmethod
    def from_dir(cls, path: str | Path, **kwargs: object) -> Workspace:
        """A workspace holding the files under `path` (a repository snapshot), executable bits
        kept; `kwargs` go to the constructor (e.g. `setup=[...]`)."""
        root = Path(path)
        files: dict[str, str | bytes] = {}
        executable = []
        for p in sorted(root.rglob("*")):
            if p.is_file() and not p.is_symlink():
                rel = p.relative_to(root).as_posix()
                raw = p.read_bytes()
                try:
                    files[rel] = raw.decode()
                except UnicodeDecodeError:
                    files[rel] = raw
                if p.stat().st_mode & 0o100:
                    executable.append(rel)
        return cls(files=files, executable=tuple(executable), **kwargs)


@dataclass(frozen=True)
class PreparedWorkspace:
    """A prepared tree: where it is, its checksum, and how it is forked."""

    key: str
    path: str
    checksum: str
    fork: ForkMode
    size_bytes: int
    num_files: int


class _Entry:
    def __init__(self) -> None:
        self.ready = threading.Event()
        self.prepared: PreparedWorkspace | None = None
        self.error: BaseException | None = None
        self.users = 0


# (mount, limits, workspace checksum, fork mode) -> a started session
StartSession = Callable[[WorkspaceMount, SessionLimits, "str | None", str], Session]


class WorkspaceStore:
    """The prepared workspaces of one sandbox, in a root-only state directory (see module doc)."""

    def __init__(
        self, state_dir: str | None, fork: ForkMode, uid: int, keep: int, start: StartSession
    ) -> None:
        self.fork, self.uid, self.keep, self._start = fork, uid, keep, start
        self.dir = tempfile.mkdtemp(prefix="agentgrpo-workspaces-", dir=state_dir)
        os.chmod(self.dir, 0o700)
        for sub in ("prepared", "forks"):
            os.mkdir(os.path.join(self.dir, sub), 0o700)
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, _Entry] = OrderedDict()

    def acquire(self, spec: Workspace) -> PreparedWorkspace:
        """The prepared tree of `spec` (preparing it unless another caller has, or is), held until
        `release`. Blocking; a failed preparation raises here for every caller waiting on it."""
        key = f"{spec.key()}-{self.fork}"
        with self._lock:
            entry = self._entries.get(key)
            mine = entry is None
            if mine:
                entry = self._entries[key] = _Entry()
            entry.users += 1
            self._entries.move_to_end(key)
        if mine:
            try:
                entry.prepared = self._prepare(key, spec)
            except BaseException as e:
                entry.error = e
                with self._lock:
                    self._entries.pop(key, None)
                raise
            finally:
                entry.ready.set()
        entry.ready.wait()
        if entry.error is not None:
            raise entry.error
        assert entry.prepared is not None
        return entry.prepared

    def release(self, prepared: PreparedWorkspace) -> None:
        """One user fewer; unused trees beyond the `keep` most recent are removed."""
        gone = []
        with self._lock:
            entry = self._entries.get(f"{prepared.key}-{prepared.fork}")
            if entry is not None:
                entry.users -= 1
            unused = [k for k, e in self._entries.items() if e.users <= 0 and e.prepared]
            for k in unused[: max(0, len(unused) - self.keep)]:
                gone.append(self._entries.pop(k).prepared)
        for p in gone:
            shutil.rmtree(os.path.dirname(p.path), ignore_errors=True)

    def _prepare(self, key: str, spec: Workspace) -> PreparedWorkspace:
        base = os.path.join(self.dir, "prepared", key)
        tree = os.path.join(base, "tree")
        shutil.rmtree(base, ignore_errors=True)
        os.makedirs(tree, 0o755)
        for name, data in spec.files.items():
            path = os.path.join(tree, name)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(data.encode() if isinstance(data, str) else data)
            os.chmod(path, 0o755 if name in spec.executable else 0o644)
        _chown_tree(tree, self.uid)
        if spec.setup:
            self._run_setup(tree, spec)
        if self.fork == "hardlink":  # links share inodes: none may be writable by a session
            _freeze(tree)
        size, count = _tree_size(tree)
        return PreparedWorkspace(key, tree, tree_checksum(tree), self.fork, size, count)

    def _run_setup(self, tree: str, spec: Workspace) -> None:
        """Each setup command in a session whose /workspace is the tree itself (a bind)."""
        limits = SessionLimits(
            call_timeout_s=spec.setup_timeout_s,
            episode_s=spec.setup_timeout_s * len(spec.setup) + 1.0,
        )
        session = self._start(WorkspaceMount("bind", tree), limits, None, "prepare")

        async def run_all() -> None:
            for cmd in spec.setup:
                res = await session.exec(["bash", "-c", cmd], timeout_s=spec.setup_timeout_s)
                if res.status != "ok":
                    if res.status == "sandbox_error":
                        raise SessionError(f"workspace setup {cmd!r}: {res.detail}")
                    raise WorkspaceSetupError(
                        f"workspace setup command {cmd!r} failed ({res.status}, exit "
                        f"{res.exit_code}): {(res.stderr or res.stdout)[-1000:]}"
                    )

        try:
            asyncio.run(run_all())
        finally:
            session.close_sync()

    def mount(self, prepared: PreparedWorkspace) -> tuple[WorkspaceMount, Callable[[], None]]:
        """A fork of `prepared` for one session, and what removes it once the session is gone."""
        if prepared.fork == "overlay":
            return WorkspaceMount("overlay", prepared.path), lambda: None
        fork = os.path.join(self.dir, "forks", uuid.uuid4().hex)
        if prepared.fork == "hardlink":
            _link_tree(prepared.path, fork, self.uid)
        else:
            shutil.copytree(prepared.path, fork, symlinks=True)
            _chown_tree(fork, self.uid)
        return WorkspaceMount("bind", fork), lambda: shutil.rmtree(fork, ignore_errors=True)

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


def _chown_tree(root: str, uid: int) -> None:
    for dirpath, dirnames, filenames in os.walk(root):
        os.lchown(dirpath, uid, uid)
        for name in dirnames + filenames:
            os.lchown(os.path.join(dirpath, name), uid, uid)


def _freeze(root: str) -> None:
    """Root-owned files without write bits: a session (another uid) can neither write nor chmod
    them, so the bytes its hard links share stay as prepared."""
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            os.lchown(path, 0, 0)
            if stat.S_ISREG(st.st_mode):
                os.chmod(path, st.st_mode & ~0o222 & 0o7777)


def _link_tree(src: str, dst: str, uid: int) -> None:
    """New directories (owned by `uid`) holding hard links to `src`'s files and copies of its
    symlinks."""
    for dirpath, dirnames, filenames in os.walk(src):
        rel = os.path.relpath(dirpath, src)
        target = dst if rel == "." else os.path.join(dst, rel)
        os.mkdir(target, os.stat(dirpath).st_mode & 0o7777)
        os.chown(target, uid, uid)
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            path = os.path.join(dirpath, name)
            if os.path.islink(path):
                os.symlink(os.readlink(path), os.path.join(target, name))
                os.lchown(os.path.join(target, name), uid, uid)
            else:
                os.link(path, os.path.join(target, name))


def _tree_size(root: str) -> tuple[int, int]:
    size = count = 0
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            st = os.lstat(os.path.join(dirpath, name))
            size, count = size + st.st_size, count + 1
    return size, count


def workspace_of(value: Workspace | Mapping[str, object] | None) -> Workspace | None:
    """A `Workspace` from itself or its dict form (a task file's `workspace` field)."""
    if value is None or isinstance(value, Workspace):
        return value
    return Workspace.model_validate(value)
