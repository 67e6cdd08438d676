"""Mixtures of environments (`envs:`, agentgrpo/run/mixture.py): tasks drawn by weight as a pure
function of the stream position, each task routed to its env and limits, per-env metrics in
metrics.jsonl and the report, and a run stopped by SIGTERM that resumes exactly."""

from __future__ import annotations

import asyncio
import math
import os
import signal
from collections import Counter

import pytest

from agentgrpo.rollout.episode import RolloutConfig, collect
from agentgrpo.run.config import ConfigError, load_config
from agentgrpo.run.log import read_jsonl
from agentgrpo.run.mixture import Mixture, labels
from agentgrpo.run.train import TaskStream, run_envs
from agentgrpo.types import Group, StopReason, Trajectory
from tests.fakes import ScriptedEngine
from tests.short_runs import MOVING, by_step, train_short

EXAMPLE = "examples/mixture.yaml"
EVAL_EVERY_2 = ("eval.every=2", "eval.num_tasks=1")


def mixture(*overrides):
    return run_envs(load_config(EXAMPLE, list(overrides)))


def test_tasks_are_drawn_by_weight_as_a_function_of_the_position():
    stream, _, _, mix = mixture()
    drawn = Counter(stream.env_at(p) for p in range(4000))
    assert abs(drawn["calculator"] / 4000 - 0.75) < 0.03  # weights 3 : 1
    first = [stream.task_at(p).id for p in range(40)]
    again, _, _, _ = mixture()
    assert [again.task_at(p).id for p in reversed(range(40))] == first[::-1]  # any order
    assert {t.split("/")[0] for t in first} == {"calculator", "chain_sum"}
    # each env's tasks come in its own stream's order, without skipping any
    calc = [t for t in first if t.startswith("calculator/")]
    own = stream.streams["calculator"]
    assert isinstance(own, TaskStream) and own.tasks == mix.sources["calculator"].train
    assert calc == [own.task_at(k).id for k in range(len(calc))]
    assert stream.take(3) == [stream.task_at(p) for p in range(3)] and stream.position == 3


def test_each_task_is_routed_to_its_env_and_limits():
    stream, make_env, _, mix = mixture()
    calc = next(stream.task_at(p) for p in range(50) if stream.env_at(p) == "calculator")
    chain = next(stream.task_at(p) for p in range(50) if stream.env_at(p) == "chain_sum")
    (calc_env, calc_limits), (chain_env, chain_limits) = mix.route(calc), mix.route(chain)
    assert type(calc_env()).__name__ == "CalculatorEnv" and calc_limits.max_turns == 3
    assert type(chain_env()).__name__ == "ReasoningGymEnv"
    assert (chain_limits.max_turns, chain_limits.max_tokens) == (1, 96)
    assert type(make_env()).__name__ == "CalculatorEnv"  # the first env, for start-up probes
    with pytest.raises(KeyError, match="belongs to no env"):
        mix.route(calc.model_copy(update={"id": "other/1"}))


def test_a_group_never_mixes_envs_and_keeps_its_envs_limits(chat):
    stream, make_env, _, mix = mixture()
    tasks = [stream.task_at(p) for p in range(6)]
    engine = ScriptedEngine(chat.tokenizer, ["<answer>3</answer>"], chat.end_of_turn_id)
    cfg = RolloutConfig(group_size=3, tasks_per_step=6, max_turns=3, max_tokens=200)
    groups = asyncio.run(collect(make_env, engine, chat, tasks, cfg, route=mix.route, seed=0))
    assert [g.task.id for g in groups] == [t.id for t in tasks]
    for g in groups:
        assert {t.task_id for t in g.trajectories} == {g.task.id}
    metrics = mix.metrics(groups)
    assert metrics["env/calculator/groups"] + metrics["env/chain_sum/groups"] == 6
    assert (
        "env/chain_sum/reward_mean" in metrics
        and "env/calculator/user_threads_stuck" not in metrics
    )


def test_the_flaky_verdict_rule_runs_env_by_env_and_keeps_the_order():
    stream, _, _, mix = mixture()
    tasks = [stream.task_at(p) for p in range(8)]

    def group(task):  # a chain_sum env reports its verdict flaky; calculator does not
        flaky = {"flaky_verdict": True} if task.id.startswith("chain_sum/") else {}
        t = Trajectory(
            id=f"{task.id}/0",
            task_id=task.id,
            token_ids=[],
            loss_mask=[],
            logprobs=[],
            prompt_len=0,
            messages=[],
            stop_reason=StopReason.COMPLETED,
            reward=1.0,
            env_info=flaky,
        )
        return Group(task.id, task, [t])

    checked, flaky = asyncio.run(mix.recheck_step([group(t) for t in tasks], seed=0))
    assert [g.task.id for g in checked] == [t.id for t in tasks]
    assert 0 < flaky < len(tasks) and flaky == sum(math.isnan(g.rewards[0]) for g in checked)
    for g in checked:
        assert math.isnan(g.rewards[0]) == g.task.id.startswith("chain_sum/")


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["env.name=calculator"], "set env .* or envs .*, not both"),
        (["envs=[]"], "envs is empty"),
        (["envs=[{name: calculator, rollout: {group_size: 3}}]"], "only episode limits"),
        (["envs=[{name: calculator, rollout: {max_turns: 0}}]"], "max_turns"),
        (["envs=[{name: calculator, weight: 0}]"], "weight"),
        (["envs=[{name: calculator, label: 'a b'}]"], "letters, digits"),
    ],
)
def test_bad_mixtures_are_refused_by_name(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(EXAMPLE, overrides)


def test_labels_default_to_env_names_and_never_repeat():
    cfg = load_config(EXAMPLE, ["envs=[{name: calculator}, {name: calculator}, {name: x:Env}]"])
    assert labels(cfg.envs) == ["calculator", "calculator-2", "Env"]
    cfg = load_config(EXAMPLE, ["envs=[{name: calculator}, {name: calculator, label: calculator}]"])
    with pytest.raises(ConfigError, match="names two entries"):
        labels(cfg.envs)
    bad = load_config(EXAMPLE, ["envs=[{name: calculator, tasks: {digitz: 2}}]"])
    with pytest.raises(ConfigError, match=r"envs\[0\] \(calculator\)"):
        Mixture.load(bad, with_eval=False)


def test_four_steps_split_by_env_and_resumed_exactly_after_sigterm(
    tmp_path, stopping_model_dir, monkeypatch
):
    straight = tmp_path / "straight"
    assert train_short(straight, stopping_model_dir, 4, *MOVING, *EVAL_EVERY_2, config=EXAMPLE) == 0
    metrics = read_jsonl(straight / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    for m in metrics:  # every step's groups, split by env
        per_env = [
            k for k in m if k.startswith("env/") and k.endswith("/groups") and "/eval/" not in k
        ]
        assert sum(m[k] for k in per_env) == 2
    seen = {k.split("/")[1] for m in metrics for k in m if k.startswith("env/")}
    assert seen == {"calculator", "chain_sum"}
    assert "env/chain_sum/eval/reward_mean" in metrics[1] | metrics[3]
    rows = read_jsonl(straight / "trajectories.jsonl")
    assert all(r["num_turns"] <= 1 for r in rows if r["task_id"].startswith("chain_sum/"))
    report = (straight / "report.html").read_text()
    assert "plot-reward_by_env" in report and "calculator, chain_sum" in report

    from agentgrpo.learner.learner import Learner

    real_step = Learner.train_step

    def preempted(self, *a, **kw):
        out = real_step(self, *a, **kw)
        if self.step == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # arrives while step 2 is in progress
        return out

    stopped = tmp_path / "stopped"
    monkeypatch.setattr(Learner, "train_step", preempted)
    assert train_short(stopped, stopping_model_dir, 4, *MOVING, *EVAL_EVERY_2, config=EXAMPLE) == 0
    assert [m["step"] for m in read_jsonl(stopped / "metrics.jsonl")] == [1, 2]
    monkeypatch.setattr(Learner, "train_step", real_step)
    assert train_short(stopped, stopping_model_dir, 4, *MOVING, *EVAL_EVERY_2, config=EXAMPLE) == 0
    a, b = by_step(straight), by_step(stopped)
    assert a == b  # the same tasks of the same envs, the same tokens and rewards, every step
    ma, mb = read_jsonl(straight / "metrics.jsonl"), read_jsonl(stopped / "metrics.jsonl")
    assert [m["loss"] for m in ma] == pytest.approx([m["loss"] for m in mb], abs=1e-6)
    env_keys = sorted(k for k in ma[3] if k.startswith("env/") and "eval" not in k)
    assert [ma[3][k] for k in env_keys] == pytest.approx([mb[3][k] for k in env_keys], nan_ok=True)


def test_agentgrpo_eval_of_a_mixture_is_refused_by_name():
    from agentgrpo.run.evaluate import run_eval

    with pytest.raises(ConfigError, match="eval of a mixture .* is not built yet"):
        run_eval(load_config(EXAMPLE))
