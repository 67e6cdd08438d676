import asyncio
import time

import pytest

from agentgrpo import Env, Message, Task, ToolCall, ToolEnv, check_env, tool
from agentgrpo.env.base import EnvCheckError, MessagesSpace, String, get_env_class, register_env
from agentgrpo.types import ToolErrorKind
from envs.calculator import CalculatorEnv, last_number

TASK = Task(id="t", prompt="Say 7", answer=7)


class Echo(Env):
    def step(self, action):
        return [], float(action.content.strip() == str(self.task.answer)), True, False, {}


class AsyncEcho(Env):
    async def step(self, action):
        await asyncio.sleep(0)
        return [], 1.0, True, False, {}


class Slow(ToolEnv):
    tool_timeout_s = 0.2
    max_tool_calls_per_turn = 2

    @tool
    def nap(self, seconds: float) -> str:
        """Sleep, then say done."""
        time.sleep(seconds)
        return "done"

    @tool
    def fail(self) -> str:
        """Always raises."""
        raise RuntimeError("disk on fire")

    def reward(self, task, messages):
        return 1.0


def test_plain_sync_and_async_envs_pass_check_env():
    check_env(Echo(), TASK)
    check_env(AsyncEcho(), TASK)
    check_env(CalculatorEnv())


def test_reset_without_task_is_a_clear_error():
    with pytest.raises(ValueError, match=r"needs a task: reset\(options="):
        Echo().reset()


def test_check_env_reports_contract_breaks():
    class Bad(Env):
        def step(self, action):
            return "oops", 1, "yes", False, {}

    with pytest.raises(EnvCheckError) as e:
        check_env(Bad(), TASK)
    msg = str(e.value)
    assert "list of Message" in msg and "terminated and truncated must be bools" in msg


def test_tool_env_errors_are_messages_not_crashes():
    env = Slow()
    env.reset(seed=0, options={"task": TASK})
    calls = [
        ToolCall(id="1", name="nap", arguments={"seconds": 1.0}),
        ToolCall(id="2", name="fail", arguments={}),
        ToolCall(id="3", name="nap", arguments={"seconds": 0}),
    ]
    step = asyncio.run(env.step(Message(role="assistant", content="", tool_calls=calls)))
    out, reward, terminated, truncated, info = step  # Gymnasium's 5-tuple
    assert [m.tool_call_id for m in out] == ["1", "2", "3"]
    assert "did not finish within 0.2 s" in out[0].content
    assert "fail raised RuntimeError: disk on fire" in out[1].content
    assert "too many tool calls" in out[2].content
    assert sum(step.tool_errors.values()) == 3 and not terminated and reward == 0.0 and info == {}


def test_tool_calls_in_one_turn_run_concurrently():
    class Par(Slow):
        tool_timeout_s = 5.0
        max_tool_calls_per_turn = 8

    env = Par()
    env.reset(options={"task": TASK})
    calls = [ToolCall(id=str(i), name="nap", arguments={"seconds": 0.3}) for i in range(4)]
    t0 = time.monotonic()
    out, *_ = asyncio.run(env.step(Message(role="assistant", content="", tool_calls=calls)))
    assert [m.content for m in out] == ["done"] * 4
    assert time.monotonic() - t0 < 1.0  # 4 x 0.3 s sequentially would be 1.2 s


def test_spaces_accept_unicode_and_nest():
    import gymnasium

    s = String()
    assert s.contains("ünïcødé ✓") and not s.contains(3)
    nested = gymnasium.spaces.Dict({"text": String(), "history": MessagesSpace()})
    assert nested.contains({"text": "é", "history": [Message(role="user", content="x")]})


def test_envs_registered_at_run_time_and_installs_that_predate_the_entry_points(monkeypatch):
    import importlib.metadata

    from agentgrpo.env import base as env_module

    monkeypatch.setattr(env_module, "ENVS", {})
    register_env("echo-at-run-time", Echo)
    assert get_env_class("echo-at-run-time") is Echo
    with pytest.raises(TypeError, match="not an Env subclass"):
        register_env("int", int)

    class Old:  # agentgrpo installed before pyproject.toml declared the group
        version = "0.1.0"
        entry_points = importlib.metadata.EntryPoints(())

    no_entry_points = importlib.metadata.EntryPoints(())
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **k: no_entry_points)
    monkeypatch.setattr(importlib.metadata, "distribution", lambda name: Old())
    with pytest.raises(
        ValueError,
        match=r"known: \['echo-at-run-time'\].*predates them\): "
        r"reinstall with pip install -e \.",
    ):
        get_env_class("calculator")

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
    with pytest.raises(ValueError, match="agentgrpo is not installed.*pip install -e ."):
        get_env_class("calculator")


def test_registry_and_calculator_tasks():
    assert get_env_class("calculator") is CalculatorEnv
    assert get_env_class("tests.test_env:Echo") is Echo
    known = r"unknown environment 'nope'; known: \[.*'calculator'.*'gym_text'"
    with pytest.raises(ValueError, match=known):
        get_env_class("nope")
    a = CalculatorEnv.load_tasks("train", seed=1, n=5)
    assert a == CalculatorEnv.load_tasks("train", seed=1, n=5)
    assert [t.prompt for t in a] != [
        t.prompt for t in CalculatorEnv.load_tasks("eval", seed=1, n=5)
    ]
    for t in a:
        x, _, y = t.metadata["expression"].split()
        assert int(t.answer) == int(x) + int(y)
    assert last_number("so 1,234 then 56.") == 56 and last_number("none") is None


def test_tool_errors_are_counted_by_kind():
    env = Slow()
    env.reset(seed=0, options={"task": TASK})
    calls = [
        ToolCall(id="1", name="nap", arguments={"seconds": 0.4}),
        ToolCall(id="2", name="nap", arguments={"minutes": 1}),
        ToolCall(id="3", name="nope", arguments={}),
    ]
    env.set_tool_limits(max_calls_per_turn=3)
    step = asyncio.run(
        env.step(Message(role="assistant", content="", tool_calls=calls + calls[:1]))
    )
    assert step.tool_errors == {
        ToolErrorKind.TOOL_TIMEOUT: 1,
        ToolErrorKind.INVALID_ARGUMENTS: 1,
        ToolErrorKind.UNKNOWN_TOOL: 1,
        ToolErrorKind.TOO_MANY_CALLS: 1,
    }
    assert sum(step.tool_errors.values()) == 4


def test_check_env_flags_undeclared_randomness():
    import random

    class Dice(Env):
        def reset(self, *, seed=None, options=None):
            super().reset(seed=seed, options=options)
            return [
                Message(role="user", content=f"Roll: {random.random()}")
            ], {}  # not from the seed

        def step(self, action):
            return [], 0.0, True, False, {}

    with pytest.raises(EnvCheckError, match="two resets with seed=0 gave different messages"):
        check_env(Dice(), TASK)

    class DeclaredDice(Dice):
        stochastic = True

    check_env(DeclaredDice(), TASK)


def test_check_env_explains_instead_of_crashing():
    from agentgrpo.checks.env_check import env_report

    class Crashing(Env):
        def step(self, action):
            raise ZeroDivisionError("division by zero")

    report = env_report(Crashing(), TASK)
    assert not report.ok
    assert (
        "raised ZeroDivisionError: division by zero" in report.format()
        and "ENV_ERROR" in report.format()
    )

    class Forgetful(ToolEnv):  # answers tool calls without saying which call
        @tool
        def ping(self) -> str:
            """Reply pong."""
            return "pong"

        async def step(self, action):
            out, *rest = await super().step(action)
            return [m.model_copy(update={"tool_call_id": None}) for m in out], *rest

        def reward(self, task, messages):
            return 0.0

    text = env_report(Forgetful(), TASK).format()
    assert "[FAIL] tool ping()" in text and "tool_call_id='call_ping'" in text
    ok = env_report(Slow(), TASK).format()
    assert "[ok] tool nap(seconds=1)" in ok and "[ok] call with invalid arguments" in ok


def test_check_env_command(capsys):
    from agentgrpo.cli import main

    assert main(["check-env", "calculator"]) == 0
    assert "[ok] tool calculator(expression='1')" in capsys.readouterr().out
    assert main(["check-env", "tests.test_env:Echo"]) == 1  # no load_tasks: no task to run
    assert "no task given and Echo.load_tasks is not implemented" in capsys.readouterr().err
    assert main(["check-env", "no_such_module:Env"]) == 1
    assert (
        "cannot create the env: ConfigError: env.name: env 'no_such_module:Env': no module named"
        in capsys.readouterr().err
    )
