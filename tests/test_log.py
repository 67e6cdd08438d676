"""Progress display and the optional Weights & Biases logging of RunLogger."""

from __future__ import annotations

import io
import json
import math
import sys
import types

import pytest

from agentgrpo.run.config import RunConfig
from agentgrpo.run.log import Progress, RunLogger, read_jsonl
from agentgrpo.types import Score, StopReason, Trajectory


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def traj(reward: float, sampled: int) -> tuple[Trajectory, Score]:
    """A finished trajectory of `sampled` sampled tokens and its score."""
    n = sampled + 2
    return Trajectory(
        "t",
        list(range(n)),
        [0, 0] + [1] * sampled,
        [0.0, 0.0] + [-1.0] * sampled,
        2,
        [],
        StopReason.COMPLETED,
        reward=reward,
    ), Score("", reward)


def one_step(p: Progress, clock: Clock, step: int, *, loss: float = 0.25) -> None:
    p.phase("rollout")
    clock.t += 2.0
    p.rollout_done(*traj(1.0, 6))
    p.rollout_done(*traj(math.nan, 4))  # unscorable: counted as done, not in the reward
    p.phase("train")
    clock.t += 1.0
    p.phase("sync")
    clock.t += 1.0
    p.step_done(step, {"reward_mean": 0.5, "reward_std": 0.5, "loss": loss, "tokens_per_s": 5.0})


def test_plain_lines_name_phases_and_estimate_time_left():
    out, clock = io.StringIO(), Clock()
    p = Progress(4, rollouts_per_step=2, file=out, live=False, clock=clock)
    assert math.isnan(p.eta())
    assert not Progress(1).live or sys.stderr.isatty()  # a log file or a pipe gets plain lines
    one_step(p, clock, 1)
    assert out.getvalue().strip() == (
        "step 1/4 · reward 0.5 ± 0.5 · loss 0.25 · 5 tok/s · "
        "4.0s (rollout 2.0s, train 1.0s, sync 1.0s) · eta 12s"
    )
    p.phase("rollout")
    clock.t += 1.0
    assert p.eta() == pytest.approx(3 * 4.0 - 1.0)  # 3 steps to go at 4 s each, 1 s already spent
    assert p.phase_times() == {"rollout": pytest.approx(1.0)}
    clock.t += 9.0  # a slower step: the estimate follows the mean of the recent steps
    p.phase("train")
    p.step_done(2, {"loss": 0.1})
    assert p.eta() == pytest.approx(2 * (4.0 + 10.0) / 2)
    assert out.getvalue().splitlines()[-1].startswith("step 2/4 · reward — · loss 0.1")
    p.close()


def test_live_bar_shows_rollouts_reward_and_phase():
    out, clock = io.StringIO(), Clock()
    p = Progress(3, start_step=1, rollouts_per_step=2, file=out, live=True, clock=clock)
    p.phase("rollout")
    clock.t += 2.0
    p.rollout_done(*traj(1.0, 6))
    p.phase("train")  # a forced redraw: the running reward and tok/s of the rollouts so far
    text = out.getvalue()
    assert "step 2/3 · rollout" in text and "step 2/3 · train" in text  # resumed: step 2 of 3
    assert "1/2 rollouts" in text and "reward 1 · 3 tok/s" in text  # 6 tokens in 2 s
    p.phase("eval", total=5)
    p.rollout_done(*traj(0.0, 1))
    p.phase("sync")
    assert "eval reward 0 " in out.getvalue() and "1/5 rollouts" in out.getvalue()
    p.step_done(2, {"reward_mean": 1.0, "loss": 0.5, "tokens_per_s": 3.0})
    last = out.getvalue().split("\r")[-1]
    assert "step 2/3 done" in last and "loss 0.5" in last and "eta 2s" in last
    p.phase("checkpoint")  # between steps: starts step 3's bar
    p.close()
    assert "step 3/3" in out.getvalue()


def test_after_the_last_step_a_phase_is_a_line_not_a_new_step():
    out, clock = io.StringIO(), Clock()
    p = Progress(1, rollouts_per_step=2, file=out, live=True, clock=clock)
    one_step(p, clock, 1)
    p.phase("checkpoint")
    p.close()
    assert "step 2/1" not in out.getvalue() and out.getvalue().endswith(
        "checkpoint after step 1/1\n"
    )


def test_disabled_progress_writes_nothing_but_still_times_the_phases():
    out, clock = io.StringIO(), Clock()
    p = Progress(2, rollouts_per_step=2, file=out, enabled=False, live=True, clock=clock)
    one_step(p, clock, 1)
    assert p.phase_s and all(
        v > 0 for v in p.phase_s.values()
    )  # phase_s/* metrics do not need a display
    p.phase("checkpoint")
    p.close()
    assert out.getvalue() == ""


class FakeRun:
    def __init__(self, **kwargs):
        self.init, self.logged, self.finished = kwargs, [], False

    def log(self, data, step):
        self.logged.append((step, data))

    def finish(self):
        self.finished = True


@pytest.fixture
def fake_wandb(monkeypatch):
    mod = types.ModuleType("wandb")
    mod.runs = []

    def init(**kwargs):
        mod.runs.append(FakeRun(**kwargs))
        return mod.runs[-1]

    mod.init = init
    monkeypatch.setitem(sys.modules, "wandb", mod)
    return mod


def test_wandb_gets_masked_config_and_finite_metrics_and_resumes(tmp_path, fake_wandb):
    cfg = RunConfig(
        output_dir=str(tmp_path),
        log={"wandb_project": "proj", "wandb_name": "n", "tensorboard": False},
        env={"kwargs": {"api_key": "sekrit"}},
    )
    logger = RunLogger.from_config(tmp_path, cfg)
    logger.log_step(1, {"reward_mean": 0.5, "loss": float("nan")})
    logger.close()
    run = fake_wandb.runs[0]
    assert (
        run.init["project"] == "proj" and run.init["name"] == "n" and run.init["resume"] == "allow"
    )
    assert run.init["config"]["env"]["kwargs"]["api_key"] == "***"
    assert "sekrit" not in json.dumps(run.init["config"])
    assert run.logged == [(1, {"reward_mean": 0.5})] and run.finished
    assert read_jsonl(tmp_path / "metrics.jsonl") == [{"step": 1, "reward_mean": 0.5, "loss": None}]
    RunLogger.from_config(tmp_path, cfg).close()  # a resumed run continues the same W&B run
    assert (
        fake_wandb.runs[1].init["id"]
        == run.init["id"]
        == (tmp_path / "wandb_id").read_text().strip()
    )


def test_wandb_is_imported_only_when_configured(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # any `import wandb` now raises ImportError
    RunLogger(tmp_path / "a", tensorboard=False).close()
    with pytest.raises(ImportError, match=r"agentgrpo\[wandb\]"):
        RunLogger(tmp_path / "b", tensorboard=False, wandb_project="proj")
    assert not (tmp_path / "b" / "metrics.jsonl").exists()


def test_rows_after_the_resumed_step_go_aside_and_nothing_is_lost(tmp_path):
    from agentgrpo.run.log import read_jsonl, set_aside_after

    rows = [{"step": s, "k": i} for i, s in enumerate([1, 2, 2, 3, 4])]
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows) + '{"step": 5, "k"'
    )
    (tmp_path / "trajectories.jsonl").write_text(json.dumps({"step": 1}) + "\n")
    assert set_aside_after(tmp_path, 2) == {"metrics.jsonl": 3, "trajectories.jsonl": 0}
    assert read_jsonl(tmp_path / "metrics.jsonl") == rows[:3]
    aside = (tmp_path / "metrics.after-step-2.jsonl").read_text().splitlines()
    assert [json.loads(x) for x in aside[:2]] == rows[3:] and aside[
        2
    ] == '{"step": 5, "k"'  # cut line kept
    assert not (tmp_path / "trajectories.after-step-2.jsonl").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "metrics.after-step-2.jsonl",
        "metrics.jsonl",
        "trajectories.jsonl",
    ]


def test_each_set_aside_timeline_gets_files_of_its_own(tmp_path):
    """Issue 33: two resumes to the same step appended two timelines into one
    `*.after-step-N.jsonl` with no separator. Each call's rows go to a file of their own."""
    from agentgrpo.run.log import aside_name, read_jsonl, set_aside_after

    def timeline(tag):
        rows = [{"step": s, "try": tag} for s in (1, 2, 3)]
        (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (tmp_path / "trajectories.jsonl").write_text(json.dumps({"step": 3, "try": tag}) + "\n")
        return rows

    first = timeline("a")
    set_aside_after(tmp_path, 1)
    assert aside_name(tmp_path, "metrics.jsonl", 1) == "metrics.after-step-1.jsonl"
    second = timeline("b")
    assert set_aside_after(tmp_path, 1) == {"metrics.jsonl": 2, "trajectories.jsonl": 1}
    assert aside_name(tmp_path, "metrics.jsonl", 1) == "metrics.after-step-1.2.jsonl"
    assert read_jsonl(tmp_path / "metrics.after-step-1.jsonl") == first[1:]
    assert read_jsonl(tmp_path / "metrics.after-step-1.2.jsonl") == second[1:]
    assert read_jsonl(tmp_path / "trajectories.after-step-1.2.jsonl") == [{"step": 3, "try": "b"}]
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 3}) + "\n")  # only metrics moves
    set_aside_after(tmp_path, 1)
    assert aside_name(tmp_path, "metrics.jsonl", 1) == "metrics.after-step-1.3.jsonl"
    assert not (tmp_path / "trajectories.after-step-1.3.jsonl").exists()
