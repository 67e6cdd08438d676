"""Repository repair: a small Python project with a planted bug; reward = hidden tests passed.

Generated tasks: a package of three functions, one with a planted bug, its visible tests (one
failing at least) and a stdlib runner; the hidden tests are cases on which the bug shows. Your
own tasks come from a SWE-bench-style JSONL file (`load_tasks(file=...)`). The model has `bash`,
`read_file`, `write_file` and `replace_in_file` in a sandbox session. The hidden tests run in a
fresh fork into which only the model's editable source files are copied, by the hardened harness
of `agentgrpo.verify.code`, so editing the visible tests earns nothing. A failed sandbox, or a
disagreement under `recheck=True`, is unscorable (NaN). The task file's format and the details:
docs/environments.md ("Repository repair").
"""

from __future__ import annotations

import fnmatch
import functools
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentgrpo import EnvStep, Message, Task
from agentgrpo.verify.code import arun_tests_in_session
from agentgrpo.verify.session import SessionLimits
from agentgrpo.verify.workspace import Workspace
from tools.workspace import WorkspaceEnv, checked


@dataclass(frozen=True)
class _Fn:
    name: str
    params: str
    doc: str
    body: str
    bugs: tuple[str, ...]
    case: Any  # rng -> the call's arguments (a tuple)


def _ints(rng: random.Random, lo: int = 1, hi: int = 6) -> list[int]:
    return [rng.randint(-40, 40) for _ in range(rng.randint(lo, hi))]


def _word(rng: random.Random) -> str:
    return "".join(rng.choice("abcdeiouxyzAEIOU") for _ in range(rng.randint(0, 9)))


def _palindrome(rng: random.Random) -> str:
    half = "".join(rng.choice("abcAB, ") for _ in range(rng.randint(1, 5)))
    return half + half[::-1] if rng.random() < 0.6 else half + "q"


LIBRARY = (
    _Fn(
        "mean",
        "xs",
        "The arithmetic mean of a non-empty list of numbers.",
        "return sum(xs) / len(xs)",
        ("return sum(xs) / (len(xs) + 1)", "return sum(xs[1:]) / len(xs)"),
        lambda r: (_ints(r),),
    ),
    _Fn(
        "clamp",
        "x, lo, hi",
        "x limited to the range [lo, hi] (lo <= hi).",
        "return max(lo, min(x, hi))",
        ("return min(lo, max(x, hi))", "return max(lo, min(x, hi - 1))"),
        lambda r: (lambda lo: (r.randint(-20, 20), lo, lo + r.randint(0, 10)))(r.randint(-10, 5)),
    ),
    _Fn(
        "count_vowels",
        "text",
        "How many vowels (a, e, i, o, u, in either case) text holds.",
        "return sum(1 for c in text if c in 'aeiouAEIOU')",
        (
            "return sum(1 for c in text if c in 'aeiou')",
            "return sum(1 for c in text[1:] if c in 'aeiouAEIOU')",
        ),
        lambda r: (_word(r),),
    ),
    _Fn(
        "fizzbuzz",
        "n",
        "'FizzBuzz' for multiples of 15, 'Fizz' of 3, 'Buzz' of 5, else str(n).",
        "if n % 15 == 0:\n    return 'FizzBuzz'\nif n % 3 == 0:\n    return 'Fizz'\n"
        "if n % 5 == 0:\n    return 'Buzz'\nreturn str(n)",
        (
            "if n % 3 == 0:\n    return 'Fizz'\nif n % 15 == 0:\n    return 'FizzBuzz'\n"
            "if n % 5 == 0:\n    return 'Buzz'\nreturn str(n)",
            "if n % 15 == 0:\n    return 'FizzBuzz'\nif n % 3 == 0:\n    return 'Fizz'\n"
            "if n % 5 == 1:\n    return 'Buzz'\nreturn str(n)",
        ),
        lambda r: (r.randint(1, 100),),
    ),
    _Fn(
        "is_palindrome",
        "text",
        "Whether text reads the same backwards, ignoring case and all but letters and digits.",
        "clean = [c.lower() for c in text if c.isalnum()]\nreturn clean == clean[::-1]",
        (
            "clean = [c for c in text if c.isalnum()]\nreturn clean == clean[::-1]",
            "return text == text[::-1]",
        ),
        lambda r: (_palindrome(r),),
    ),
    _Fn(
        "running_max",
        "xs",
        "The largest value seen so far, at each position of xs.",
        "out, best = [], None\nfor x in xs:\n    best = x if best is None else max(best, x)\n"
        "    out.append(best)\nreturn out",
        (
            "out, best = [], 0\nfor x in xs:\n    best = max(best, x)\n    out.append(best)\n"
            "return out",
            "return [max(xs[:i]) for i in range(1, len(xs))]",
        ),
        lambda r: (_ints(r, 0, 6),),
    ),
    _Fn(
        "word_lengths",
        "text",
        "The length of each word of text (words: split at any whitespace).",
        "return [len(w) for w in text.split()]",
        ("return [len(w) for w in text.split(' ')]", "return [len(w) - 1 for w in text.split()]"),
        lambda r: ((" " * r.randint(1, 2)).join(_word(r) or "x" for _ in range(r.randint(1, 4))),),
    ),
    _Fn(
        "second_largest",
        "xs",
        "The second largest distinct value of xs (it has two or more).",
        "return sorted(set(xs))[-2]",
        ("return sorted(xs)[-2]", "return sorted(set(xs))[1]"),
        lambda r: (lambda xs: (xs + [max(xs)] * r.randint(0, 2) + [min(xs) - 1],))(_ints(r, 2, 5)),
    ),
    _Fn(
        "digit_sum",
        "n",
        "The sum of the decimal digits of the integer n (its sign ignored).",
        "return sum(int(d) for d in str(abs(n)))",
        ("return sum(int(d) for d in str(n).lstrip('-')[1:])", "return n % 10 + n // 10 % 10"),
        lambda r: (r.randint(-99999, 99999),),
    ),
    _Fn(
        "chunk",
        "xs, size",
        "xs cut into consecutive lists of `size` items (the last may be shorter).",
        "return [xs[i:i + size] for i in range(0, len(xs), size)]",
        (
            "return [xs[i:i + size] for i in range(0, len(xs) - size, size)]",
            "return [xs[i:i + size - 1] for i in range(0, len(xs), size)]",
        ),
        lambda r: (_ints(r, 0, 9), r.randint(1, 4)),
    ),
)
PACKAGES = ("toolkit", "helpers", "utilkit", "mathbits", "textbits", "listbits")
NEVER_CARRIED = ("conftest.py", "sitecustomize.py", "usercustomize.py", "*.pth")
RUNNER = '''"""Run the tests: python3 run_tests.py"""
import importlib.util
import pathlib
import sys
import traceback

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
passed = failed = 0
for path in sorted(pathlib.Path("tests").glob("test_*.py")):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for name in sorted(n for n in vars(module) if n.startswith("test_")):
        try:
            getattr(module, name)()
            passed += 1
            print(f"PASS {path.name}::{name}")
        except Exception:
            failed += 1
            print(f"FAIL {path.name}::{name}")
            traceback.print_exc(limit=-2)
print(f"{passed} passed, {failed} failed")
sys.exit(1 if failed else 0)
'''


def _source(fn: _Fn, body: str) -> str:
    inner = "\n".join("    " + line for line in body.splitlines())
    return f'def {fn.name}({fn.params}):\n    """{fn.doc}"""\n{inner}\n'


@functools.lru_cache(maxsize=256)
def _compiled(name: str, source: str) -> Any:
    scope: dict[str, Any] = {}
    exec(source, scope)  # our own generated code, run here to compute expected values
    return scope[name]


def _call(fn: _Fn, source: str, args: tuple) -> Any:
    """`fn` as `source` defines it, applied to `args`; an exception is a value too (a bug may
    raise)."""
    try:
        return _compiled(fn.name, source)(*args)
    except Exception as e:  # noqa: BLE001 - the planted bug's failure is data
        return ("raised", type(e).__name__)


def _expr(fn: _Fn, args: tuple, value: Any) -> str:
    call = f"{fn.name}({', '.join(repr(a) for a in args)})"
    if isinstance(value, float):
        return f"assert round({call}, 9) == {round(value, 9)!r}"
    return f"assert {call} == {value!r}"


def _cases(
    fn: _Fn, bug: str, rng: random.Random, shows_wanted: int = 7, hides_wanted: int = 3
) -> tuple[list[tuple], list[tuple]]:
    """Distinct (arguments, right value) cases of `fn`: those on which `bug` shows, and those
    where it does not; drawing stops once both lists are long enough."""
    seen, shows, hides = set(), [], []
    good, bad = _source(fn, fn.body), _source(fn, bug)
    for _ in range(200):
        if len(shows) >= shows_wanted and len(hides) >= hides_wanted:
            break
        args = fn.case(rng)
        if repr(args) in seen:
            continue
        seen.add(repr(args))
        right = _call(fn, good, args)
        if isinstance(right, tuple) and right[:1] == ("raised",):
            continue
        (shows if _call(fn, bad, args) != right else hides).append((args, right))
    return shows, hides


def make_task(split: str, seed: int, i: int) -> Task:
    """One generated repository task (what it holds: docs/environments.md, "Repository repair")."""
    rng = random.Random(f"repo/{split}/{seed}/{i}")
    while True:
        fns = rng.sample(LIBRARY, 3)
        broken, bug = fns[0], rng.choice(fns[0].bugs)
        shows, hides = _cases(broken, bug, rng)
        if len(shows) >= 4:
            break
    pkg = rng.choice(PACKAGES)
    rng.shuffle(fns)
    module = f'"""{pkg}: small helpers."""\n\n\n' + "\n\n".join(
        _source(f, bug if f is broken else f.body) for f in fns
    )
    tests = [f"from {pkg}.core import {', '.join(f.name for f in fns)}\n"]
    for f in fns:
        visible = [shows[0], *hides[:2]] if f is broken else _cases(f, f.body, rng, 0)[1][:3]
        lines = "\n".join("    " + _expr(f, a, v) for a, v in visible)
        tests.append(f"\ndef test_{f.name}():\n{lines}\n")
    hidden = [f"from {pkg}.core import {broken.name}\n{_expr(broken, a, v)}" for a, v in shows[1:7]]
    files = {
        f"{pkg}/__init__.py": "",
        f"{pkg}/core.py": module,
        "tests/test_core.py": "\n".join(tests),
        "run_tests.py": RUNNER,
    }
    prompt = (
        f"The tests of the `{pkg}` package fail. Run them with `python3 run_tests.py`, find the "
        f"bug in {pkg}/core.py and fix it (do not change the tests). Reply without a tool call "
        "when you are done."
    )
    return Task(
        id=f"repo-{split}-{seed}-{i}",
        prompt=prompt,
        metadata={
            "workspace": Workspace(files=files),
            "hidden_tests": hidden,
            "editable": [f"{pkg}/*.py"],
            "bug": f"{broken.name}: {bug.splitlines()[0]}",
        },
    )


def tasks_from_file(path: str | Path) -> list[Task]:
    """Tasks from a SWE-bench-style JSONL (or JSON list) file; its format: docs/environments.md."""
    path = Path(path)
    text = path.read_text()
    rows = (
        json.loads(text)
        if path.suffix == ".json"
        else [json.loads(line) for line in text.splitlines() if line.strip()]
    )
    tasks = []
    for n, row in enumerate(rows, 1):
        where = f"{path}:{n}"
        missing = {"id", "problem_statement", "repo", "tests"} - set(row)
        if missing:
            raise ValueError(f"{where}: a repository task needs {sorted(missing)}")
        repo = row["repo"]
        setup = tuple(row.get("setup", ()))
        workspace = (
            Workspace(files=repo, setup=setup)
            if isinstance(repo, dict)
            else Workspace.from_dir(path.parent / repo, setup=setup)
        )
        tasks.append(
            Task(
                id=str(row["id"]),
                prompt=row["problem_statement"],
                metadata={
                    "workspace": workspace,
                    "hidden_tests": list(row["tests"]),
                    "support_files": dict(row.get("support_files", {})),
                    "editable": list(row.get("editable", ["*.py"])),
                    "timeout_per_test_s": float(row.get("timeout_per_test_s", 5.0)),
                },
            )
        )
    return tasks


def carried(path: str, editable: list[str]) -> bool:
    """Whether a file of the model's workspace is copied into the scoring fork."""
    parts = path.split("/")
    name = parts[-1]
    if any(fnmatch.fnmatch(name, pat) for pat in NEVER_CARRIED):
        return False
    if any(p in ("tests", "test") for p in parts[:-1]) or name.startswith("test_"):
        return False
    return any(fnmatch.fnmatch(path, pat) for pat in editable)


class RepoRepairEnv(WorkspaceEnv):
    """Fix a planted bug in a small Python repository; reward = hidden tests passed.

    Constructor: as `tools.workspace.WorkspaceEnv`, plus `recheck` (score in two fresh forks; a
    disagreement is NaN and `flaky_verdict`) and `timeout_per_test_s` (CPU seconds per test).

    Example:
        >>> env = RepoRepairEnv(recheck=True)
        >>> sorted(env.tool_schemas()[i]["function"]["name"] for i in range(4))
        ['bash', 'read_file', 'replace_in_file', 'write_file']

        >>> task = RepoRepairEnv.load_tasks("train", seed=0, n=1)[0]
        >>> {"run_tests.py", "tests/test_core.py"} <= set(task.metadata["workspace"].files)
        True
        >>> len(task.metadata["hidden_tests"]) >= 3
        True
    """

    system_prompt = (
        "You are fixing a bug in a Python repository, in a Linux shell. Use the tools to look at "
        "the files, run the tests and edit the code; then reply without a tool call."
    )

    def __init__(self, *, recheck: bool = False, timeout_per_test_s: float = 5.0, **kwargs: Any):
        if not timeout_per_test_s > 0:
            raise ValueError(f"timeout_per_test_s must be > 0, got {timeout_per_test_s!r}")
        super().__init__(**kwargs)
        self.recheck, self.timeout_per_test_s = recheck, timeout_per_test_s
        self._info: dict[str, Any] = {}

    async def step(self, action: Message) -> EnvStep:
        self._info = {}
        step = await super().step(action)
        if not step.terminated:
            return step
        info = {**step.info, **self._info}
        return EnvStep(step.messages, step.reward, True, False, info, tool_errors=step.tool_errors)

    async def reward(self, task: Task, messages: list[Message]) -> float:
        sources = await self.sources(task)
        first = await self.hidden_score(task, sources)
        self._info = {"hidden_tests": first[1], "carried": sorted(sources)}
        if self.recheck and not math.isnan(first[0]):
            second = await self.hidden_score(task, sources)
            if second[0] != first[0]:
                self._info.update(flaky_verdict=True, recheck=second[1])
                return math.nan
        return first[0]

    async def sources(self, task: Task) -> dict[str, bytes]:
        """The model's files that count (`carried`), read from the episode's session."""
        session = self.live_session()
        find = ["find", ".", "-type", "f", "-print0"]
        listing = checked(await session.exec(find, output_bytes=1 << 20))
        editable = list(task.metadata.get("editable", ["*.py"]))
        paths = [p.removeprefix("./") for p in listing.stdout.split("\0") if p]
        out = {}
        for p in sorted(p for p in paths if carried(p, editable))[:200]:
            out[p] = await session.read_bytes(p)
        return out

    async def hidden_score(self, task: Task, sources: dict[str, bytes]) -> tuple[float, str]:
        """The hidden tests' pass rate in a fresh fork holding `sources`, and a summary."""
        tests = list(task.metadata["hidden_tests"])
        per_test = float(task.metadata.get("timeout_per_test_s", self.timeout_per_test_s))
        wall = len(tests) * (3 * per_test + 1.2) + 10
        fresh = await self.fresh_fork(
            task, SessionLimits(call_timeout_s=wall, output_bytes=len(tests) * 100_000 + 4096)
        )
        try:
            for path, data in {**task.metadata.get("support_files", {}), **sources}.items():
                await fresh.write(path, data)
            res = await arun_tests_in_session(fresh, tests, timeout_per_test_s=per_test)
        finally:
            await fresh.close()
        summary = f"{res.passed}/{len(tests)} passed" + (
            f" ({res.exec.status}: {res.exec.detail})" if res.unscorable else ""
        )
        return res.score, summary

    @classmethod
    def load_tasks(
        cls, split: str = "train", seed: int = 0, *, n: int = 1000, file: str | None = None
    ) -> list[Task]:
        """`n` generated tasks of `split` ("train" or "eval"), or the tasks of a task `file`
        (`{split}` in its name is replaced)."""
        if file is not None:
            return tasks_from_file(file.format(split=split))
        if split not in ("train", "eval"):
            raise ValueError(f"RepoRepairEnv.load_tasks: split is 'train' or 'eval', got {split!r}")
        if n < 1:
            raise ValueError("n must be >= 1")
        return [make_task(split, seed, i) for i in range(n)]
