"""`agentgrpo report RUN_DIR`: one self-contained HTML file with a run's curves and trajectories.

The report is written to `RUN_DIR/report.html` and its plots also to `RUN_DIR/plots/*.png`. Any
run directory works, one still being written or killed included: what is missing is named in a
notice at the top instead of failing.

Decisions (docs/learner.md, "The report", gives the reasons):
- Self-contained: embedded PNGs, inlined CSS and script (`report_template.html`), no network.
- Trajectories are rendered here as HTML, every logged text through `html.escape`.
- Size is bounded by `max_trajectories`, `max_tokens` and `MAX_MESSAGE_CHARS`; every cap that
  bites is stated in the report.
- Tokens are decoded one by one with the run's tokenizer, so token boundaries stay visible.

Reading the run is in `report_data.py`, the plots in `report_plots.py`; the page is rendered here.
"""

from __future__ import annotations

import base64
import html
import json
import math
import os
from collections import Counter
from datetime import datetime, timezone
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from agentgrpo.models.embedded import default_model_path, load_tokenizer
from agentgrpo.run.log import mask_secrets
from agentgrpo.run.report_data import TrajScan, _list, _num, _step, load_metrics, scan_trajectories
from agentgrpo.run.report_plots import Plot, make_plots

DEFAULT_MAX_TRAJECTORIES = 200
DEFAULT_MAX_TOKENS = 2048
MAX_MESSAGE_CHARS = 20_000
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
    if not ids:  # transformers 5.17 decodes an empty batch as one empty sequence
        return {}
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


def _header_html(run_dir: Path, config: dict[str, Any], metrics, scan: TrajScan) -> str:
    """The title line: run, env, model, how much the logs hold, and when the page was written."""
    e = html.escape
    env = _env_names(config)
    model = (
        (config.get("model") or {}).get("path") if isinstance(config.get("model"), dict) else None
    )
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return (
        f"<header><h1>agentgrpo report · {e(run_dir.name)}</h1>"
        f'<p class="meta">{e(str(run_dir))} · env {e(str(env))} · '
        f"model {e(str(model or 'embedded SmolLM2-135M-Instruct'))}"
        f" · {len(metrics)} step(s) with metrics · {scan.total} trajectories · "
        f"written {when}</p></header>"
    )


def _summary_html(metrics, scan: TrajScan, config_text: str) -> str:
    """Episodes by stop reason, the last step's metrics and the config."""
    e = html.escape
    last = next(reversed(metrics.values()), {}) if metrics else {}
    stops = Counter()
    for c in scan.stops.values():
        stops.update(c)
    out = ['<section id="summary"><h2>Summary</h2>']
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
    return "\n".join(out)


def _plots_html(plots: list[Plot]) -> str:
    """The plots as embedded PNGs, each captioned with its file under plots/."""
    e = html.escape
    out = ['<section id="plots"><h2>Training curves</h2><div class="grid">']
    for p in plots:
        src = "data:image/png;base64," + base64.b64encode(p.png).decode("ascii")
        out.append(
            f'<figure class="plot" id="plot-{e(p.name)}"><img src="{src}" alt="{e(p.title)}">'
            f"<figcaption>{e(p.title)} · plots/{e(p.name)}.png</figcaption></figure>"
        )
    out.append("</div></section>")
    return "\n".join(out)


def _trajectories_html(scan: TrajScan, table: dict[int, str], max_tokens: int) -> str:
    """The filters (step, reward range, stop reason) and the embedded trajectories."""
    e = html.escape
    out = ['<section id="trajectories"><h2>Trajectories</h2>']
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
    out = [_header_html(run_dir, config, metrics, scan)]
    if notices:
        out.append(
            '<ul class="notices">'
            + "".join(f'<li class="notice">{html.escape(n)}</li>' for n in notices)
            + "</ul>"
        )
    out.append(_summary_html(metrics, scan, config_text))
    out.append(_plots_html(plots))
    out.append(_trajectories_html(scan, table, max_tokens))
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

    Example (an empty run directory still gets its report, whose notices say what is missing):
        >>> import tempfile
        >>> from agentgrpo.run.report import write_report
        >>> with tempfile.TemporaryDirectory() as run_dir:
        ...     print(write_report(run_dir).relative_to(run_dir))
        report.html
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
