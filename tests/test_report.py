"""The HTML report: a real tiny run, crafted hostile/partial/empty run directories, a browser
check."""

from __future__ import annotations

import base64
import json
import math
import shutil
import subprocess
from collections import Counter
from html.parser import HTMLParser
from pathlib import Path

import pytest

from agentgrpo.cli import main
from agentgrpo.run.log import read_jsonl
from agentgrpo.run.report import write_report
from agentgrpo.run.report_data import _choose

REQUIRED_PLOTS = [
    "reward",
    "response_length",
    "turns",
    "tool_calls",
    "stop_reasons",
    "clipfrac",
    "kl",
    "lr",
    "logprob_gap",
]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


class Page(HTMLParser):
    """What the tests look at: tags, plot images, and per trajectory its tokens by colour class."""

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: Counter = Counter()
        self.figures: dict[str, str] = {}
        self.articles: list[dict] = []
        self.notices: list[str] = []
        self.data: list[str] = []
        self._fig = self._tok = None
        self._in_toks = self._in_notice = False
        self.feed(text)
        self.close()

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        cls = a.get("class") or ""
        self.tags[tag] += 1
        if tag == "figure" and "plot" in cls.split():
            self._fig = a["id"]
        elif tag == "img" and self._fig:
            self.figures[self._fig] = a["src"]
        elif tag == "article" and "traj" in cls.split():
            self.articles.append({**a, "tok-gen": [], "tok-ctx": [], "text": []})
        elif tag == "div" and cls == "toks":
            self._in_toks = True
        elif tag == "span" and self._in_toks and cls in ("tok-gen", "tok-ctx"):
            self._tok = cls
        elif tag == "i" and self._in_toks and self._tok:
            self.articles[-1][self._tok].append("")
        elif tag == "li" and cls == "notice":
            self._in_notice = True
            self.notices.append("")

    def handle_endtag(self, tag):
        if tag == "figure":
            self._fig = None
        elif tag == "div" and self._in_toks:
            self._in_toks = False
        elif tag == "span":
            self._tok = None
        elif tag == "li":
            self._in_notice = False

    def handle_data(self, data):
        self.data.append(data)
        if self._in_toks and self._tok and self.articles[-1][self._tok]:
            self.articles[-1][self._tok][-1] += data
        if self.articles:
            self.articles[-1]["text"].append(data)
        if self._in_notice:
            self.notices[-1] += data

    def n_tokens(self, article: dict, cls: str) -> int:
        return len(article[cls])


def parse(path: Path) -> Page:
    return Page(path.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, tiny_model_dir) -> Path:
    """A real 2-step training run of the tiny model: 2 tasks x 2 samples per step = 8
    trajectories."""
    out = tmp_path_factory.mktemp("report") / "run"
    rc = main(
        [
            "train",
            "examples/calculator.yaml",
            f"output_dir={out}",
            "train.steps=2",
            f"model.path={tiny_model_dir}",
            "rollout.group_size=2",
            "rollout.tasks_per_step=2",
            "rollout.max_new_tokens=12",
            "rollout.max_tokens=40",
            "log.progress=false",
        ]
    )
    assert rc == 0
    return out


@pytest.fixture
def run_copy(tiny_run, tmp_path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(
        tiny_run, dst, ignore=shutil.ignore_patterns("checkpoints", "report.html", "plots")
    )
    return dst


def test_report_of_a_real_run_has_plots_and_coloured_tokens(run_copy):
    out = write_report(run_copy)
    assert out == run_copy / "report.html"
    page = parse(out)
    for name in REQUIRED_PLOTS:
        src = page.figures.get(f"plot-{name}")
        assert src and src.startswith("data:image/png;base64,"), (
            f"plot {name} missing from the HTML"
        )
        assert base64.b64decode(src.split(",", 1)[1]).startswith(PNG_MAGIC)
        assert (run_copy / "plots" / f"{name}.png").read_bytes().startswith(PNG_MAGIC)
    rows = read_jsonl(run_copy / "trajectories.jsonl")
    assert len(page.articles) == len(rows) == 8
    for art, row in zip(page.articles, rows, strict=True):  # file order is kept
        assert art["data-step"] == str(row["step"]) and art["data-stop"] == row["stop_reason"]
        assert float(art["data-reward"]) == row["reward"]
        # every token is shown once, in the colour its loss_mask says
        assert page.n_tokens(art, "tok-gen") == sum(row["loss_mask"]) > 0
        assert page.n_tokens(art, "tok-ctx") == len(row["loss_mask"]) - sum(row["loss_mask"]) > 0
        ctx_text = "".join(art["tok-ctx"])
        assert (
            row["messages"][1]["content"] in ctx_text
        )  # decoded with the run's tokenizer, not ids
        assert row["messages"][-1]["content"] in "".join(art["tok-gen"])
    assert not any("shown as ids" in n for n in page.notices)
    assert page.tags["script"] == 1 and page.tags["link"] == 0  # self-contained: no external files
    assert "http://" not in out.read_text() and "https://" not in out.read_text()


def test_text_is_escaped_not_interpreted(run_copy, smol_tokenizer):
    nasty = (
        '<tool_call>{"name": "calculator", "arguments": {"expression": '
        '"1<2"}}</tool_call></script><script>alert(1)</script>'
    )
    prompt = smol_tokenizer.encode("What is <marquee>1+1</marquee>?")
    gen = smol_tokenizer.encode(nasty)
    row = {
        "step": 2,
        "task_id": "t<x>",
        "group_id": "g",
        "token_ids": prompt + gen,
        "loss_mask": [0] * len(prompt) + [1] * len(gen),
        "logprobs": [0.0] * len(prompt) + [-0.5] * len(gen),
        "prompt_len": len(prompt),
        "stop_reason": "completed",
        "stop_detail": "<done>",
        "reward_detail": "<judge: fine>",
        "reward": 1.0,
        "messages": [
            {"role": "user", "content": "What is <marquee>1+1</marquee>?"},
            {"role": "assistant", "content": nasty},
        ],
        "num_turns": 1,
        "tool_calls": 1,
        "tool_errors": 0,
    }
    with open(run_copy / "trajectories.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    page = parse(write_report(run_copy))
    assert page.tags["tool_call"] == 0 and page.tags["marquee"] == 0 and page.tags["script"] == 1
    art = page.articles[-1]
    assert art["data-reward"] == "1.0"
    assert nasty in "".join(art["text"])  # the message, as text
    assert "".join(art["tok-gen"]) == nasty  # the tokens, as text, all in the generated colour
    assert "<marquee>1+1</marquee>" in "".join(art["tok-ctx"])
    assert "<done>" in "".join(art["text"]) and "<judge: fine>" in "".join(art["text"])  # as text


def test_caps_bound_what_is_embedded_and_say_so(run_copy):
    page = parse(write_report(run_copy, max_trajectories=3, max_tokens=10))
    assert len(page.articles) == 3
    assert {a["data-step"] for a in page.articles} == {"2"}  # the last step is always shown
    assert any("3 of 8 trajectories embedded" in n for n in page.notices)
    for art in page.articles:
        assert page.n_tokens(art, "tok-gen") + page.n_tokens(art, "tok-ctx") == 10
        assert "tokens omitted" in "".join(art["text"])


def test_choose_spreads_over_steps_and_rewards():
    by_step = {s: [(s * 100 + i, float(i)) for i in range(8)] for s in range(1, 11)}
    picked = _choose(by_step, 20)
    steps = sorted({off // 100 for off in picked})
    assert len(picked) <= 20 and steps[0] == 1 and steps[-1] == 10 and len(steps) == 5
    for s in steps:
        rewards = sorted(off % 100 for off in picked if off // 100 == s)
        assert rewards[0] == 0 and rewards[-1] == 7  # the worst and the best of the step
    assert _choose(by_step, 1000) == [off for s in sorted(by_step) for off, _ in by_step[s]]
    nan_first = _choose({1: [(1, 1.0), (2, math.nan), (3, 0.5), (4, 0.0), (5, 0.7)]}, 2)
    assert sorted(nan_first) == [1, 2]  # unscorable sorts lowest: shown beside the best


def test_empty_run_directory(tmp_path):
    page = parse(write_report(tmp_path))
    assert page.figures == {} and page.articles == []
    assert not list(tmp_path.glob("plots/*.png"))
    notices = " ".join(page.notices)
    assert "metrics.jsonl is missing" in notices and "trajectories.jsonl is missing" in notices
    assert "No trajectories to show." in "".join(page.data)
    with pytest.raises(FileNotFoundError):
        write_report(tmp_path / "nope")


def test_partial_run_directory(tmp_path):
    """One step, None/NaN values, broken lines, an empty and a malformed trajectory, no
    tokenizer."""
    (tmp_path / "config.yaml").write_text(
        "model: {path: /nonexistent/model}\nwandb_api_key: sekrit\n"
    )
    (tmp_path / "metrics.jsonl").write_text(
        json.dumps(
            {"step": 1, "reward_mean": 0.5, "loss": None, "clipfrac": float("nan"), "lr": "x"}
        )
        + "\n"
        + json.dumps({"step": 1, "eval/reward_mean": 0.25})
        + "\n[1, 2]\n"
        + '{"step": 2, "rew'
    )
    empty = {
        "step": 1,
        "token_ids": [],
        "loss_mask": [],
        "logprobs": [],
        "messages": [],
        "stop_reason": "env_error",
        "reward": None,
    }
    odd = {
        "step": 1,
        "token_ids": [5, 6, 7],
        "loss_mask": [0, 1],
        "messages": ["not a dict"],
        "reward": 0,
    }
    (tmp_path / "trajectories.jsonl").write_text(
        json.dumps(empty) + "\n" + json.dumps(odd) + "\n{broken\n"
    )
    out = write_report(tmp_path)
    page = parse(out)
    assert {"plot-reward", "plot-eval_reward_mean", "plot-stop_reasons"} <= set(page.figures)
    assert (
        "plot-loss" not in page.figures and "plot-clipfrac" not in page.figures
    )  # no finite values
    notices = " ".join(page.notices)
    assert (
        "metrics.jsonl: 2 unreadable line(s)" in notices
        and "trajectories.jsonl: 1 unreadable" in notices
    )
    assert "no data for plot(s):" in notices and "loss" in notices
    assert "shown as ids" in notices
    assert [a["data-stop"] for a in page.articles] == ["env_error", "unknown"]
    assert page.articles[0]["data-reward"] == "nan"
    assert (
        page.n_tokens(page.articles[1], "tok-gen") == 1
        and page.n_tokens(page.articles[1], "tok-ctx") == 2
    )
    assert "⟨5⟩" in "".join(page.articles[1]["tok-ctx"])
    assert "loss_mask has 2 entries for 3 tokens" in "".join(page.articles[1]["text"])
    assert "sekrit" not in out.read_text()


def test_curves_fall_back_to_trajectories(run_copy):
    (run_copy / "metrics.jsonl").unlink()
    page = parse(write_report(run_copy))
    assert {"plot-reward", "plot-response_length", "plot-turns", "plot-stop_reasons"} <= set(
        page.figures
    )
    assert "plot-lr" not in page.figures


def test_cli_report(run_copy, tmp_path, capsys):
    assert (
        main(
            ["report", str(run_copy), "--out", str(tmp_path / "r.html"), "--max-trajectories", "2"]
        )
        == 0
    )
    assert len(parse(tmp_path / "r.html").articles) == 2
    assert "report:" in capsys.readouterr().out
    assert main(["report", str(tmp_path / "missing")]) == 1


@pytest.mark.skipif(
    shutil.which("chromium") is None,
    reason="chromium is not installed (scripts/system-deps.sh installs it)",
)
def test_report_in_a_headless_browser(run_copy):
    """The page loads without script errors and the step filter, driven by the URL hash, works."""
    out = write_report(run_copy)
    proc = subprocess.run(
        [
            "chromium",
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--enable-logging=stderr",
            "--v=0",
            "--virtual-time-budget=3000",
            "--dump-dom",
            f"{out.as_uri()}#step=2",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Uncaught" not in proc.stderr, proc.stderr[-2000:]
    dom = Page(proc.stdout)
    assert 'data-ready="1"' in proc.stdout  # the script ran to its end
    shown = [a for a in dom.articles if "hidden" not in a]
    assert len(dom.articles) == 8 and len(shown) == 4 and {a["data-step"] for a in shown} == {"2"}
    assert "4 of 8 shown" in "".join(dom.data)
