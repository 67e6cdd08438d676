"""Checkpoints: written atomically, verified by checksum, restored newest-first with fallback.

A checkpoint `checkpoints/step-000012/` holds what the learner writes (weights or the LoRA adapter
and `learner.pt`, or the sharded format's `dcp/`) and `trainer.json`, the manifest: the trainer's
state (step, data position, weight version, RNG states) and the size and SHA-256 of every file.

- `save` writes into `.tmp-step-*`, fsyncs, writes the manifest last and renames, so a kill leaves
  the complete checkpoint or none; then it prunes to `keep`.
- `restore` tries checkpoints newest-first, skipping with a warning one that fails `verify` or
  that the learner cannot load; with `strict`, `NoUsableCheckpoint` when all fail.
- `set_aside_newer` renames the checkpoints above a resumed (or saved) step to `rejected-step-*`,
  which no restore tries and no prune counts.

docs/learner.md ("Checkpoints and resuming") gives the layout, the rules and their reasons.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import pickle
import random
import re
import shutil
import signal
import stat
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from torch.distributed.checkpoint import CheckpointException

MANIFEST = "trainer.json"

# What loading a checkpoint raises when a file cannot be parsed, whatever its manifest says (a
# planted or rewritten file verifies): safetensors header errors, torch's weights-only unpickler,
# a `learner.pt` holding another structure (TypeError, AttributeError, KeyError, IndexError), DCP's
# CheckpointException (a BaseException) around a shard it cannot read, and a state dict that does
# not fit the model (RuntimeError, ValueError). Each means "not this checkpoint".
UNLOADABLE: tuple[type[BaseException], ...] = (
    OSError,
    ValueError,
    RuntimeError,
    KeyError,
    IndexError,
    TypeError,
    AttributeError,
    EOFError,
    pickle.UnpicklingError,
    SafetensorError,
    CheckpointException,
)


class CorruptCheckpoint(ValueError):
    """A checkpoint directory is incomplete or its files do not match its manifest."""


class NoUsableCheckpoint(ValueError):
    """Checkpoints exist but none verifies and loads; `reasons` maps each directory to its
    reason."""

    def __init__(self, root: Path, reasons: dict[Path, str]) -> None:
        self.root, self.reasons = root, reasons
        super().__init__(
            f"no checkpoint under {root} verifies and loads:\n"
            + "\n".join(f"  {d.name}: {r}" for d, r in reasons.items())
        )


def _number(directory: Path) -> int | None:
    """The step of a `step-NNNNNN` directory name; None for anything else."""
    digits = directory.name.removeprefix("step-")
    ok = directory.name.startswith("step-") and digits.isascii() and digits.isdigit()
    return int(digits) if ok else None


def checkpoints(root: Path) -> list[Path]:
    """The `step-*` checkpoint directories under `root`, oldest first by step number (not by name:
    `step-1000000` comes after `step-999999`)."""
    found = [d for d in root.glob("step-*") if _number(d) is not None]
    return sorted(found, key=_number)  # type: ignore[arg-type, return-value]


def rng_state() -> dict[str, Any]:
    """Every RNG a run draws from, as JSON-serialisable values."""
    state: dict[str, Any] = {
        "python": repr(random.getstate()),
        "numpy": [x.tolist() if hasattr(x, "tolist") else x for x in np.random.get_state()],
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(ast.literal_eval(state["python"]))
    np_state = state["numpy"]
    np.random.set_state((np_state[0], np.array(np_state[1], dtype=np.uint32), *np_state[2:]))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        # Saved for every device the run saw; a resume that sees fewer sets those it has (torch's
        # set_rng_state_all would index past them), one that sees more leaves the rest as they are.
        for i, s in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(torch.tensor(s, dtype=torch.uint8), i)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(
    root: Path,
    step: int,
    write_payload: Callable[[Path], None],
    trainer_state: dict[str, Any],
    keep: int = 2,
    *,
    is_main: bool = True,
    barrier: Callable[[], None] = lambda: None,
) -> Path:
    """Write checkpoint `step` under `root`; `write_payload(tmp_dir)` writes model and optimizer.

    The new checkpoint is the run's newest state: checkpoints numbered above `step` (a resumed run
    has normally set them aside already) are set aside (`set_aside_newer`), never pruned, and
    pruning keeps the new checkpoint and the `keep - 1` newest ones numbered below it, and the
    `keep` newest set-aside ones (`rejected_checkpoints`).

    Many processes: every rank calls it with the same arguments; rank 0 (`is_main`) prepares the
    temporary directory (removing every leftover `.tmp-step-*` of a killed save) and, once every
    rank's `write_payload` has returned (`barrier`), writes the manifest, renames and prunes.
    """
    final = root / f"step-{step:06d}"
    tmp = root / f".tmp-step-{step:06d}"
    if is_main:
        root.mkdir(parents=True, exist_ok=True)
        for leftover in root.glob(".tmp-step-*"):  # killed saves, of this step or any other
            shutil.rmtree(leftover, ignore_errors=True)
        tmp.mkdir()
    barrier()
    write_payload(tmp)
    barrier()
    if not is_main:
        return final
    files = {}
    for f in sorted(p for p in tmp.rglob("*") if p.is_file()):
        _fsync(f)
        files[str(f.relative_to(tmp))] = {"bytes": f.stat().st_size, "sha256": _sha256(f)}
    manifest = tmp / MANIFEST
    manifest.write_text(json.dumps({"step": step, **trainer_state, "files": files}))
    _fsync(manifest)
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    _fsync(root)
    set_aside_newer(root, step)  # the step just written is the run's newest state
    older = [d for d in checkpoints(root) if _number(d) < step]  # type: ignore[operator]
    for old in older[: max(len(older) - (keep - 1), 0)]:
        shutil.rmtree(old, ignore_errors=True)
    rejected = rejected_checkpoints(root)
    for old in rejected[: max(len(rejected) - keep, 0)]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def rejected_checkpoints(root: Path) -> list[Path]:
    """The `rejected-step-*` directories under `root`, oldest first (by step, then by the `.N`
    of a step set aside more than once)."""

    def order(d: Path) -> tuple[int, int]:
        step, _, n = d.name.removeprefix("rejected-step-").partition(".")
        return int(step), int(n or 1)

    found = [
        d
        for d in root.glob("rejected-step-*")
        if re.fullmatch(r"rejected-step-[0-9]+(\.[0-9]+)?", d.name) and d.is_dir()
    ]
    return sorted(found, key=order)


def _read_manifest(directory: Path) -> dict[str, Any]:
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise CorruptCheckpoint(f"no readable {MANIFEST}: {e}") from None
    if not isinstance(manifest, dict):
        raise CorruptCheckpoint(f"{MANIFEST} holds a {type(manifest).__name__}, not an object")
    return manifest


def _only_plain_files(directory: Path) -> None:
    """CorruptCheckpoint unless everything under `directory` is a directory or a regular file: a
    symbolic link would make verification and loading read a file outside the checkpoint (any
    file the run can read, or a FIFO or device that never ends), and the writer makes none."""
    for parent, dirs, files in os.walk(directory):  # never descends into linked directories
        for name in dirs + files:
            path = Path(parent, name)
            mode = os.lstat(path).st_mode
            if stat.S_ISLNK(mode):
                raise CorruptCheckpoint(
                    f"{path.relative_to(directory)} is a symbolic link; a checkpoint holds only "
                    "its own files"
                )
            if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
                raise CorruptCheckpoint(f"{path.relative_to(directory)} is not a regular file")


def _manifest_path(directory: Path, name: str) -> Path:
    """The file `name` of the manifest names, which must be a relative path below `directory`."""
    parts = name.split("/")
    if "\\" in name or "\0" in name or any(p in ("", ".", "..") for p in parts):
        raise CorruptCheckpoint(f"{MANIFEST} names {name!r:.80}, which is not a file inside it")
    return directory.joinpath(*parts)


def verify(directory: Path) -> dict[str, Any]:
    """The manifest of a complete, intact checkpoint; raises CorruptCheckpoint otherwise (also
    when it holds a symbolic link or names a file outside its directory)."""
    _only_plain_files(directory)
    manifest = _read_manifest(directory)
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        raise CorruptCheckpoint(f"{MANIFEST} lists no files")
    for name, meta in files.items():
        path = _manifest_path(directory, name)
        if not path.is_file():
            raise CorruptCheckpoint(f"{name} is missing")
        if not (
            isinstance(meta, dict)
            and isinstance(meta.get("bytes"), int)
            and isinstance(meta.get("sha256"), str)
        ):
            raise CorruptCheckpoint(f"{MANIFEST}: the entry of {name} is not {{bytes, sha256}}")
        if path.stat().st_size != meta["bytes"]:
            raise CorruptCheckpoint(
                f"{name} has {path.stat().st_size} bytes, manifest says {meta['bytes']}"
            )
        if _sha256(path) != meta["sha256"]:
            raise CorruptCheckpoint(f"{name} does not match its checksum")
    return manifest


def _step_dir(directory: Path) -> Path:
    """`directory`, a numbered checkpoint of a run, unless it is a symbolic link (to a checkpoint
    outside the run's directory)."""
    if directory.is_symlink():
        raise CorruptCheckpoint("it is a symbolic link; a run's checkpoints are directories")
    return directory


def latest(root: Path) -> tuple[Path, dict[str, Any]] | None:
    """Newest intact checkpoint and its manifest; damaged ones are skipped with a warning."""
    for d in reversed(checkpoints(root)):
        try:
            return d, verify(_step_dir(d))
        except CorruptCheckpoint as e:
            warnings.warn(f"skipping checkpoint {d}: {e}", stacklevel=2)
    return None


def restore(
    root: Path,
    load: Callable[[Path], None],
    *,
    check: bool = True,
    all_ranks: Callable[[bool], bool] = bool,
    strict: bool = False,
) -> tuple[Path, dict[str, Any]] | None:
    """Load the newest checkpoint that verifies and that `load(dir)` accepts; None if there is none.

    A checkpoint that fails either way is skipped with a warning and the previous one is tried.
    `load` must leave nothing half-applied that a later successful `load` would not overwrite.
    When every checkpoint fails: None, or with `strict` a `NoUsableCheckpoint` naming each one and
    why (a resumed run must not silently start again from step 0 in the same directory).

    Many processes: every rank calls `restore` over the same directory; only rank 0 reads the
    checksums (`check`, the expensive part; the others read the manifest), and `all_ranks(ok)` (True
    only when `ok` holds on every rank, e.g. `Learner.all_ranks`) makes all of them load, or skip,
    the same checkpoint.
    """
    reasons: dict[Path, str] = {}
    for d in reversed(checkpoints(root)):
        manifest, error = None, None
        try:
            manifest = verify(_step_dir(d)) if check else _read_manifest(d)
        except CorruptCheckpoint as e:
            error = e
        if all_ranks(error is None):
            try:
                load(d)
            except UNLOADABLE as e:  # a file that cannot be parsed: not this checkpoint
                error = e
            if all_ranks(error is None):
                return d, manifest  # type: ignore[return-value]
        reasons[d] = f"{type(error).__name__}: {error}" if error else "rejected on another rank"
        warnings.warn(f"skipping checkpoint {d}: {reasons[d]}", stacklevel=2)
    if strict and reasons:
        raise NoUsableCheckpoint(root, reasons)
    return None


def set_aside_newer(root: Path, step: int) -> list[Path]:
    """Rename the checkpoints numbered above `step` (the one a run resumed from, or just saved) to
    `rejected-step-*` (`rejected-step-*.2`, ... when that name is taken); returns the new paths.

    Call it on one process (rank 0; after a resume, once `restore` returned on every rank). Nothing
    is deleted, but the renamed ones are out of the run: no later restore tries them and no save
    counts them when it prunes.
    """
    moved = []
    for d in checkpoints(root):
        if _number(d) > step:  # type: ignore[operator]
            target, n = root / f"rejected-{d.name}", 1
            while target.exists():
                n += 1
                target = root / f"rejected-{d.name}.{n}"
            d.rename(target)
            moved.append(target)
    if moved:
        _fsync(root)
    return moved


class StopRequested:
    """Turns SIGTERM (and SIGINT) into a flag the loop checks between steps, so a preempted run
    writes a checkpoint of the last finished step and exits instead of losing it.

    Example:
        with StopRequested() as stop:
            for step in ...:
                ...
                if stop:
                    save(step + 1)
                    break
    """

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)) -> None:
        self.signals, self.requested, self._old = signals, False, {}

    def __bool__(self) -> bool:
        return self.requested

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:  # a second signal: stop at once
            raise KeyboardInterrupt
        self.requested = True
        print(
            f"signal {signum}: saving after the current step (send again to stop at once)",
            flush=True,
        )

    def install(self) -> StopRequested:
        """Take over the signals (main thread only: elsewhere Python cannot install handlers)."""
        if threading.current_thread() is threading.main_thread():
            self._old = {s: signal.signal(s, self._handle) for s in self.signals}
        return self

    def uninstall(self) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old = {}

    def __enter__(self) -> StopRequested:
        return self.install()

    def __exit__(self, *exc: Any) -> None:
        self.uninstall()
