"""Checkpoints: written atomically, verified by checksum, restored newest-first with fallback.

A checkpoint is a directory `checkpoints/step-000012/` holding what the learner writes (model
weights or the LoRA adapter as safetensors, `learner.pt` with optimizer, scheduler and step: tensors
and plain values, read with `weights_only=True`; or, in the sharded format, every rank's shards
under `dcp/`) and `trainer.json`: step, data position, weight version, RNG states (python, numpy,
torch, CUDA), and the size and SHA-256 of every other file.

Writing: everything goes to `.tmp-step-000012/`, files are fsynced, `trainer.json` is written last,
and the directory is renamed into place, so a kill at any moment leaves either the complete new
checkpoint or none (plus a temp dir that the next save removes). Only then are older checkpoints
beyond `keep` deleted. With several ranks, rank 0 creates the temp dir, every rank writes its part
between two barriers, and rank 0 alone writes the manifest and renames (the directory must be on a
filesystem every rank sees).

Reading: `restore` tries checkpoints newest-first; one whose manifest is missing or unreadable,
whose files differ in size or checksum from the manifest (truncated, bit rot), or that the learner
fails to load is skipped with a warning naming the reason, and the previous one is used.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

MANIFEST = "trainer.json"


class CorruptCheckpoint(ValueError):
    """A checkpoint directory is incomplete or its files do not match its manifest."""


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
    import ast

    random.setstate(ast.literal_eval(state["python"]))
    np_state = state["numpy"]
    np.random.set_state((np_state[0], np.array(np_state[1], dtype=np.uint32), *np_state[2:]))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


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


def save(root: Path, step: int, write_payload: Callable[[Path], None], trainer_state: dict[str, Any],
         keep: int = 2, *, is_main: bool = True, barrier: Callable[[], None] = lambda: None) -> Path:
    """Write checkpoint `step` under `root`; `write_payload(tmp_dir)` writes model and optimizer.

    Many processes: every rank calls it with the same arguments; rank 0 (`is_main`) prepares the
    temporary directory and, once every rank's `write_payload` has returned (`barrier`), writes the
    manifest, renames and prunes.
    """
    final = root / f"step-{step:06d}"
    tmp = root / f".tmp-step-{step:06d}"
    if is_main:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
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
    for old in sorted(root.glob("step-*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _read_manifest(directory: Path) -> dict[str, Any]:
    try:
        return json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise CorruptCheckpoint(f"no readable {MANIFEST}: {e}") from None


def verify(directory: Path) -> dict[str, Any]:
    """The manifest of a complete, intact checkpoint; raises CorruptCheckpoint otherwise."""
    manifest = _read_manifest(directory)
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        raise CorruptCheckpoint(f"{MANIFEST} lists no files")
    for name, meta in files.items():
        path = directory / name
        if not path.is_file():
            raise CorruptCheckpoint(f"{name} is missing")
        if path.stat().st_size != meta["bytes"]:
            raise CorruptCheckpoint(f"{name} has {path.stat().st_size} bytes, manifest says {meta['bytes']}")
        if _sha256(path) != meta["sha256"]:
            raise CorruptCheckpoint(f"{name} does not match its checksum")
    return manifest


def latest(root: Path) -> tuple[Path, dict[str, Any]] | None:
    """Newest intact checkpoint and its manifest; damaged ones are skipped with a warning."""
    for d in sorted(root.glob("step-*"), reverse=True):
        try:
            return d, verify(d)
        except CorruptCheckpoint as e:
            warnings.warn(f"skipping checkpoint {d}: {e}", stacklevel=2)
    return None


def restore(root: Path, load: Callable[[Path], None], *, check: bool = True,
            all_ranks: Callable[[bool], bool] = bool) -> tuple[Path, dict[str, Any]] | None:
    """Load the newest checkpoint that verifies and that `load(dir)` accepts; None if there is none.

    A checkpoint that fails either way is skipped with a warning and the previous one is tried.
    `load` must leave nothing half-applied that a later successful `load` would not overwrite.

    Many processes: every rank calls `restore` over the same directory; only rank 0 reads the
    checksums (`check`, the expensive part; the others read the manifest), and `all_ranks(ok)` (True
    only when `ok` holds on every rank, e.g. `Learner.all_ranks`) makes all of them load, or skip,
    the same checkpoint.
    """
    for d in sorted(root.glob("step-*"), reverse=True):
        manifest, error = None, None
        try:
            manifest = verify(d) if check else _read_manifest(d)
        except CorruptCheckpoint as e:
            error = e
        if all_ranks(error is None):
            try:
                load(d)
            except (OSError, ValueError, RuntimeError, KeyError) as e:
                # Damaged files surface as any of these (safetensors header errors are ValueError or
                # RuntimeError, a mismatched state dict is RuntimeError/KeyError): all mean "not this one".
                error = e
            if all_ranks(error is None):
                return d, manifest  # type: ignore[return-value]
        reason = f"{type(error).__name__}: {error}" if error else "rejected on another rank"
        warnings.warn(f"skipping checkpoint {d}: {reason}", stacklevel=2)
    return None


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
        print(f"signal {signum}: saving after the current step (send again to stop at once)", flush=True)

    def install(self) -> StopRequested:
        """Take over the signals (main thread only: elsewhere Python cannot install handlers)."""
        import threading

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
