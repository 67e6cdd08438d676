"""What the report reads from a run directory: merged metrics and one streaming scan of
trajectories.

`load_metrics` turns `metrics.jsonl` into {step: {key: value}}; `scan_trajectories` reads
`trajectories.jsonl` in two bounded-memory passes (per-step stats of every row, then the rows
chosen by `_choose` to embed). Unreadable lines are counted and named in the report's notices.

Why a module of its own: this is the part of `agentgrpo report` that parses files and decides what
to show; it needs neither matplotlib nor HTML. `report.py` turns its results into plots and the
page.
"""

from __future__ import annotations

import json
import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MIN_PER_STEP = 4  # when steps outnumber the budget, show fewer steps rather than 1 trajectory each


@dataclass
class TrajScan:
    """What one streaming pass over trajectories.jsonl learns: per-step stats and the rows to
    show."""

    total: int = 0
    bad_lines: int = 0
    stats: dict[int, dict[str, list[float]]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(list))
    )
    stops: dict[int, Counter] = field(default_factory=lambda: defaultdict(Counter))
    rows: list[dict[str, Any]] = field(default_factory=list)


def _num(v: Any) -> float:
    """A metric value as a float; None, strings, bools and the like become NaN (a gap in a
    curve)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return math.nan
    return float(v)


def _step(v: Any) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) else 0


def _list(row: dict[str, Any], key: str) -> list[Any]:
    return row[key] if isinstance(row.get(key), list) else []


def load_metrics(path: Path, notices: list[str]) -> dict[int, dict[str, float]]:
    """metrics.jsonl as {step: {key: value}}, rows of one step merged; unreadable lines counted."""
    by_step: dict[int, dict[str, float]] = {}
    if not path.is_file():
        notices.append(f"{path.name} is missing: curves come from trajectories.jsonl only")
        return by_step
    bad = 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                bad += 1  # a killed run leaves a partial last line
                continue
            if not isinstance(row, dict) or not isinstance(row.get("step"), int):
                bad += 1
                continue
            merged = by_step.setdefault(row["step"], {})
            merged.update(
                {k: _num(v) for k, v in row.items() if k != "step" and isinstance(k, str)}
            )
    if bad:
        notices.append(f"{path.name}: {bad} unreadable line(s) skipped")
    return dict(sorted(by_step.items()))


def _choose(by_step: dict[int, list[tuple[int, float]]], budget: int) -> list[int]:
    """Offsets of the rows to embed: all if they fit; else evenly spaced steps (always the last)
    and, within a step, rows evenly spread over its reward order (unscorable ones sort first)."""
    steps = sorted(by_step)
    if sum(len(v) for v in by_step.values()) <= budget:
        return [off for s in steps for off, _ in by_step[s]]
    if budget <= 0 or not steps:
        return []
    per_step = max(budget // len(steps), min(budget, MIN_PER_STEP))
    n = max(1, min(len(steps), budget // per_step))
    chosen = (
        [steps[-1]] if n == 1 else [steps[round(i * (len(steps) - 1) / (n - 1))] for i in range(n)]
    )
    out = []
    for s in chosen:
        rows = sorted(by_step[s], key=lambda e: (not math.isnan(e[1]), e[1]))
        if len(rows) > per_step:
            idx = (
                [0]
                if per_step == 1
                else [round(i * (len(rows) - 1) / (per_step - 1)) for i in range(per_step)]
            )
            rows = [rows[i] for i in idx]
        out += [off for off, _ in rows]
    return out


def scan_trajectories(path: Path, max_trajectories: int, notices: list[str]) -> TrajScan:
    """Two passes with bounded memory: stats of every row and its byte offset, then the chosen
    rows."""
    scan = TrajScan()
    if not path.is_file():
        notices.append(f"{path.name} is missing: no trajectory viewer")
        return scan
    index: dict[int, list[tuple[int, float]]] = defaultdict(list)
    with open(path, "rb") as f:
        while True:
            off = f.tell()
            line = f.readline()
            if not line:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                if not isinstance(row, dict):
                    raise ValueError("not an object")
            except ValueError:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
                scan.bad_lines += 1
                continue
            step, reward = _step(row.get("step")), _num(row.get("reward"))
            mask = _list(row, "loss_mask")
            st = scan.stats[step]
            st["reward"].append(reward)
            st["response_tokens"].append(float(sum(1 for m in mask if m == 1)))
            for k in ("num_turns", "tool_calls", "tool_errors"):
                st[k.removeprefix("num_")].append(_num(row.get(k)))
            scan.stops[step][str(row.get("stop_reason", "unknown"))] += 1
            index[step].append((off, reward))
            scan.total += 1
        for off in sorted(_choose(index, max_trajectories)):
            f.seek(off)
            try:  # the line parsed a moment ago; only a file replaced in between fails here
                scan.rows.append(json.loads(f.readline()))
            except ValueError:
                scan.bad_lines += 1
    if scan.bad_lines:
        notices.append(f"{path.name}: {scan.bad_lines} unreadable line(s) skipped")
    if scan.total > len(scan.rows):
        shown = sorted({_step(r.get("step")) for r in scan.rows})
        which = (
            ", ".join(map(str, shown))
            if len(shown) <= 12
            else f"{len(shown)} steps from {shown[0]} to {shown[-1]}"
        )
        notices.append(
            f"{len(scan.rows)} of {scan.total} trajectories embedded (cap max_trajectories="
            f"{max_trajectories}), from steps {which}"
        )
    return scan
