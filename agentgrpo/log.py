"""Run directory and metrics: metrics.jsonl, trajectories.jsonl, TensorBoard events.

A run directory holds `config.yaml` (the effective config, secrets masked), `metrics.jsonl` (one
object per step), `trajectories.jsonl` (one object per trajectory), `tensorboard/` and
`checkpoints/`. Lines are flushed as they are written so a killed run keeps everything it logged.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from agentgrpo.types import Group

SECRET_WORDS = ("key", "token", "secret", "password")


def mask_secrets(obj: Any) -> Any:
    """Replace values of keys that look like secrets (api_key, token, ...) with '***'."""
    if isinstance(obj, dict):
        return {k: ("***" if v and any(w in str(k).lower() for w in SECRET_WORDS) and isinstance(v, str)
                    else mask_secrets(v)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [mask_secrets(v) for v in obj]
    return obj


def _finite(v: Any) -> Any:
    return None if isinstance(v, float) and not math.isfinite(v) else v


class RunLogger:
    def __init__(self, run_dir: Path, *, tensorboard: bool = True) -> None:
        self.run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        self._metrics = open(run_dir / "metrics.jsonl", "a", encoding="utf-8")
        self._trajs = open(run_dir / "trajectories.jsonl", "a", encoding="utf-8")
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(run_dir / "tensorboard"))

    def log_step(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, **{k: _finite(v) for k, v in metrics.items()}}
        self._metrics.write(json.dumps(row) + "\n")
        self._metrics.flush()
        if self._tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    self._tb.add_scalar(k, v, step)
            self._tb.flush()

    def log_groups(self, step: int, groups: Iterable[Group]) -> None:
        for g in groups:
            for t in g.trajectories:
                self._trajs.write(json.dumps({"step": step, **t.to_dict()}) + "\n")
        self._trajs.flush()

    def close(self) -> None:
        self._metrics.close()
        self._trajs.close()
        if self._tb is not None:
            self._tb.close()


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
