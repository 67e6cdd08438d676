"""The plots of `agentgrpo report`: one PNG per curve, drawn from the merged metrics and the
trajectory scan (`report_data.py`).

Matplotlib's Agg canvas draws them, never pyplot, so the caller's backend is untouched. A panel
with no data is left out and named in the report's notices.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

import numpy as np

from agentgrpo.run.report_data import TrajScan

MAX_EVAL_PANELS = 12

# (file name, title, metrics keys, per-trajectory stat drawn as a p10-p90 band)
PANELS: list[tuple[str, str, list[str], str | None]] = [
    ("reward", "Reward per step (mean ± std)", ["reward_mean"], "reward"),
    (
        "response_length",
        "Generated tokens per trajectory",
        ["response_tokens_mean"],
        "response_tokens",
    ),
    ("turns", "Turns per trajectory", ["turns_mean"], "turns"),
    (
        "tool_calls",
        "Tool calls and tool errors per trajectory",
        ["tool_calls_mean", "tool_errors_mean"],
        "tool_calls",
    ),
    ("stop_reasons", "Why episodes ended (StopReason counts)", [], None),
    ("loss", "Loss", ["loss", "pg_loss", "kl_loss", "entropy_loss"], None),
    ("clipfrac", "Clip fraction", ["clipfrac", "clipfrac_dual"], None),
    ("kl", "KL (ppo_kl: rollout policy vs updated; kl: vs reference)", ["ppo_kl", "kl"], None),
    ("lr", "Learning rate", ["lr"], None),
    (
        "logprob_gap",
        "Rollout vs learner logprob gap |Δ logp|",
        ["logprob_gap_mean", "logprob_gap_max"],
        None,
    ),
    ("grad_norm", "Gradient norm (before clipping)", ["grad_norm"], None),
    ("throughput", "Sampled tokens per second (rollout)", ["tokens_per_s"], None),
    ("time", "Seconds per step", ["rollout_s", "learner_s", "step_s"], None),
]
STOP_COLOURS = {
    "completed": "#2f9a4b",
    "truncated": "#7aa6d8",
    "max_turns": "#c2a32f",
    "max_tokens": "#e08a2c",
    "parse_error": "#b04ac2",
    "tool_error": "#d0508a",
    "timeout": "#8c5a3c",
    "env_error": "#c03030",
    "engine_error": "#801818",
    "aborted": "#555555",
}


@dataclass
class Plot:
    name: str
    title: str
    png: bytes


# -- plots -------------------------------------------------------------------------------------


def _series(metrics: dict[int, dict[str, float]], key: str) -> tuple[np.ndarray, np.ndarray] | None:
    pts = [(s, m[key]) for s, m in metrics.items() if key in m]
    if not pts or not any(math.isfinite(v) for _, v in pts):
        return None
    x, y = np.asarray(pts, dtype=float).T
    return x, y


def _traj_series(scan: TrajScan, stat: str, fn) -> tuple[np.ndarray, np.ndarray] | None:
    pts = []
    for s in sorted(scan.stats):
        vals = np.asarray(scan.stats[s][stat], dtype=float)
        vals = vals[np.isfinite(vals)]
        if vals.size:
            pts.append((s, fn(vals)))
    if not pts:
        return None
    x, y = np.asarray(pts, dtype=float).T
    return x, y


def _figure(title: str):
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 3.3), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("step", fontsize=9)
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3)
    ax.xaxis.get_major_locator().set_params(integer=True)  # steps are whole numbers
    return fig, ax


def _png(fig) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    buf = io.BytesIO()
    FigureCanvasAgg(fig).print_png(buf)
    return buf.getvalue()


def _line(ax, xy, label: str) -> None:
    x, y = xy
    ax.plot(x, y, label=label, marker="o" if len(x) <= 50 else None, markersize=3, linewidth=1.4)


def _panel(metrics, scan: TrajScan, name: str, title: str, keys: list[str], stat: str | None):
    fig, ax = _figure(title)
    drawn = False
    for key in keys:
        xy = _series(metrics, key)
        if xy is None and stat is not None and key == keys[0]:  # no metric: the trajectories' mean
            xy = _traj_series(scan, stat, np.mean)
            key = f"{key} (from trajectories)"
        if xy is None:
            continue
        _line(ax, xy, key)
        drawn = True
        if name == "reward":
            std = _series(metrics, "reward_std") or _traj_series(scan, "reward", np.std)
            if std is not None and len(std[0]) == len(xy[0]):
                ax.fill_between(xy[0], xy[1] - std[1], xy[1] + std[1], alpha=0.2, label="± std")
    if stat is not None and drawn:
        lo, hi = (
            _traj_series(scan, stat, lambda v: np.percentile(v, 10)),
            _traj_series(scan, stat, lambda v: np.percentile(v, 90)),
        )
        if lo is not None and hi is not None and name != "reward":
            ax.fill_between(
                lo[0], lo[1], hi[1], alpha=0.15, color="grey", label="p10–p90 of trajectories"
            )
    if name == "reward" and (ev := _series(metrics, "eval/reward_mean")) is not None:
        _line(ax, ev, "eval/reward_mean")
        drawn = True
    if name == "lr" and drawn:
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    if not drawn:
        return None
    ax.legend(fontsize=7)
    return Plot(name, title, _png(fig))


def _stop_panel(metrics, scan: TrajScan, title: str) -> Plot | None:
    counts: dict[int, dict[str, float]] = {
        s: {k[5:]: v for k, v in m.items() if k.startswith("stop/") and math.isfinite(v)}
        for s, m in metrics.items()
    }
    counts = {s: c for s, c in counts.items() if c}
    if not counts:  # no stop/* metrics: count the logged trajectories
        counts = {s: dict(c) for s, c in scan.stops.items() if c}
    if not counts:
        return None
    fig, ax = _figure(title)
    steps = np.asarray(sorted(counts), dtype=float)
    width = 0.8 * (float(np.min(np.diff(steps))) if len(steps) > 1 else 1.0)
    reasons = sorted(
        {r for c in counts.values() for r in c}, key=lambda r: (r not in STOP_COLOURS, r)
    )
    bottom = np.zeros(len(steps))
    for r in reasons:
        vals = np.asarray([counts[int(s)].get(r, 0.0) for s in steps])
        ax.bar(steps, vals, width=width, bottom=bottom, label=r, color=STOP_COLOURS.get(r))
        bottom += vals
    ax.set_ylabel("trajectories", fontsize=9)
    ax.legend(fontsize=7)
    return Plot("stop_reasons", title, _png(fig))


def make_plots(
    metrics: dict[int, dict[str, float]], scan: TrajScan, notices: list[str]
) -> list[Plot]:
    plots, missing = [], []
    for name, title, keys, stat in PANELS:
        p = (
            _stop_panel(metrics, scan, title)
            if name == "stop_reasons"
            else _panel(metrics, scan, name, title, keys, stat)
        )
        if p is None:
            missing.append(name)
        else:
            plots.append(p)
    by_env = sorted(
        {
            k
            for m in metrics.values()
            for k in m
            if k.startswith("env/") and k.endswith("reward_mean")
        }
    )
    if by_env:  # a mixture (envs:): env/<label>/reward_mean, env/<label>/eval/reward_mean
        title = "Reward per environment (train, and eval where it ran)"
        if (p := _panel(metrics, scan, "reward_by_env", title, by_env, None)) is not None:
            plots.append(p)
    eval_keys = sorted({k for m in metrics.values() for k in m if k.startswith("eval/")})
    if len(eval_keys) > MAX_EVAL_PANELS:
        notices.append(
            f"{len(eval_keys)} eval metrics: only the first {MAX_EVAL_PANELS} are plotted"
        )
    for key in eval_keys[:MAX_EVAL_PANELS]:
        p = _panel(metrics, scan, "eval_" + key[5:].replace("/", "_"), key, [key], None)
        if p is not None:
            plots.append(p)
    if missing:
        notices.append(f"no data for plot(s): {', '.join(missing)}")
    return plots
