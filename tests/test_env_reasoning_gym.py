"""The reasoning-gym adapter (envs/reasoning_gym_env.py): generators as tasks, split by question,
weighted; the generator's scorer as reward; the tool variant; one training step on the embedded
model over two generators, token-exact."""

from __future__ import annotations

import asyncio

import pytest

from agentgrpo import Message, ToolCall, check_env
from agentgrpo.cli import main
from agentgrpo.env.base import get_env_class
from agentgrpo.run.log import read_jsonl
from envs.reasoning_gym_env import ReasoningGymEnv, reasoning_gym_tasks
from tests.test_train_e2e import _check_run_dir

TWO = {"chain_sum": {"weight": 3}, "basic_arithmetic": {"max_terms": 3}}


def test_found_by_name():
    assert get_env_class("reasoning_gym") is ReasoningGymEnv


def test_splits_are_disjoint_stable_and_weighted():
    train = reasoning_gym_tasks(TWO, "train", 0, 8)
    again = reasoning_gym_tasks(TWO, "train", 0, 8)
    evals = reasoning_gym_tasks(TWO, "eval", 0, 8)
    assert [t.id for t in train] == [t.id for t in again]
    assert not {t.prompt for t in train} & {t.prompt for t in evals}
    # 8 tasks at weights 3:1 -> 6 and 2
    counts = {d: sum(t.metadata["dataset"] == d for t in train) for d in TWO}
    assert counts == {"chain_sum": 6, "basic_arithmetic": 2}
    # a longer list of one split starts with the shorter one: a task's split never depends on n
    one = reasoning_gym_tasks(["chain_sum"], "eval", 0, 3)
    assert [t.id for t in reasoning_gym_tasks(["chain_sum"], "eval", 0, 5)][:3] == [
        t.id for t in one
    ]


@pytest.mark.parametrize(
    "datasets, match",
    [
        (["no_such_generator"], "unknown reasoning-gym dataset 'no_such_generator'"),
        ({"chain_sum": {"weight": 0}}, "datasets.chain_sum.weight must be a number > 0"),
        ({"chain_sum": {"max_termz": 3}}, "max_termz"),
        ([], "datasets is empty"),
    ],
)
def test_bad_datasets_are_refused_by_name(datasets, match):
    with pytest.raises((ValueError, TypeError), match=match):
        reasoning_gym_tasks(datasets, "train", 0, 2)


def _answer(env, task, text):
    env.reset(seed=0, options={"task": task})
    return asyncio.run(env.step(Message(role="assistant", content=text)))


def test_the_generators_own_scorer_is_the_reward():
    task = reasoning_gym_tasks(["chain_sum"], "train", 0, 1)[0]
    env = ReasoningGymEnv()
    right = _answer(env, task, f"So it is <answer>{task.answer}</answer>")
    assert right.reward == 1.0 and right.terminated and right.info == {"answer": task.answer}
    wrong = _answer(env, task, f"<answer>{int(task.answer) + 1}</answer>")
    assert wrong.reward == 0.0
    untagged = _answer(env, task, task.answer)  # reasoning-gym's convention: the tag is the answer
    assert untagged.reward == 0.0 and untagged.info == {"answer": None}


def test_partial_credit_comes_from_the_generator():
    # word_sorting gives 0.0 or 1.0; letter_counting too; spell_backward scores partially
    task = reasoning_gym_tasks(["spell_backward"], "train", 0, 1)[0]
    near = task.answer[:-1] + ("x" if task.answer[-1] != "x" else "y")
    step = _answer(ReasoningGymEnv(), task, f"<answer>{near}</answer>")
    assert 0.0 < step.reward < 1.0, step.reward


def test_the_tool_variant_calls_the_calculator_then_scores():
    task = reasoning_gym_tasks(["chain_sum"], "train", 0, 1)[0]
    env = ReasoningGymEnv(tools=["calculator"])
    msgs, _ = env.reset(seed=0, options={"task": task})
    assert "calculator" in msgs[0].content and [t.name for t in env.get_tools().values()] == [
        "calculator"
    ]
    expr = task.metadata["entry"]["metadata"]["expression"]
    call = ToolCall(id="c1", name="calculator", arguments={"expression": expr})
    step = asyncio.run(env.step(Message(role="assistant", content="", tool_calls=[call])))
    assert not step.terminated and step.messages[0].content == task.answer
    answer = Message(role="assistant", content=f"<answer>{task.answer}</answer>")
    end = asyncio.run(env.step(answer))
    assert end.reward == 1.0
    with pytest.raises(ValueError, match="unknown tools \\['abacus'\\]"):
        ReasoningGymEnv(tools=["abacus"])


def test_both_variants_pass_check_env():
    task = reasoning_gym_tasks(["basic_arithmetic"], "train", 0, 1)[0]
    check_env(ReasoningGymEnv(), task)
    check_env(ReasoningGymEnv(tools=["calculator"]), task)


@pytest.mark.slow
def test_one_step_on_two_generators_with_the_embedded_model(tmp_path, smol_path):
    out = tmp_path / "run"
    rc = main(
        [
            "train",
            "examples/reasoning_gym.yaml",
            f"output_dir={out}",
            f"model.path={smol_path}",
            "train.steps=1",
            "rollout.group_size=2",
            "rollout.tasks_per_step=4",
            "rollout.max_new_tokens=32",
            "rollout.max_tokens=32",
            "log.progress=false",
            "log.tensorboard=true",
        ]
    )
    assert rc == 0
    _check_run_dir(out, 1)  # token-exact rows (Trajectory.check), finite loss and reward
    rows = read_jsonl(out / "trajectories.jsonl")
    assert {r["task_id"].split("-")[0] for r in rows} == {"chain_sum", "basic_arithmetic"}
    assert all(r["env_info"].keys() == {"answer"} for r in rows if r["stop_reason"] == "completed")
