"""`agentgrpo report RUN_DIR`: one self-contained HTML file with a run's curves and trajectories.

The report is written to `RUN_DIR/report.html` and its plots also as PNG files to `RUN_DIR/plots/`.
It works on any run directory, including one still being written, a killed one, or one with no
metrics or no trajectories: whatever is missing is named in a notice at the top instead of failing.

Decisions:
- Self-contained: plots are PNGs (matplotlib's Agg canvas, never pyplot, so the caller's backend
  is untouched) embedded as data URIs; the CSS and the small filter script are inlined from
  `template.html`. Nothing is fetched from the network, so a report can be mailed or
  archived.
- Trajectories are rendered as HTML on the server side (not built by script from embedded JSON), so
  the viewer also works with scripts disabled and every piece of text passes through `html.escape`.
- Curves come from `metrics.jsonl` (rows of the same step are merged: an eval row and a train row of
  one step both count; a resumed run's repeated step keeps its last values). Per-trajectory spreads
  (p10-p90 bands, stop reasons) come from all of `trajectories.jsonl`, read as a stream.
- Size is bounded: at most `max_trajectories` trajectories are embedded, chosen from evenly spaced
  steps (the last step always) and, within a step, spread over its reward range so the best and the
  worst are both shown; each shows at most `max_tokens` tokens (its head and its tail) and messages
  of at most `MAX_MESSAGE_CHARS` characters. Every cap that bites is stated in the report.
- Tokens are decoded one by one with the run's tokenizer (`config.yaml`'s `model.path`; null means
  the embedded model) so token boundaries stay visible; without a tokenizer the ids are shown.

Reading the run (metrics.jsonl, the trajectory scan and the choice of rows) is in `report_data.py`;
this module draws the plots, renders the page and writes the files.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import os
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timezone
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from agentgrpo.models.embedded import default_model_path, load_tokenizer
from agentgrpo.run.log import mask_secrets
from agentgrpo.run.report_data import TrajScan, _list, _num, _step, load_metrics, scan_trajectories

DEFAULT_MAX_TRAJECTORIES = 200
DEFAULT_MAX_TOKENS = 2048
MAX_MESSAGE_CHARS = 20_000
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


# -- trajectories ------------------------------------------------------------------------------


def load_run_tokenizer(run_dir: Path, config: dict[str, Any], notices: list[str]):
    """The run's tokenizer (config.yaml's model.path; null = the embedded model) or None."""
    model = config.get("model") if isinstance(config.get("model"), dict) else {}
    try:
        path = model.get("path")
        if path:
            path = Path(path) if Path(path).is_absolute() or Path(path).exists() else run_dir / path
        return load_tokenizer(path or default_model_path())
    except Exception as e:  # noqa: BLE001 - any failure (moved model, missing package) means: show ids
        notices.append(
            "tokens are shown as ids: the run's tokenizer could not be loaded "
            f"({type(e).__name__}: {e})"
        )
        return None


def _decode_table(tokenizer, rows: list[dict[str, Any]], max_tokens: int) -> dict[int, str]:
    if tokenizer is None:
        return {}
    vocab = len(tokenizer)
    shown = set()
    for seg in (seg for r in rows for seg in _segments(r)):
        ids = _list(seg, "token_ids")
        head, tail = _window(len(ids), max_tokens)
        shown.update(ids[:head] + ids[tail:])
    ids = sorted(i for i in shown if isinstance(i, int) and 0 <= i < vocab)
    texts = tokenizer.batch_decode(
        [[i] for i in ids], skip_special_tokens=False, clean_up_tokenization_spaces=False
    )
    return dict(zip(ids, texts, strict=True))


def _segments(row: dict[str, Any]) -> list[dict[str, Any]]:
    """The token sequences of a row: its `segments` (step-wise), else the row itself."""
    segs = row.get("segments")
    if isinstance(segs, list) and segs and all(isinstance(x, dict) for x in segs):
        return segs
    return [row]


def _window(n: int, max_tokens: int) -> tuple[int, int]:
    """Tokens shown: [0, head) and [tail, n); the middle is left out when n is over the cap."""
    return (n, n) if n <= max_tokens else (max_tokens // 2, n - (max_tokens - max_tokens // 2))


def _tokens_html(row: dict[str, Any], table: dict[int, str], max_tokens: int) -> str:
    ids = _list(row, "token_ids")
    mask = _list(row, "loss_mask")
    lps = _list(row, "logprobs")
    n = len(ids)
    head, tail_start = _window(n, max_tokens)
    out, run_cls = [], None
    for i in [*range(head), *range(tail_start, n)]:
        if i == tail_start and tail_start > head:
            if run_cls:
                out.append("</span>")
            out.append(f'<span class="omitted"> … {tail_start - head} tokens omitted … </span>')
            run_cls = None
        cls = "tok-gen" if i < len(mask) and mask[i] == 1 else "tok-ctx"
        if cls != run_cls:
            out.append(("</span>" if run_cls else "") + f'<span class="{cls}">')
            run_cls = cls
        tid = ids[i]
        text = table.get(tid) if isinstance(tid, int) else None
        text = f"⟨{tid}⟩" if text is None else text.replace("\n", "↵\n")
        tip = f"#{i} id {tid}" + (
            f" logp {_num(lps[i]):.3f}" if cls == "tok-gen" and i < len(lps) else ""
        )
        out.append(f'<i title="{html.escape(tip)}">{html.escape(text)}</i>')
    if run_cls:
        out.append("</span>")
    return "".join(out)


def _content(text: Any) -> str:
    text = text if isinstance(text, str) else json.dumps(text)
    if len(text) > MAX_MESSAGE_CHARS:
        text = text[:MAX_MESSAGE_CHARS] + f"\n… {len(text) - MAX_MESSAGE_CHARS} characters omitted"
    return html.escape(text)


def _message_html(m: Any) -> str:
    if not isinstance(m, dict):
        return f'<div class="msg"><pre>{_content(m)}</pre></div>'
    role = str(m.get("role", "?"))
    body = _content(m.get("content") or "")
    calls = m.get("tool_calls")
    if calls:
        body += "\n" + _content("tool_calls: " + json.dumps(calls, ensure_ascii=False))
    extra = f" · {html.escape(str(m['name']))}" if m.get("name") else ""
    return (
        f'<div class="msg role-{html.escape(role)}">'
        f'<div class="role">{html.escape(role)}{extra}</div>'
        f"<pre>{body}</pre></div>"
    )


def _judge_html(row: dict[str, Any]) -> str:
    """What a judge or reward model (`agentgrpo.verify.judge`) was asked and answered about this
    trajectory: the records its rubric kept by verifier name (`reward_info`)."""
    info = row.get("reward_info")
    out = []
    for name, record in info.items() if isinstance(info, dict) else ():
        if not isinstance(record, dict) or record.get("kind") not in ("judge", "reward model"):
            continue
        answer = record.get("answer")
        try:  # a chat completion: its message is what the judge said
            answer = json.loads(answer)["choices"][0]["message"]["content"]
        except (TypeError, ValueError, KeyError, IndexError):
            pass
        verdict = record.get("error") or f"score {_num(record.get('score')):.3g}"
        who = f"{name}: {record['kind']} {record.get('model', '')}"
        out.append(
            f'<details class="judge"><summary>{html.escape(who)}: {html.escape(str(verdict))}'
            f"</summary>{''.join(_message_html(m) for m in _list(record, 'prompt'))}"
            f'<div class="msg role-judge"><div class="role">{html.escape(name)} answered</div>'
            f"<pre>{_content(answer if answer is not None else '(no answer)')}</pre></div>"
            "</details>"
        )
    return "".join(out)


def _traj_html(row: dict[str, Any], table: dict[int, str], max_tokens: int) -> str:
    step, reward = _step(row.get("step")), _num(row.get("reward"))
    stop = str(row.get("stop_reason", "unknown"))
    rcls = "reward-none" if math.isnan(reward) else ("reward-good" if reward > 0 else "reward-bad")
    rtext = "unscorable" if math.isnan(reward) else f"{reward:.4g}"
    parts = row.get("reward_parts")
    if isinstance(parts, dict) and parts:
        rtext += " (" + ", ".join(f"{k}: {_num(v):.3g}" for k, v in parts.items()) + ")"
    e = html.escape
    fields = [
        f"<b>step {step}</b>",
        f"task {e(str(row.get('task_id', '?')))}",
        f'<span class="{rcls}">reward <b>{e(rtext)}</b></span>',
        f'<span class="stop">{e(stop)}</span>',
    ]
    for key in ("stop_detail", "reward_detail"):  # why it ended; the rubric's notes, why unscorable
        if row.get(key):
            fields.append(f'<span class="detail">{e(str(row[key]))}</span>')
    fields += [
        f"turns {e(str(row.get('num_turns', '?')))}",
        f"tool calls {e(str(row.get('tool_calls', '?')))} "
        f"(errors {e(str(row.get('tool_errors', '?')))})",
        f"group {e(str(row.get('group_id', '')))}",
        # runs before typed versions wrote one comma-joined string
        f"weights {e(str(row.get('weight_versions', row.get('weight_version'))))}",
    ]
    if row.get("advantage") is not None:
        fields.append(f"advantage {_num(row['advantage']):.3g}")
    if isinstance(row.get("turn_rewards"), list) and len(row["turn_rewards"]) > 1:
        fields.append("turn rewards " + e(", ".join(f"{_num(r):.3g}" for r in row["turn_rewards"])))
    if isinstance(row.get("turn_advantages"), list):  # a turn-level estimator's, one per turn
        turn_advs = ", ".join(f"{_num(a):.3g}" for a in row["turn_advantages"])
        fields.append("turn advantages " + e(turn_advs))
    msgs = _list(row, "messages")
    segs = _segments(row)
    tokens = []
    for k, seg in enumerate(segs):
        ids, mask = _list(seg, "token_ids"), _list(seg, "loss_mask")
        notes = []
        if len(mask) != len(ids):
            notes.append(f"loss_mask has {len(mask)} entries for {len(ids)} tokens")
        if len(ids) > max_tokens:
            notes.append(f"showing {max_tokens} of {len(ids)} tokens")
        note = f' <span class="omitted">{e("; ".join(notes))}</span>' if notes else ""
        name = f"segment {k + 1} of {len(segs)}, tokens" if len(segs) > 1 else "tokens"
        generated = sum(1 for m in mask if m == 1)
        tokens.append(
            f'<details class="tokens"><summary>{name}: {len(ids)} ({generated} generated)'
            f'<span class="legend"><span class="tok-gen">generated (loss_mask 1)</span>'
            f'<span class="tok-ctx">not generated: prompt, tool/env output</span></span>'
            f'{note}</summary><div class="toks">{_tokens_html(seg, table, max_tokens)}</div>'
            "</details>"
        )
    return (
        f'<article class="traj" data-step="{step}" data-reward="{reward}" data-stop="{e(stop)}">'
        f"<header>{' · '.join(fields)}</header>"
        '<div class="msgs">'
        f"{''.join(_message_html(m) for m in msgs) or '<p>(no messages)</p>'}</div>"
        f"{_judge_html(row)}{''.join(tokens)}</article>"
    )


# -- the page ----------------------------------------------------------------------------------


def _fmt(v: float) -> str:
    return "—" if not math.isfinite(v) else f"{v:.6g}"


def _env_names(config: dict[str, Any]) -> str:
    """The run's env, or a mixture's envs (`envs:`) by label, for the header."""
    if isinstance(config.get("envs"), list):
        return ", ".join(str(e.get("label") or e.get("name")) for e in config["envs"] if e)
    return (
        (config.get("env") or {}).get("name", "?") if isinstance(config.get("env"), dict) else "?"
    )


def _body(
    run_dir: Path,
    config: dict[str, Any],
    config_text: str,
    metrics,
    scan: TrajScan,
    plots: list[Plot],
    table: dict[int, str],
    max_tokens: int,
    notices: list[str],
) -> str:
    e = html.escape
    env = _env_names(config)
    model = (
        (config.get("model") or {}).get("path") if isinstance(config.get("model"), dict) else None
    )
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    out = [
        f"<header><h1>agentgrpo report · {e(run_dir.name)}</h1>"
        f'<p class="meta">{e(str(run_dir))} · env {e(str(env))} · '
        f"model {e(str(model or 'embedded SmolLM2-135M-Instruct'))}"
        f" · {len(metrics)} step(s) with metrics · {scan.total} trajectories · "
        f"written {when}</p></header>"
    ]
    if notices:
        out.append(
            '<ul class="notices">'
            + "".join(f'<li class="notice">{e(n)}</li>' for n in notices)
            + "</ul>"
        )
    last = next(reversed(metrics.values()), {}) if metrics else {}
    stops = Counter()
    for c in scan.stops.values():
        stops.update(c)
    out.append('<section id="summary"><h2>Summary</h2>')
    if stops:
        out.append(
            "<p>Episodes by stop reason: "
            + ", ".join(f"{e(k)} {v}" for k, v in stops.most_common())
            + "</p>"
        )
    if last:
        rows = "".join(
            f'<tr><td>{e(k)}</td><td class="num">{_fmt(v)}</td></tr>'
            for k, v in sorted(last.items())
        )
        out.append(
            f"<details><summary>metrics at step {next(reversed(metrics))}</summary>"
            f"<table>{rows}</table></details>"
        )
    if config_text:
        out.append(f"<details><summary>config.yaml</summary><pre>{e(config_text)}</pre></details>")
    out.append("</section>")
    out.append('<section id="plots"><h2>Training curves</h2><div class="grid">')
    for p in plots:
        src = "data:image/png;base64," + base64.b64encode(p.png).decode("ascii")
        out.append(
            f'<figure class="plot" id="plot-{e(p.name)}"><img src="{src}" alt="{e(p.title)}">'
            f"<figcaption>{e(p.title)} · plots/{e(p.name)}.png</figcaption></figure>"
        )
    out.append("</div></section>")
    out.append('<section id="trajectories"><h2>Trajectories</h2>')
    if scan.rows:
        steps = sorted({_step(r.get("step")) for r in scan.rows})
        stops_shown = sorted({str(r.get("stop_reason", "unknown")) for r in scan.rows})
        opts = "".join(f'<option value="{s}">{s}</option>' for s in steps)
        sopts = "".join(f'<option value="{e(s)}">{e(s)}</option>' for s in stops_shown)
        out.append(
            '<div id="filters"><label>step <select id="f-step"><option value="">all</option>'
            f"{opts}</select></label>"
            '<label>reward ≥ <input id="f-rmin" type="number" step="any"></label>'
            '<label>reward ≤ <input id="f-rmax" type="number" step="any"></label>'
            f'<label>stop <select id="f-stop"><option value="">all</option>{sopts}</select></label>'
            '<button type="button" id="f-tokens">open all token views</button>'
            f'<span id="shown">{len(scan.rows)} of {len(scan.rows)} shown</span></div>'
        )
        out += [_traj_html(r, table, max_tokens) for r in scan.rows]
    else:
        out.append("<p>No trajectories to show.</p>")
    out.append("</section>")
    return "\n".join(out)


def write_report(
    run_dir: str | Path,
    out: str | Path | None = None,
    *,
    max_trajectories: int = DEFAULT_MAX_TRAJECTORIES,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    tokenizer: Any = None,
) -> Path:
    """Write the HTML report of `run_dir` (default `run_dir/report.html`) and `run_dir/plots/*.png`.

    `tokenizer` overrides the run's own (useful when the caller has it loaded). Returns the path of
    the HTML file. Raises FileNotFoundError only when `run_dir` is not a directory.

    Example:
        >>> from agentgrpo.run.report import write_report
        >>> write_report("runs/calculator")  # doctest: +SKIP
        PosixPath('runs/calculator/report.html')
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory {run_dir} does not exist")
    out = Path(out) if out is not None else run_dir / "report.html"
    notices: list[str] = []
    config, config_text = {}, ""
    if (run_dir / "config.yaml").is_file():
        # Only here: agentgrpo.run.config loads every stage's config, torch with them, and
        # `agentgrpo report` (and the CLI's start) should not wait for that.
        from agentgrpo.run.config import ConfigError, load_yaml

        try:  # bounded: a planted config.yaml's nested aliases would expand without end
            config = mask_secrets(
                load_yaml((run_dir / "config.yaml").read_text(encoding="utf-8"), "config.yaml")
                or {}
            )
            config = config if isinstance(config, dict) else {}
            config_text = yaml.safe_dump(config, sort_keys=False)
        except ConfigError as e:
            notices.append(f"config.yaml is unreadable: {e}")
    else:
        notices.append("config.yaml is missing: the embedded model's tokenizer is assumed")
    metrics = load_metrics(run_dir / "metrics.jsonl", notices)
    scan = scan_trajectories(run_dir / "trajectories.jsonl", max_trajectories, notices)
    plots = make_plots(metrics, scan, notices)
    if plots:
        plots_dir = run_dir / "plots"
        plots_dir.mkdir(exist_ok=True)
        for p in plots:
            (plots_dir / f"{p.name}.png").write_bytes(p.png)
    if scan.rows and tokenizer is None:
        tokenizer = load_run_tokenizer(run_dir, config, notices)
    table = _decode_table(tokenizer, scan.rows, max_tokens)
    body = _body(run_dir, config, config_text, metrics, scan, plots, table, max_tokens, notices)
    page = (resources.files("agentgrpo.run") / "report_template.html").read_text(encoding="utf-8")
    page = page.replace("<!--TITLE-->", html.escape(f"agentgrpo report · {run_dir.name}")).replace(
        "<!--BODY-->", body, 1
    )
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(page, encoding="utf-8")
    os.replace(tmp, out)  # a reader (or a browser refresh) never sees a half-written report
    return out
