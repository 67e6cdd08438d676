"""The verifier audits (agentgrpo/checks/reward_audit.py, hacks.py): every listed hack is caught
against a deliberately weak verifier and earns nothing from the shipped ones; a planted flaky
verifier is flagged; `check-env` reports a paying hack with its input and `train` refuses it; a
flaky verdict in training makes its group unscorable."""

from __future__ import annotations

import asyncio
import collections
import math
import os
import random

import pytest

from agentgrpo import Message, Task, ToolEnv, tool
from agentgrpo.checks.hacks import WORKSPACE_HACKS
from agentgrpo.checks.reward_audit import (
    AuditConfig,
    RewardHackError,
    audit_at_start,
    audit_env,
    recheck_groups,
)
from agentgrpo.cli import main
from agentgrpo.env.base import get_env_class
from agentgrpo.env.rubric import Rubric
from agentgrpo.types import Group, Score, StopReason, Trajectory
from agentgrpo.verify.code import extract_code
from agentgrpo.verify.sandbox import default_sandbox
from envs.repo_repair import RepoRepairEnv
from tools.workspace import WorkspaceEnv

ANSWER_HACKS = {
    "empty answer",
    "echo the prompt",
    "answer in a think block",
    "answer in an earlier turn",
    "sys.exit(0) before the tests",
    "os._exit(0) before the tests",
    "prints 'passed'",
    "__eq__ always true",
    "patches the test runner",
    "hard-codes the visible tests",
}


def _needs_sessions() -> None:
    if os.geteuid() != 0 or default_sandbox().backend != "namespaces":
        pytest.skip("session envs need the sandbox's namespaces backend (root)")


def _passes(out: str, exit_code: int | None) -> bool:
    """The weak verdict: exit 0, or a last line that says passed (and not failed)."""
    last = (out.strip().splitlines() or [""])[-1]
    return exit_code == 0 or ("passed" in last and "failed" not in last)


class WeakEnv(WorkspaceEnv):
    """A deliberately weak verifier, open to every listed hack: it pays when the reference answer
    appears anywhere, for an empty answer, for an answer that repeats the question, when the
    answer's code and the visible tests, run as one program, exit 0 or end by printing a pass,
    and when the workspace's own test runner exits 0 or ends by printing a pass."""

    tool_names = ("bash",)

    async def reward(self, task, messages):
        final = messages[-1].content
        said = " ".join(m.content for m in messages if m.role == "assistant")
        if not final.strip() or str(task.answer) in said or task.prompt in final:
            return 1.0
        program = extract_code(final) + "\n" + "\n".join(task.metadata["tests"])
        res = await default_sandbox().arun(program)
        if _passes(res.stdout, res.exit_code):
            return 1.0
        res = await self.live_session().run("python3 run_tests.py")
        return float(_passes(res.stdout, res.exit_code))


def _weak_task() -> Task:
    repo = RepoRepairEnv.load_tasks("train", seed=2, n=1)[0]
    return Task(
        id="weak",
        prompt="Write double(x), which returns twice x, and fix the package's tests.",
        answer="31337",
        metadata={
            "workspace": repo.metadata["workspace"],
            "tests": ["assert double(2) == 4", "assert double(5) == 10"],
        },
    )


def test_every_listed_hack_is_caught_against_a_weak_verifier():
    _needs_sessions()
    report = asyncio.run(audit_env(WeakEnv, [_weak_task()]))
    names = {r.attempt.name for r in report.results}
    workspace = {f"{n} (workspace)" for n in WORKSPACE_HACKS}
    assert names == ANSWER_HACKS | workspace
    assert {r.attempt.name for r in report.paid()} == names, report.format()
    text = report.format()
    assert "PAID" in text and "sys.exit(0)" in text and "rm -rf tests" in text  # exact inputs


SHIPPED = {
    "calculator": {},
    "calculator_steps": {},
    "gym_text": {},
    "python_math": {"n": 2, "dataset": "chain_sum"},
    "code_tests": {},
    "terminal": {"n": 2, "kinds": ["count", "fix"]},
    "repo_repair": {"n": 1},
}


@pytest.mark.parametrize("name", list(SHIPPED))
def test_shipped_verifiers_pay_for_no_hack_and_are_deterministic(name):
    if name in ("terminal", "repo_repair"):
        _needs_sessions()
    cls = get_env_class(name)
    tasks = list(cls.load_tasks("train", seed=0, **SHIPPED[name]))[:2]
    report = asyncio.run(audit_env(cls, tasks))
    assert report.ok, report.format()


class Arithmetic(ToolEnv):
    """7 * 6 with a rubric: an exact verifier and, planted, one that scores the same episode
    differently each time it sees it (0, then 1, then 0, ...), whatever the order of the plays."""

    seen: collections.Counter = collections.Counter()

    @tool
    def note(self, text: str) -> str:
        """Keep a note.

        Args:
            text: the note
        """
        return "noted"

    @staticmethod
    def exact(trajectory, task) -> float:
        return float(trajectory.messages[-1].content.strip() == task.answer)

    @staticmethod
    def coin(trajectory, task) -> float:
        key = tuple((m.role, m.content) for m in trajectory.messages)
        Arithmetic.seen[key] += 1
        return float(Arithmetic.seen[key] % 2)

    rubric = Rubric([("exact", exact, 1.0), ("coin", coin, 0.0)])

    @classmethod
    def load_tasks(cls, split="train", seed=0, **kwargs):
        return [Task(id=f"{split}-1", prompt="What is 7 * 6?", answer="42")]


def test_a_planted_flaky_verifier_is_flagged():
    report = asyncio.run(audit_env(Arithmetic, Arithmetic.load_tasks()))
    assert set(report.flaky()) == {"coin"}  # the exact verifier agreed with itself every time
    assert not report.paid() and "[FLAKY] coin" in report.format()


class Lenient(ToolEnv):
    """Pays when the answer appears anywhere in the reply (a think block included)."""

    def reward(self, task, messages):
        return float(str(task.answer) in messages[-1].content)

    @classmethod
    def load_tasks(cls, split="train", seed=0, **kwargs):
        return [Task(id=f"{split}-1", prompt="What is 7 * 6?", answer="42")]


def test_check_env_reports_the_paying_hack_with_its_input(capsys):
    assert main(["check-env", "tests.test_reward_audit:Lenient"]) == 1
    err = capsys.readouterr().err
    assert "[PAID 1] answer in a think block" in err and "'<think>42</think>I am not sure.'" in err
    assert main(["check-env", "tests.test_reward_audit:Lenient", "--no-audit"]) == 0


def test_train_refuses_a_verifier_that_pays_unless_told(tmp_path):
    make = Lenient
    tasks = Lenient.load_tasks()
    with pytest.raises(RewardHackError, match="(?s)answer in a think block.*reward_hacks=warn"):
        asyncio.run(audit_at_start(make, tasks, AuditConfig()))
    warned = asyncio.run(audit_at_start(make, tasks, AuditConfig(reward_hacks="warn")))
    assert "PAID" in warned
    assert "skip" in asyncio.run(audit_at_start(make, tasks, AuditConfig(reward_hacks="skip")))


def test_train_stops_before_any_step_on_a_paying_verifier(tmp_path, tiny_model_dir):
    out = tmp_path / "run"
    with pytest.raises(RewardHackError):
        main(
            [
                "train",
                "examples/calculator.yaml",
                f"output_dir={out}",
                "train.steps=1",
                f"model.path={tiny_model_dir}",
                "env.name=tests.test_reward_audit:Lenient",
                "env.tasks={}",
                "log.progress=false",
            ]
        )
    assert not (out / "metrics.jsonl").exists()


def _group(rewards_parts: list[dict[str, float]], info: dict | None = None) -> Group:
    task = Arithmetic.load_tasks()[0]
    trajs, scores = [], {}
    for i, parts in enumerate(rewards_parts):
        t = Trajectory(
            task_id=task.id,
            token_ids=[],
            loss_mask=[],
            logprobs=[],
            prompt_len=0,
            messages=[Message(role="assistant", content="42")],
            stop_reason=StopReason.COMPLETED,
            env_info=dict(info or {}),
            id=f"{task.id}/{i}",
        )
        trajs.append(t)
        scores[t.id] = Score(t.id, parts.get("exact", 0.0), parts=dict(parts))
    return Group(group_id=task.id, task=task, trajectories=trajs, scores=scores)


def _rewards(groups: list[Group]) -> list[float]:
    return [r for g in groups for r in g.rewards]


def test_a_flaky_verdict_makes_its_group_unscorable():
    steady = Rubric([("exact", Arithmetic.exact, 1.0)])
    flaky = Rubric([("exact", Arithmetic.exact, 1.0), ("coin", lambda t, k: random.random(), 0.0)])
    groups = [_group([{"exact": 1.0}] * 4) for _ in range(2)]
    groups, n = asyncio.run(recheck_groups(groups, steady, 1, random.Random(0)))
    assert n == 0 and _rewards(groups) == [1.0] * 8
    groups = [_group([{"exact": 1.0, "coin": 2.0}] * 4) for _ in range(2)]
    groups, n = asyncio.run(recheck_groups(groups, flaky, 1, random.Random(0)))
    assert n == 2 and all(math.isnan(r) for r in _rewards(groups))
    first = groups[0].score(groups[0].trajectories[0])
    assert "flaky verdict: verifier 'coin'" in first.detail
    reported = [_group([{"exact": 1.0}] * 2, {"flaky_verdict": True}), _group([{"exact": 1.0}] * 2)]
    reported, n = asyncio.run(recheck_groups(reported, None, 0, random.Random(0)))
    assert n == 1 and math.isnan(reported[0].rewards[1]) and reported[1].rewards[0] == 1
