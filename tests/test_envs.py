"""The bundled environments: the Env contract, rewards and stop reasons of whole episodes (a scripted
engine on the real SmolLM2 tokenizer, the real sandbox), sandbox failures as NaN."""

from __future__ import annotations

import asyncio
import doctest
import importlib
import json
import math

import pytest

from agentgrpo import StopReason, Task, check_env
from agentgrpo.engine import SamplingParams
from agentgrpo.env import ENVS, get_env_class
from agentgrpo.rollout import run_episode
from agentgrpo.verify.math import math_equal
from agentgrpo.verify.sandbox import ExecResult
from envs.python_math import PythonMathEnv, final_answer
from tests.fakes import ScriptedEngine

NAMES = ["calculator", "python_math"]


class BrokenSandbox:
    """A sandbox whose infrastructure fails on every job (what the real one returns after its
    retries when its supervisor keeps dying or a remote server is unreachable)."""

    def __init__(self) -> None:
        self.jobs = 0

    def _result(self) -> ExecResult:
        self.jobs += 1
        return ExecResult("sandbox_error", None, None, "", "", False, 0.0, "broken",
                          "supervisor died 3 times")

    def run(self, code, **kwargs) -> ExecResult:
        return self._result()

    async def arun(self, code, **kwargs) -> ExecResult:
        return self._result()


def episode(chat, env, task, script, *, max_turns=4, max_tokens=1024, max_new_tokens=400):
    engine = ScriptedEngine(chat.tokenizer, script, chat.end_of_turn_id)
    traj = asyncio.run(run_episode(env, engine, chat, task, SamplingParams(max_new_tokens=max_new_tokens),
                                   seed=0, max_turns=max_turns, max_tokens=max_tokens))
    traj.check()
    return traj, engine


def call(name: str, **arguments) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


# ---- all envs ---------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_registered_env_passes_check_env_and_loads_both_splits(name):
    cls = get_env_class(name)
    assert ENVS[name] is cls
    check_env(cls())
    train, held_out = cls.load_tasks("train", seed=0), cls.load_tasks("eval", seed=0)
    assert train and held_out and {t.id for t in train}.isdisjoint({t.id for t in held_out})
    assert "Example:" in (cls.__doc__ or "")


@pytest.mark.parametrize("module", ["envs.python_math"])
def test_docstring_examples_run(module):
    result = doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 5 and result.failed == 0


# ---- python_math --------------------------------------------------------------------------------


def test_final_answer_extraction():
    assert final_answer("so \\boxed{\\frac{1}{2}} it is") == "\\frac{1}{2}"
    assert math_equal(final_answer("so \\boxed{\\frac{1}{2}}"), "0.5")
    assert final_answer("first \\boxed{3} then \\boxed{7}") == "7"
    assert final_answer("We had 12 eggs, so 1,234.5 in all.") == "1234.5"
    assert final_answer("-3 and then 3/4") == "3/4"
    assert final_answer("\\boxed{12") == "12"  # an unclosed box falls back to the last number
    assert final_answer("no idea") is None


def test_python_math_tasks_are_deterministic_and_splits_disjoint():
    kw = {"dataset": "chain_sum", "min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    train = PythonMathEnv.load_tasks("train", seed=3, n=300, **kw)
    held_out = PythonMathEnv.load_tasks("eval", seed=3, n=30, **kw)
    assert len(train) == 300 and len(held_out) == 30
    assert train == PythonMathEnv.load_tasks("train", seed=3, n=300, **kw)
    # one-digit sums repeat, yet no question is in both splits
    assert {t.prompt for t in train}.isdisjoint({t.prompt for t in held_out})
    gsm = PythonMathEnv.load_tasks("train", seed=0, n=3)
    assert gsm[0].metadata["dataset"] == "gsm_symbolic" and gsm[0].answer.lstrip("-").isdigit()
    with pytest.raises(TypeError, match="chain_sum"):
        PythonMathEnv.load_tasks("train", n=2, dataset="chain_sum", max_termz=3)
    with pytest.raises(ValueError, match="split"):
        PythonMathEnv.load_tasks("test")


@pytest.fixture(scope="module")
def math_task() -> Task:
    return PythonMathEnv.load_tasks("train", seed=0, n=1)[0]  # carpenter problem -> 28080


def test_python_math_solved_with_the_tool(chat, math_task):
    code = "print(2 * 6 * 12 * 195)"
    traj, engine = episode(chat, PythonMathEnv(), math_task,
                           [call("python", code=code), "He earns \\boxed{28080}."])
    assert math_task.answer == "28080"
    assert (traj.stop_reason, traj.reward, traj.tool_calls, traj.tool_errors) == (StopReason.COMPLETED, 1.0, 1, 0)
    tool_msg = traj.messages[3]
    assert tool_msg.role == "tool" and "status: ok" in tool_msg.content and "28080" in tool_msg.content
    assert tool_msg.content in chat.decode(engine.calls[1][-60:])  # the model saw the output


def test_python_math_wrong_missing_and_malformed_answers_score_zero(chat, math_task):
    wrong, _ = episode(chat, PythonMathEnv(), math_task, ["\\boxed{28081}"])
    assert (wrong.stop_reason, wrong.reward) == (StopReason.COMPLETED, 0.0)
    missing, _ = episode(chat, PythonMathEnv(), math_task, ["I cannot tell."])
    assert (missing.stop_reason, missing.reward) == (StopReason.COMPLETED, 0.0)
    bad_call = '<tool_call>{"name": "python", "arguments": {"code": </tool_call>'
    malformed, _ = episode(chat, PythonMathEnv(), math_task, [bad_call, "28080"])
    assert (malformed.stop_reason, malformed.reward, malformed.tool_errors) == (StopReason.COMPLETED, 1.0, 1)


def test_python_math_model_code_errors_are_tool_output_not_env_errors(chat, math_task):
    traj, _ = episode(chat, PythonMathEnv(), math_task, [call("python", code="print(1/0)"), "28080"])
    assert traj.stop_reason == StopReason.COMPLETED and traj.reward == 1.0
    assert "runtime_error" in traj.messages[3].content and "ZeroDivisionError" in traj.messages[3].content


def test_python_math_sandbox_failure_is_unscorable(chat, math_task):
    sandbox = BrokenSandbox()
    traj, engine = episode(chat, PythonMathEnv(sandbox=sandbox), math_task,
                           [call("python", code="print(1)"), "\\boxed{28080}"])
    assert traj.stop_reason == StopReason.ENV_ERROR and math.isnan(traj.reward)
    assert "SandboxUnavailable" in traj.stop_detail and sandbox.jobs == 1
    assert len(engine.calls) == 1  # the failure was never shown to the model as its tool error
