"""The bundled envs' tools and answer readers on hostile or unlucky inputs, without a model: a
hostile answer scores 0 quickly, a late sandbox failure of an abandoned call poisons no later step,
the calculator refuses what it cannot compute exactly, the python tool's message keeps its bound,
and every toy-text variant shows where the agent is."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import Future
from fractions import Fraction

import pytest

from agentgrpo import Message, Task, ToolCall
from agentgrpo.env.tool import ToolError
from agentgrpo.types import ToolErrorKind
from agentgrpo.verify.sandbox import ExecResult, SandboxUnavailable
from envs.code_tests import CodeTestsEnv
from envs.gym_text import GymTextEnv
from envs.python_math import PythonMathEnv, final_answer
from tools.calculator import MAX_DIGITS, calculator, evaluate
from tools.python import format_result

# ---- python_math: answers in scientific notation ----------------------------------------------


def test_final_answer_writes_out_only_small_exponents():
    assert final_answer("so it is 1.5e3") == "1500"
    assert final_answer("\\boxed{2.5E-3}") == "0.0025"
    assert final_answer("about 1e100") == "1" + "0" * 100
    for text, kept in [
        ("the answer is 1e999999999999", "1e999999999999"),
        ("the answer is 1e100000000", "1e100000000"),
        ("\\boxed{1e-100000000}", "1e-100000000"),
        ("it is 1e101", "1e101"),
    ]:
        start = time.monotonic()
        assert final_answer(text) == kept
        assert time.monotonic() - start < 1.0


def test_python_math_huge_exponent_answer_scores_zero():
    env = PythonMathEnv()
    task = Task(id="t", prompt="What is 2+2?", answer="4")
    for text in ["The answer is 1e999999999999", "The answer is \\boxed{1e-100000000}"]:
        env.reset(seed=0, options={"task": task})
        _, reward, terminated, _, _ = asyncio.run(env.step(Message(role="assistant", content=text)))
        assert (reward, terminated) == (0.0, True)


# ---- a late sandbox failure of an abandoned call -----------------------------------------------


def _result(status: str, stdout: str = "", detail: str = "") -> ExecResult:
    return ExecResult(
        status, 0 if status == "ok" else None, None, stdout, "", False, 0.1, "fake", detail
    )


class HangingSandbox:
    """Jobs that hold `HANG` report sandbox_error after `hang_s`; other jobs succeed after
    `ok_s`."""

    def __init__(self, hang_s: float = 0.6, ok_s: float = 0.8) -> None:
        self.hang_s, self.ok_s = hang_s, ok_s
        self.failed = threading.Event()

    def run(self, code, files=None, **kwargs) -> ExecResult:
        if "HANG" in code + "".join((files or {}).values()):
            time.sleep(self.hang_s)
            self.failed.set()
            return _result("sandbox_error", detail="backend hung")
        time.sleep(self.ok_s)
        return _result("ok", "4\n")

    async def arun(self, code, files=None, **kwargs) -> ExecResult:
        # Like a remote sandbox: a cancelled await leaves the job running, and its result (a
        # late sandbox_error for HANG) arrives with nobody waiting for it.
        done: Future = Future()
        done.set_running_or_notify_cancel()  # running: a cancelled await leaves it be
        threading.Thread(
            target=lambda: done.set_result(self.run(code, files, **kwargs)), daemon=True
        ).start()
        return await asyncio.wrap_future(done)


def _call(i: str, name: str, code: str) -> Message:
    return Message(
        role="assistant",
        content="",
        tool_calls=[ToolCall(id=i, name=name, arguments={"code": code})],
    )


def test_python_math_late_sandbox_failure_does_not_poison_the_next_step():
    sandbox = HangingSandbox()
    env = PythonMathEnv(sandbox=sandbox)
    env.reset(seed=0, options={"task": Task(id="t", prompt="2+2?", answer="4")})
    env.set_tool_limits(timeout_s=0.2)
    step = asyncio.run(env.step(_call("1", "python", "HANG")))
    assert (
        step.tool_errors == {ToolErrorKind.TOOL_TIMEOUT: 1}
        and "did not finish" in step.messages[0].content
    )
    env.set_tool_limits(timeout_s=10.0)  # the abandoned call fails while this healthy step runs
    step = asyncio.run(env.step(_call("2", "python", "print(2+2)")))
    assert sandbox.failed.is_set()
    assert not step.terminated and not step.tool_errors and "stdout:\n4" in step.messages[0].content


def test_python_math_sandbox_failure_in_its_own_step_is_unscorable():
    env = PythonMathEnv(sandbox=HangingSandbox(hang_s=0.0))
    env.reset(seed=0, options={"task": Task(id="t", prompt="2+2?", answer="4")})
    with pytest.raises(SandboxUnavailable, match="backend hung"):
        asyncio.run(env.step(_call("1", "python", "HANG")))


@pytest.fixture(scope="module")
def code_task() -> Task:
    return CodeTestsEnv.load_tasks("eval", n=1)[0]


def test_code_tests_late_sandbox_failure_does_not_poison_the_next_step(code_task):
    sandbox = HangingSandbox()
    env = CodeTestsEnv(sandbox=sandbox)
    env.reset(seed=0, options={"task": code_task})
    env.set_tool_limits(timeout_s=0.2)
    step = asyncio.run(env.step(_call("1", "run_tests", "# HANG")))
    assert step.tool_errors == {ToolErrorKind.TOOL_TIMEOUT: 1}
    env.set_tool_limits(timeout_s=10.0)  # the abandoned call fails while this healthy step runs
    step = asyncio.run(env.step(_call("2", "run_tests", "def f(): pass")))
    assert sandbox.failed.is_set() and not step.terminated and not step.tool_errors


def test_code_tests_sandbox_failure_in_its_own_step_is_unscorable(code_task):
    env = CodeTestsEnv(sandbox=HangingSandbox(hang_s=0.0))
    env.reset(seed=0, options={"task": code_task})
    with pytest.raises(SandboxUnavailable, match="backend hung"):
        asyncio.run(env.step(_call("1", "run_tests", "# HANG")))


class RunOnlySandbox:
    """A stand-in written against the sync API alone: the envs' rewards await `arun`."""

    def run(self, code, **kwargs) -> ExecResult:
        return _result("ok", "4\n")


def test_a_sandbox_without_the_methods_an_env_calls_is_refused_when_the_env_is_built():
    for build in (
        lambda: PythonMathEnv(sandbox=RunOnlySandbox()),
        lambda: CodeTestsEnv(sandbox=RunOnlySandbox()),
    ):
        with pytest.raises(TypeError, match="RunOnlySandbox has no arun method"):
            build()
    PythonMathEnv(sandbox=HangingSandbox())  # both methods: accepted
    CodeTestsEnv(sandbox=HangingSandbox())


# ---- calculator -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "expression, reason",
    [
        ("0**-1", "division by zero"),
        ("0^-1", "division by zero"),
        ("(1-1)**-2", "division by zero"),
        ("1e999", "digits"),
        ("1e-400", "digits"),
        ("9" * 61, "digits"),
        ("1" + "0" * 60 + ".5", "digits"),
    ],
)
def test_calculator_refuses_with_its_own_error(expression, reason):
    with pytest.raises(ToolError, match=reason):
        evaluate(expression)
    with pytest.raises(ToolError, match=reason) as err:
        asyncio.run(calculator.acall({"expression": expression}))
    assert "raised" not in str(err.value)  # the calculator's own message, not a wrapped crash


def test_calculator_constants_are_exact():
    assert evaluate("0.1+0.2") == Fraction(3, 10)
    assert evaluate("1e-5") == Fraction(1, 100000)
    assert evaluate("1_000") == 1000 and evaluate("0x10") == 16
    assert evaluate("9" * MAX_DIGITS) == int("9" * MAX_DIGITS)
    assert evaluate("2.5e3") == 2500 and evaluate("0**2") == 0


# ---- the python tool's message ----------------------------------------------------------------


@pytest.mark.parametrize("max_chars", [200, 300, 4000])
@pytest.mark.parametrize(
    "stdout, stderr",
    [
        ("a" * 100_000, "b" * 100_000),
        ("a" * 100_000, ""),
        ("x\n" * 50_000, "y" * 10),
        ("", "e" * 100_000),
    ],
)
def test_python_tool_message_never_exceeds_its_bound(max_chars, stdout, stderr):
    for truncated in (False, True):
        res = ExecResult("output_limit", None, 9, stdout, stderr, truncated, 1.0, "fake")
        msg = format_result(res, max_chars)
        assert len(msg) <= max_chars, len(msg)
        assert len(msg) >= max_chars - 60  # the budget is used, not left empty
        if stderr:
            assert stderr[-5:] in msg


def test_python_tool_message_gives_a_short_stream_only_what_it_needs():
    res = ExecResult("ok", 0, None, "x" * 100_000, "warning\n", False, 1.0, "fake")
    msg = format_result(res, 4000)
    assert len(msg) <= 4000 and msg.rstrip().endswith("stderr:\nwarning")
    assert msg.count("x") > 3500  # stdout gets what stderr leaves, not half
    small = ExecResult("ok", 0, None, "hello", "", False, 1.0, "fake")
    assert format_result(small, 4000) == "status: ok (exit 0, 1.00 s)\nstdout:\nhello\n"


def test_python_tool_message_bounds_a_long_status_line():
    res = ExecResult("weird", None, None, "out", "", False, 1.0, "fake", "d" * 5000)
    assert len(format_result(res, 200)) <= 200


# ---- gym_text: where the agent stands ---------------------------------------------------------


def _lake_texts(env: GymTextEnv, env_id: str) -> list[str]:
    task = GymTextEnv.load_tasks("train", n=1, env_id=env_id, make_kwargs={"is_slippery": False})[0]
    msgs, _ = env.reset(seed=0, options={"task": task})
    texts = [msgs[1].content]
    for move in ("DOWN", "RIGHT") if env.view.action_words[0] == "LEFT" else ("1", "1"):  # DOWN
        texts.append(env.step(Message(role="assistant", content=move))[0][0].content)
    return texts


def test_gym_text_frozen_lake_8x8_uses_the_lake_renderer():
    env = GymTextEnv()
    start, _, after = _lake_texts(env, "FrozenLake8x8-v1")
    assert env.view.action_words == ("LEFT", "DOWN", "RIGHT", "UP")
    assert start.startswith("X F F") and "row 1, column 1" in start and "row 2, column 2" in after
    assert "X marks where you stand" in env.view.rules(env.game)


class GenericGym(GymTextEnv):
    def text_spec(self, game):
        return None  # the generic (ansi) renderer even for a known env


@pytest.mark.parametrize("env_id", ["FrozenLake-v1", "FrozenLake8x8-v1"])
def test_gym_text_generic_ansi_render_marks_the_highlighted_cell(env_id):
    start, _, after = _lake_texts(GenericGym(), env_id)
    assert "\x1b" not in start + after
    assert "[S]" in start and "[S]" not in after and "[F]" in after
    assert [ln for ln in start.splitlines() if "F" in ln] != [
        ln for ln in after.splitlines() if "F" in ln
    ]
