"""An env's `rubric` scores its groups in the rollout: the weighted reward and its parts, NaN with
the reason, the group hook over the whole group, the env's own reward kept aside, the tool-error
penalty applied once, and the run directory and report showing the parts."""

from __future__ import annotations

import asyncio
import math
import threading
import time

import pytest
import torch

from agentgrpo import Env, StopReason, ToolEnv
from agentgrpo.algo.advantage import compute_advantages
from agentgrpo.engine import SamplingParams
from agentgrpo.env.rubric import Rubric, VerifierResult, env_reward
from agentgrpo.rollout.episode import (
    EpisodeLimits,
    RolloutConfig,
    collect,
    rollout_metrics,
    run_group,
)
from envs.calculator import CalculatorEnv, last_number
from tests.fakes import ScriptedEngine
from tools.calculator import calculator

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "56+55"}}\n</tool_call>'
TASK = CalculatorEnv.load_tasks("train", seed=0, n=1)[0]  # "What is 56 + 55?" -> 111
verifier_threads: set[str] = set()


def correct(trajectory, task) -> float:  # sync: runs in a worker thread
    verifier_threads.add(threading.current_thread().name)
    return float(last_number(trajectory.messages[-1].content) == int(task.answer))


async def used_tool(trajectory, task) -> float:  # async: runs on the event loop
    await asyncio.sleep(0.01)
    return float(trajectory.tool_calls > 0)


class RubricCalc(ToolEnv):
    """The calculator scored by a rubric: no `reward` method."""

    tools = (calculator,)
    system_prompt = CalculatorEnv.system_prompt
    rubric = Rubric([("correct", correct, 1.0), ("used_tool", used_tool, 0.5)])

    @classmethod
    def load_tasks(cls, split="train", seed=0, **kwargs):
        return CalculatorEnv.load_tasks(split, seed, **kwargs)


class BySeed:
    """An engine whose members differ by sampling seed: even seeds call the tool, then answer 111
    (reward 1 + 0.5); odd seeds answer 112 at once (reward 0)."""

    def __init__(self, chat):
        def turn(ids):
            return chat.decode(ids).count("<|im_start|>assistant")

        def by_turn(*texts):
            return lambda ids, i: texts[min(turn(ids) - 1, len(texts) - 1)]

        self.turn = turn
        self.engines = [
            ScriptedEngine(chat.tokenizer, by_turn(CALL, "111"), chat.end_of_turn_id),
            ScriptedEngine(chat.tokenizer, by_turn("112"), chat.end_of_turn_id),
        ]

    async def generate(self, prompt_ids, params):
        # The member is named by its session ("<group>/<i>"); only even members (the tool
        # users) have a later turn.
        member = int(params.session_id.rsplit("/", 1)[1]) % 2 if self.turn(prompt_ids) == 1 else 0
        return await self.engines[member].generate(prompt_ids, params)


def group(chat, env, engine=None, size=4, **limits):
    engine = engine or BySeed(chat)
    return asyncio.run(
        run_group(
            env, engine, chat, TASK, size, SamplingParams(seed=0), limits=EpisodeLimits(**limits)
        )
    )


def test_rubric_scores_collected_groups_with_weights_and_parts(chat):
    verifier_threads.clear()
    done = []  # two groups of the same task (the script knows one answer)
    groups = asyncio.run(
        collect(
            RubricCalc,
            BySeed(chat),
            chat,
            [TASK, TASK],
            RolloutConfig(group_size=4),
            on_done=lambda t, score: done.append(score),
        )
    )
    for g in groups:
        for t in g.trajectories:
            score = g.score(t)
            assert t.stop_reason == StopReason.COMPLETED
            assert set(score.parts) == {"correct", "used_tool"}
            assert score.reward == 1.0 * score.parts["correct"] + 0.5 * score.parts["used_tool"]
            assert score.env_reward == 0.0  # ToolEnv.reward with a rubric: the env has no say
    assert [r for g in groups for r in g.rewards] == [1.5, 0.0] * 4  # tool, 111: 1 + 0.5; 112: 0
    assert sorted(s.reward for s in done) == [0.0] * 4 + [1.5] * 4  # on_done saw the scores
    assert verifier_threads and all(n.startswith("agentgrpo-user") for n in verifier_threads)
    m = rollout_metrics(groups)
    assert (
        m["reward_parts/correct"] == 0.5
        and m["reward_parts/used_tool"] == 0.5
        and m["unscorable"] == 0
    )
    # and on into the advantage step: each group's 1.5s above its mean, its 0s below
    rewards_B = torch.tensor([r for g in groups for r in g.rewards])
    group_ids_B = torch.tensor([i for i, g in enumerate(groups) for _ in g.trajectories])
    adv_B = compute_advantages(rewards_B, group_ids_B, estimator="grpo")
    assert ((adv_B > 0) == (rewards_B > 0)).all() and (adv_B != 0).all()


def test_env_reward_is_kept_aside_and_the_penalty_applied_once(chat):
    class Both(RubricCalc):
        rubric = Rubric([("env", env_reward, 2.0), ("correct", correct, 1.0)])

        def reward(self, task, messages):
            return 1.0

    engine = ScriptedEngine(
        chat.tokenizer, ["<tool_call>{bad</tool_call>", "111"], chat.end_of_turn_id
    )
    g = group(chat, Both, engine, size=1, tool_error_penalty=0.25, max_turns=3)
    t = g.trajectories[0]
    score = g.score(t)
    assert t.tool_errors == 1 and score.env_reward == t.reward == 1.0  # the env's, no penalty
    assert score.parts == {"env": 1.0, "correct": 1.0}
    assert score.reward == pytest.approx(2.0 * 1.0 + 1.0 - 0.25)


def test_failing_verifier_is_unscorable_with_its_reason_not_zero(chat):
    def sandbox(trajectory, task) -> float:
        raise ConnectionError("sandbox down")

    class Broken(RubricCalc):
        rubric = Rubric([("correct", correct, 1.0), ("tests", sandbox, 1.0)])

    class Silent(RubricCalc):
        rubric = Rubric([("correct", correct, 1.0), ("judge", lambda t, k: math.nan, 1.0)])

    for env, why in [
        (Broken, "unscorable: tests: ConnectionError: sandbox down"),
        (Silent, "unscorable: NaN from judge"),
    ]:
        g = group(chat, env)
        for t in g.trajectories:
            score = g.score(t)
            assert (
                score.unscorable and t.stop_reason == StopReason.COMPLETED
            )  # the episode was fine
            assert why in score.detail and score.parts["correct"] in (
                0.0,
                1.0,
            )  # the other part kept
        assert rollout_metrics([g])["unscorable"] == 4
        if env is Broken:
            assert all(math.isnan(g.score(t).parts["tests"]) for t in g.trajectories)


def test_scoring_is_bounded_by_the_step_deadline(chat):
    async def hangs(trajectory, task) -> float:
        await asyncio.sleep(30)
        return 1.0

    class Hanging(RubricCalc):
        rubric = Rubric([("judge", hangs, 1.0)])

    t0 = time.monotonic()
    groups = asyncio.run(
        collect(
            Hanging, BySeed(chat), chat, [TASK], RolloutConfig(group_size=2, step_timeout_s=0.5)
        )
    )
    assert time.monotonic() - t0 < 5
    for t in groups[0].trajectories:
        score = groups[0].score(t)
        assert score.unscorable and "step deadline expired while the rubric scored" in score.detail


def test_group_hook_sees_the_whole_group_and_infra_failures_stay_nan(chat):
    seen = []

    def bonus_for_the_shortest_right_answer(trajectories, task, results):
        seen.append((len(trajectories), task.id, [r.score for r in results]))
        right = [i for i, r in enumerate(results) if r.score > 0]
        best = min(right, key=lambda i: trajectories[i].num_sampled, default=None)
        return [
            VerifierResult(r.score + (0.25 if i == best else 0.0), r.detail, r.parts)
            for i, r in enumerate(results)
        ]

    class Hooked(RubricCalc):
        rubric = Rubric([("correct", correct, 1.0)], group_hook=bonus_for_the_shortest_right_answer)

    g = group(chat, Hooked)
    assert seen == [(4, TASK.id, [1.0, 0.0, 1.0, 0.0])]  # one call, with every member of the group
    assert g.rewards == [1.25, 0.0, 1.0, 0.0]  # equal lengths: the first wins

    made = iter(range(3))

    def factory():  # member 1 cannot even be created: ENV_ERROR, NaN, not shown to the hook
        if next(made) == 1:
            raise RuntimeError("simulator down")
        return Hooked()

    seen.clear()
    g = group(chat, factory, size=3)
    assert seen[0][0] == 2 and g.trajectories[1].stop_reason == StopReason.ENV_ERROR
    assert g.score(g.trajectories[1]).unscorable and g.score(g.trajectories[1]).parts == {}


def test_a_rubric_must_be_a_rubric_and_a_tool_env_needs_one_or_a_reward(chat):
    with pytest.raises(
        TypeError, match="Bad.rubric must be an agentgrpo.env.rubric.Rubric or None, got function"
    ):

        class Bad(Env):
            rubric = correct

    class ByProperty(RubricCalc):
        @property
        def rubric(self):
            return correct  # not a Rubric: found when the env is made, and that member fails

    g = group(chat, ByProperty, size=1)
    assert (
        g.trajectories[0].stop_reason == StopReason.ENV_ERROR
        and "rubric must be" in g.trajectories[0].stop_detail
    )

    class Neither(ToolEnv):
        tools = (calculator,)

    with pytest.raises(NotImplementedError, match="must implement reward.*or declare a rubric"):
        Neither().reward(TASK, [])


def test_run_directory_and_report_show_the_parts(tmp_path, tiny_model_dir):
    from agentgrpo.cli import main
    from agentgrpo.run.log import read_jsonl

    out = tmp_path / "run"
    assert (
        main(
            [
                "train",
                "examples/calculator.yaml",
                f"output_dir={out}",
                "train.steps=1",
                "env.name=tests.test_rewards_rubric:RubricCalc",
                "env.audit.reward_hacks=skip",  # a toy verifier: not what this tests
                f"model.path={tiny_model_dir}",
                "rollout.group_size=2",
                "rollout.tasks_per_step=2",
                "rollout.max_new_tokens=12",
                "rollout.max_tokens=40",
                "log.progress=false",
            ]
        )
        == 0
    )
    rows = read_jsonl(out / "trajectories.jsonl")
    scored = [r for r in rows if r["reward"] is not None]
    assert scored and all(set(r["reward_parts"]) == {"correct", "used_tool"} for r in scored)
    metrics = read_jsonl(out / "metrics.jsonl")[0]
    assert "reward_parts/correct" in metrics and "reward_parts/used_tool" in metrics
    assert "correct: " in (out / "report.html").read_text()
