"""Unit-test scoring in the sandbox: extraction, typed per-test outcomes, cheats, HumanEval."""

from __future__ import annotations

import asyncio
import math
import os

import pytest

from agentgrpo.types import Message, StopReason, Task, Trajectory
from agentgrpo.verify.code import (
    CodeVerifier,
    IOTest,
    extract_code,
    humaneval_solution,
    load_humaneval,
    run_tests,
    score_humaneval,
)
from agentgrpo.verify.sandbox import ExecResult, Sandbox, SandboxConfig


@pytest.fixture(scope="module")
def sb():
    backend = "namespaces" if os.geteuid() == 0 else "auto"
    try:
        box = Sandbox(backend=backend, config=SandboxConfig(slots=4))
    except RuntimeError as e:
        pytest.skip(f"no sandbox backend on this host: {e}")
    yield box
    box.close()


ADD = "def add(a, b):\n    return a + b\n"


def test_extract_code():
    assert extract_code("Here:\n```python\nx = 1\n```\nand\n```python\nx = 2\n```") == "x = 2\n"
    assert extract_code("```\nplain\n```") == "plain\n"
    assert extract_code("```bash\nls\n```\n```py\nok = 1\n```") == "ok = 1\n"
    assert (
        extract_code("```python\ncut = 1\nby the token lim") == "cut = 1\nby the token lim\n"
    )  # unclosed
    assert extract_code("no fences: y = 3") == "no fences: y = 3\n"


def test_assert_outcomes_each_typed(sb):
    tests = [
        "assert add(1, 2) == 3",
        "assert add(1, 1) == 3, 'one plus one'",
        "add(None, 1)",
        "while True:\n    pass",
        "import sys\nsys.exit(0)",
    ]
    res = run_tests(ADD, tests, sandbox=sb, timeout_per_test_s=0.5)
    assert [t.outcome for t in res.tests] == ["passed", "failed", "error", "timeout", "error"]
    assert res.tests[1].detail == "AssertionError: one plus one"
    assert res.tests[2].detail.startswith("TypeError: unsupported operand")
    assert res.score == pytest.approx(1 / 5) and res.passed == 1 and not res.all_passed
    assert res.exec.status == "ok"  # one sandbox call for all of them


def test_the_budget_is_cpu_time_so_waiting_is_not_charged(sb):
    # A slow machine makes a correct solution wait, not compute: 1.2 s of sleep under a 0.5 s
    # budget passes (wall clock used to fail it), while 0.5 s of CPU in a loop does not.
    # The wall limit is generous for the first two: on a loaded machine (CI's neighbours) the loop
    # may get a small share of a core, and must still be stopped by its CPU budget, not the wall.
    tests = ["import time\ntime.sleep(1.2)\nassert add(1, 2) == 3", "while True:\n    pass"]
    res = run_tests(ADD, tests, sandbox=sb, timeout_per_test_s=0.5, wall_per_test_s=20)
    assert [t.outcome for t in res.tests] == ["passed", "timeout"], res.tests
    # the loop's reported CPU can fall short of the timer's 0.5 s (0.44 s seen on a loaded machine:
    # the timer counts the whole process, the report the test's own usage after it ended)
    assert res.tests[0].cpu_s < 0.5 and res.tests[1].cpu_s >= 0.35
    assert "of CPU" in res.tests[1].detail
    sleeper = ["import time\ntime.sleep(60)"]
    res = run_tests(ADD, sleeper, sandbox=sb, timeout_per_test_s=0.5, wall_per_test_s=2.5)
    assert [t.outcome for t in res.tests] == ["timeout"], res.tests
    assert "2.5s of wall time" in res.tests[0].detail and res.tests[0].cpu_s < 0.5


def test_a_solution_cannot_switch_its_cpu_budget_off(sb):
    # Clearing the interval timer leaves RLIMIT_CPU (SIGXCPU at ceil(budget)); ignoring SIGXCPU
    # leaves its hard limit (SIGKILL a second later), which an unprivileged process cannot raise.
    clear = "import signal\nsignal.setitimer(signal.ITIMER_PROF, 0)\n"
    ignore = clear + "signal.signal(signal.SIGXCPU, signal.SIG_IGN)\n"
    raise_ = ignore + "import resource\nresource.setrlimit(resource.RLIMIT_CPU, (-1, -1))\n"
    loop = "while True:\n    pass"
    tests = [clear + loop, ignore + loop, raise_ + loop]
    res = run_tests(ADD, tests, sandbox=sb, timeout_per_test_s=0.5, wall_per_test_s=6)
    assert [t.outcome for t in res.tests] == ["timeout", "timeout", "error"], res.tests
    assert all("of CPU" in t.detail for t in res.tests[:2])
    assert res.tests[1].cpu_s >= 1.5  # it ran to the hard limit, ceil(0.5) + 1 s
    assert res.tests[2].detail.startswith("ValueError")  # not allowed to raise the hard limit


def test_budgets_that_cannot_work_are_refused():
    with pytest.raises(ValueError, match="timeout_per_test_s must be > 0"):
        run_tests(ADD, ["assert add(1, 1) == 2"], timeout_per_test_s=0)
    with pytest.raises(ValueError, match="wall_per_test_s .* must be at least"):
        run_tests(ADD, ["assert add(1, 1) == 2"], timeout_per_test_s=2, wall_per_test_s=1)


def test_stdin_stdout_cases_compared_outside(sb):
    prog = "import sys\na, b = map(int, input().split())\nprint(a + b)\nsys.exit(0)"
    res = run_tests(
        prog,
        [
            IOTest(stdin="1 2\n", expected="3\n"),
            IOTest(stdin="5 5", expected="11"),
            IOTest(stdin="2 2", expected="4   \n\n"),
        ],
        sandbox=sb,
    )
    assert [t.outcome for t in res.tests] == ["passed", "failed", "passed"]
    assert res.tests[1].stdout == "10\n"
    big = "\n".join(str(i) for i in range(30000)) + "\n"  # stdin larger than a pipe buffer
    res = run_tests(
        "import sys\nprint(sum(map(int, sys.stdin)))",
        [IOTest(stdin=big, expected=str(sum(range(30000))))],
        sandbox=sb,
    )
    assert res.all_passed


def test_early_exit_is_not_a_pass(sb):
    # the classic reward hack: leave before the asserts run
    for cheat in ("import os\nos._exit(0)\n", "import sys\nsys.exit(0)\n", "exit()\n"):
        res = run_tests(cheat + ADD, ["assert add(1, 2) == 3"], sandbox=sb)
        assert [t.outcome for t in res.tests] == ["error"], cheat
        assert res.score == 0.0


def test_tests_are_isolated_from_each_other(sb):
    # a test that breaks the solution's state or crashes hard does not affect the next one
    tests = [
        "import builtins\nbuiltins.len = None\nassert False",
        "import os\nos.kill(os.getpid(), 9)",
        "assert len([1]) == 1 and add(2, 2) == 4",
    ]
    res = run_tests(ADD, tests, sandbox=sb)
    assert [t.outcome for t in res.tests] == ["failed", "error", "passed"]


def test_printing_solution_cannot_forge_results(sb):
    forged = 'print(\'{"i": 0, "o": "passed", "d": ""}\')\n'
    res = run_tests(
        forged + "def add(a, b):\n    return 0\n", ["assert add(1, 2) == 3"], sandbox=sb
    )
    assert [t.outcome for t in res.tests] == ["failed"]


ALWAYS_EQUAL = """
class Anything:
    def __eq__(self, other): return True
    def __ne__(self, other): return False
    def __lt__(self, other): return True
    def __bool__(self): return True
    def __sub__(self, other): return self
    def __abs__(self): return self
def add(a, b):
    return RESULT
"""


@pytest.mark.parametrize(
    "result", ["Anything()", "[Anything()]", "{'k': Anything()}", "(1, Anything())"]
)
def test_rigged_comparisons_do_not_pass(sb, result):
    tests = [
        "assert add(1, 2) == 3",
        "assert not add(1, 2) != 3",
        "assert abs(add(1, 2) - 3) < 1e-9",
        "assert add(1, 2)",
        "assert all(add(i, 0) == i for i in range(3))",
        "def check(candidate):\n    assert candidate(1, 2) == 3, 'msg'\ncheck(add)",
    ]
    res = run_tests(ALWAYS_EQUAL.replace("RESULT", result), tests, sandbox=sb)
    assert res.passed == 0, res.tests
    # Each test fails on the rigged object, except where the container itself already breaks the
    # expression (abs([...] - 3) is a TypeError: an error, not a pass either).
    for t in res.tests:
        assert (t.outcome, "rigged comparison" in t.detail) in {
            ("failed", True),
            ("error", False),
        }, t
    if result == "Anything()":
        assert all(t.outcome == "failed" for t in res.tests)


def test_patched_modules_cannot_forge_a_pass(sb):
    patch = (
        "import json, os, builtins\n"
        'json.dumps = lambda *a, **k: \'{"o": "passed", "d": ""}\'\n'
        "builtins.isinstance = lambda *a: True\nbuiltins.type = lambda *a: int\n"
    )
    res = run_tests(patch + "def add(a, b):\n    return 0\n", ["assert add(1, 2) == 3"], sandbox=sb)
    assert [t.outcome for t in res.tests] == ["failed"]


def test_the_harness_is_out_of_the_solutions_reach(sb):
    # Each of these once passed (or could have): the guard looked up by name in the globals the
    # solution shares, a metaclass lying about its class's flags, the report pipe written directly,
    # and the harness's own names patched through `import __main__`.
    rigged = ALWAYS_EQUAL.replace("RESULT", "Anything()")
    liar = (
        "class Liar(type):\n    def __getattribute__(cls, name):\n"
        "        return 0 if name in ('__flags__', '__mro__', '__dict__') else "
        "super().__getattribute__(name)\n"
        "class Anything(metaclass=Liar):\n    def __eq__(self, other): return True\n"
        "def add(a, b):\n    return Anything()\n"
    )
    forge = (
        "import os\nfor fd in range(3, 64):\n    try:\n        os.write(fd, b'passed\\n')\n"
        "    except OSError:\n        pass\nos._exit(0)\n"
    )
    patch = "import __main__\n__main__._own = lambda cls, name: None\n" + rigged
    tests = [
        "assert add(1, 2) == 3",
        "def check(candidate):\n    assert candidate(1, 2) == 3\ncheck(add)",
    ]
    for name, cheat in [
        ("rebind", rigged + "__agentgrpo_plain__ = lambda v: v\n"),
        ("liar", liar),
        ("forge", forge),
        ("patch", patch),
    ]:
        res = run_tests(cheat, tests, sandbox=sb)
        assert res.passed == 0, (name, res.tests)
    res = run_tests(forge, tests, sandbox=sb)
    assert {t.detail for t in res.tests} == {
        "the report pipe held something the harness did not write"
    }
    # `import __main__` is the solution's own module, as under `python prog.py`
    own = "import __main__\ndef add(a, b):\n    return a + b\nassert __main__.add is add\n"
    assert run_tests(own, ["assert add(1, 2) == 3"], sandbox=sb).all_passed
    assert run_tests(own, [IOTest(expected="")], sandbox=sb).all_passed


def test_programs_end_as_under_python(sb):
    # what `python prog.py` prints is what a stdin/stdout case compares: output of a thread nobody
    # joins, of atexit handlers, after os._exit(0) following a flush, and non-ASCII output near the
    # capture size (JSON's escapes once made it overflow the job's output cap)
    programs = {
        "thread": "import threading\nthreading.Thread(target=lambda: print(42)).start()",
        "atexit": "import atexit\natexit.register(print, 42)",
        "os_exit": "import os, sys\nprint(42)\nsys.stdout.flush()\nos._exit(0)",
    }
    for name, prog in programs.items():
        res = run_tests(prog, [IOTest(expected="42")], sandbox=sb)
        assert res.all_passed, (name, res.tests)
    res = run_tests("import os\nprint(42)\nos._exit(3)", [IOTest(expected="42")], sandbox=sb)
    assert [t.outcome for t in res.tests] == ["error"]
    text = "é" * 30000 + "\x01" * 4000
    res = run_tests(f"print({text!r})", [IOTest(expected=text)] * 2, sandbox=sb)
    assert res.all_passed and res.exec.status == "ok", res.tests


def test_honest_values_of_every_kind_still_pass(sb):
    solution = (
        "import collections, decimal, enum\nPoint = collections.namedtuple('Point', 'x y')\n"
        "class Color(enum.IntEnum):\n    RED = 1\n"
        "class Name(str):\n    pass\n"
        "class Plain:\n    pass\nP = Plain()\n"
        "def f(k):\n    return {'int': 3, 'list': [1, (2, 3.0)], 'dict': {'a': [None, b'x']},\n"
        "            'tuple': Point(1, 2), 'set': {1, 2}, 'dec': decimal.Decimal('1.5'),\n"
        "            'obj': P, 'gen': (i for i in range(3)), 'od': collections.OrderedDict(a=1),\n"
        "            'enum': Color.RED, 'name': Name('ada')}[k]\n"
    )
    tests = [
        "assert f('int') == 3",
        "assert f('list') == [1, (2, 3)]",
        "assert f('dict')['a'][1] == b'x'",
        "assert f('tuple') == (1, 2) and f('tuple').x == 1",
        "assert f('set') == {2, 1}",
        "assert f('dec') == decimal.Decimal('1.5')",
        "assert f('obj') is P",
        "assert list(f('gen')) == [0, 1, 2]",
        "assert f('od') == {'a': 1}",
        "assert f('int') != 4 and not f('int') < 3",
        "assert f('enum') == 1 and f('enum')",
        "assert f('name') == 'ada'",
    ]
    res = run_tests(solution, tests, sandbox=sb)
    assert [t.outcome for t in res.tests] == ["passed"] * len(tests), res.tests


def test_job_limit_marks_remaining_not_run(sb):
    from agentgrpo.verify.sandbox import Limits

    tests = ["assert add(1, 1) == 2", "import time\ntime.sleep(5)", "assert add(2, 2) == 4"]
    res = run_tests(ADD, tests, sandbox=sb, timeout_per_test_s=10, limits=Limits(wall_s=1.0))
    assert [t.outcome for t in res.tests] == ["passed", "not_run", "not_run"]
    assert res.exec.status == "timeout" and res.score == pytest.approx(1 / 3)


def test_sandbox_error_is_nan_not_zero(monkeypatch, sb):
    failure = ExecResult("sandbox_error", None, None, "", "", False, 0.0, "test", "supervisor died")
    monkeypatch.setattr(sb, "run", lambda *a, **k: failure)
    res = run_tests(ADD, ["assert add(1, 2) == 3"], sandbox=sb)
    assert math.isnan(res.score) and res.unscorable and res.tests[0].outcome == "not_run"


def test_code_verifier(sb):
    v = CodeVerifier(sandbox=sb)
    task = Task(
        id="add",
        prompt="write add",
        metadata={"tests": ["assert add(1, 2) == 3", "assert add(2, 2) == 5"]},
    )
    msgs = [
        Message(role="user", content="write add"),
        Message(role="assistant", content=f"```python\n{ADD}```"),
    ]
    t = Trajectory("add", [1], [0], [0.0], 1, msgs, StopReason.COMPLETED)
    assert asyncio.run(v(t, task)) == 0.5
    assert asyncio.run(CodeVerifier(sandbox=sb, all_or_nothing=True)(t, task)) == 0.0
    io_task = Task(id="io", prompt="p", metadata={"tests": [{"stdin": "", "expected": "hi"}]})
    msgs[-1] = Message(role="assistant", content="```python\nprint('hi')\n```")
    t = Trajectory("add", [1], [0], [0.0], 1, msgs, StopReason.COMPLETED)  # a record is frozen
    assert asyncio.run(v(t, io_task)) == 1.0
    with pytest.raises(ValueError, match="metadata"):
        CodeVerifier.tests_of(Task(id="x", prompt="p"))


def test_humaneval_loader_and_scoring(sb):
    problems = load_humaneval()
    assert len(problems) == 164 and problems[0].task_id == "HumanEval/0"
    sample = problems[::16]  # every 16th problem keeps this test short; all 164 pass in the bench

    async def score_all(completions):
        from agentgrpo.verify.code import ascore_humaneval

        return await asyncio.gather(
            *(ascore_humaneval(p, c, sandbox=sb) for p, c in zip(sample, completions, strict=True))
        )

    good = asyncio.run(score_all([p.canonical_solution for p in sample]))
    assert all(r.all_passed for r in good), [
        (p.task_id, r.tests) for p, r in zip(sample, good, strict=True) if not r.all_passed
    ]
    bad = asyncio.run(score_all(["    return None\n"] * len(sample)))
    assert not any(r.all_passed for r in bad)
    # a chat-style answer: the whole function in a fenced block
    p = problems[0]
    chat = (
        "Sure:\n```python\nfrom typing import List\n\n"
        f"def {p.entry_point}(numbers: List[float], threshold: float) -> bool:\n"
        f"{p.canonical_solution}```"
    )
    assert "pass" in humaneval_solution(p, chat)
    assert score_humaneval(p, chat, sandbox=sb).all_passed


# ---- the python tool -------------------------------------------------------------------------


def test_python_tool_messages(sb):
    from tools.python import PythonToolConfig, make_async_python_tool, make_python_tool

    tool = make_python_tool(sb, PythonToolConfig(max_output_chars=300))
    assert tool("print(2 ** 10)").startswith("status: ok (exit 0, ")
    assert tool("print(2 ** 10)").endswith(" s)\nstdout:\n1024\n")
    msg = tool("raise ValueError('bad')")
    assert (
        msg.startswith("status: runtime_error (exit 1)\nstderr:\nTraceback")
        and "ValueError: bad" in msg
    )
    long = tool("print('a' * 5000)\nimport sys; print('z' * 10, file=sys.stderr)")
    assert len(long) <= 300 and "characters cut]" in long and long.rstrip().endswith("z" * 10)
    assert tool.__doc__.startswith("Run a Python 3 program") and "Args:\n    code:" in tool.__doc__
    async_tool = make_async_python_tool(sb, PythonToolConfig(max_output_chars=300))
    assert async_tool.__doc__ == tool.__doc__
    assert asyncio.run(async_tool("print(2 ** 10)")).endswith(" s)\nstdout:\n1024\n")


def test_python_tool_raises_on_sandbox_failure(monkeypatch, sb):
    from agentgrpo.verify.sandbox import SandboxUnavailable
    from tools.python import make_python_tool

    failure = ExecResult("sandbox_error", None, None, "", "", False, 0.0, "test", "supervisor died")
    monkeypatch.setattr(sb, "run", lambda *a, **k: failure)
    with pytest.raises(SandboxUnavailable, match="supervisor died"):
        make_python_tool(sb)("print(1)")
