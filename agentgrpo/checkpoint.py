"""Checkpoints: written atomically, found newest-first, verified before use.

A checkpoint is a directory `checkpoints/step-000012/` holding the model (safetensors), the
learner state (`learner.pt`, tensors only, read with `weights_only=True`), and `trainer.json` (step,
data position, weight version, RNG states). It is written to a temporary directory and renamed into
place, and `trainer.json` is written last, so a directory without a valid `trainer.json` is an
incomplete checkpoint and is skipped with a warning.
"""

from __future__ import annotations

import json
import random
import shutil
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

MANIFEST = "trainer.json"


def rng_state() -> dict[str, Any]:
    return {
        "python": repr(random.getstate()),
        "numpy": [x.tolist() if hasattr(x, "tolist") else x for x in np.random.get_state()],
        "torch": torch.get_rng_state().tolist(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    import ast

    random.setstate(ast.literal_eval(state["python"]))
    np_state = state["numpy"]
    np.random.set_state((np_state[0], np.array(np_state[1], dtype=np.uint32), *np_state[2:]))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))


def save(root: Path, step: int, write_payload: Any, trainer_state: dict[str, Any], keep: int = 2) -> Path:
    """Write checkpoint `step` under `root`; `write_payload(tmp_dir)` writes model and optimizer."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:06d}"
    tmp = root / f".tmp-step-{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    write_payload(tmp)
    (tmp / MANIFEST).write_text(json.dumps({"step": step, **trainer_state}))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    for old in sorted(root.glob("step-*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest(root: Path) -> tuple[Path, dict[str, Any]] | None:
    """Newest complete checkpoint and its manifest; incomplete ones are skipped with a warning."""
    for d in sorted(root.glob("step-*"), reverse=True):
        try:
            manifest = json.loads((d / MANIFEST).read_text())
            if not any(d.glob("*.safetensors")) or not (d / "learner.pt").exists():
                raise FileNotFoundError("model or learner state missing")
            return d, manifest
        except (OSError, ValueError) as e:
            warnings.warn(f"skipping incomplete checkpoint {d}: {e}", stacklevel=2)
    return None
