"""Word problems solved with a sandboxed `python` tool; reward by symbolic/numeric equality.

Tasks are generated offline by `reasoning-gym` from a seed (`dataset`: `gsm_symbolic`,
`chain_sum`, `basic_arithmetic`; other keywords are the generator's). Splits partition the
questions by a hash, so they never share one. The model may call `python(code)` (a fresh
sandboxed process each time); its first reply without a tool call is scored: the last
`\\boxed{...}`, else the last number, against the reference by math-verify (1.0 or 0.0). An
answer whose check exhausts its CPU budget scores 0 and ends as PARSE_ERROR. A failed verifier
(`MathVerifyUnavailable`) or sandbox (`SandboxUnavailable`) makes the trajectory unscorable
(ENV_ERROR, NaN), never 0. The details: docs/environments.md ("Word problems with Python").
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from decimal import Decimal
from typing import Any

from agentgrpo import EnvStep, Message, StopReason, Task, ToolEnv, tool
from agentgrpo.verify.math import MathCheck, amath_check
from agentgrpo.verify.sandbox import Sandbox, SandboxUnavailable
from envs.calculator import drop_thinking
from envs.reasoning_gym_env import reasoning_gym_tasks
from tools.python import PythonToolConfig, make_async_python_tool

DATASETS = ("gsm_symbolic", "chain_sum", "basic_arithmetic")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?(?:\s*/\s*\d+)?")
_MAX_WRITTEN_EXPONENT = 100  # `1e100` is written out (101 characters); `1e101` stays as written


def _last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}`, braces balanced; None when there is none."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j].strip()
    return None  # unclosed: the reply was cut


def final_answer(text: str) -> str | None:
    """The answer a reply commits to: its last `\\boxed{}` content, else its last number. A number
    in scientific notation is written out (`1.5e3` -> `1500`): math-verify reads `1e3` as `1*e*3`.
    Only when its decimal exponent is at most `_MAX_WRITTEN_EXPONENT` in size: `1e999999999999`
    written out would not fit in memory, so it stays as written (and scores 0 as a wrong answer)."""
    answer = _last_boxed(text)
    if not answer:
        found = _NUMBER.findall(text)
        if not found:
            return None
        answer = found[-1].replace(",", "").replace(" ", "")
    if "e" in answer.lower() and _NUMBER.fullmatch(answer) and "/" not in answer:
        number = Decimal(answer.replace(",", ""))  # exact, and cheap whatever the exponent
        if abs(number.adjusted()) <= _MAX_WRITTEN_EXPONENT:
            return format(number, "f")
    return answer


def answer_readings(text: str) -> list[str]:
    """What math-verify is asked to compare, in order: `final_answer`, read as an expression
    (`2**10`, `3/4`), then for a boxed answer the box itself, read as LaTeX (`10^{3}`, `2\\sqrt{2}`:
    math-verify reads LaTeX only inside a box or `$...$`, and the bare forms did not equal 1000
    and 2.828...). The answer is right when one reading equals the reference."""
    text = drop_thinking(text)
    answer = final_answer(text)
    if answer is None:
        return []
    boxed = _last_boxed(text)
    return [answer, f"\\boxed{{{boxed}}}"] if boxed else [answer]


class PythonMathEnv(ToolEnv):
    """Math word problems with a sandboxed `python` tool; reward 1 when the final answer is right.

    Constructor: `sandbox` (default: the process-wide `default_sandbox()`, which honours
    `AGENTGRPO_SANDBOX_URL`), `python` (a `PythonToolConfig` or its dict: limits and message size
    of one tool call), `math_timeout_s` (CPU seconds math-verify may spend checking one answer).
    Tasks, answer extraction, sandbox and verifier failures: docs/environments.md.

    Example:
        >>> env = PythonMathEnv(python={"max_output_chars": 1000})
        >>> task = PythonMathEnv.load_tasks("eval", seed=0, n=1)[0]
        >>> msgs, _ = env.reset(seed=0, options={"task": task})

        >>> tasks = PythonMathEnv.load_tasks("train", seed=0, n=2, dataset="chain_sum",
        ...                                   max_terms=3)
        >>> env = PythonMathEnv()
        >>> msgs, _ = env.reset(seed=0, options={"task": tasks[0]})
        >>> [m.role for m in msgs]
        ['system', 'user']
        >>> final_answer("x = 3, so the total is \\\\boxed{12}")
        '12'
    """

    system_prompt = (
        "Solve the problem. You can run Python code with the python tool; it shows what the code "
        "prints. When you know the answer, reply with the final answer as a number in "
        "\\boxed{}, for example \\boxed{42}."
    )

    def __init__(
        self,
        sandbox: Sandbox | None = None,
        python: PythonToolConfig | dict[str, Any] | None = None,
        math_timeout_s: float = 5.0,
    ) -> None:
        if not math_timeout_s > 0:
            raise ValueError(f"PythonMathEnv: math_timeout_s must be > 0, got {math_timeout_s!r}")
        self.math_timeout_s = math_timeout_s
        cfg = (
            python
            if isinstance(python, PythonToolConfig) or python is None
            else PythonToolConfig(**python)
        )
        self._run_python = make_async_python_tool(sandbox, cfg)
        self._check: MathCheck | None = None  # the last reward's check, for step's info

    @tool
    async def python(self, code: str) -> str:
        """Run a Python 3 program in a fresh, isolated sandbox and return what it printed.

        Nothing persists between calls, there is no network, and only the standard library is
        available. Use print() to show results.

        Args:
            code: the complete program to run.
        """
        try:
            return await self._run_python(code)
        except SandboxUnavailable as e:
            # An InfrastructureError: the tool layer re-raises it out of the step that made this
            # call (never shown to the model). A call past its deadline is cancelled, which kills
            # its sandbox job.
            raise SandboxUnavailable(f"python tool: {e}") from e

    async def step(self, action: Message) -> EnvStep:
        self._check = None
        step = await super().step(action)
        if self._check is not None and self._check.status == "timeout":
            return EnvStep(
                step.messages,
                step.reward,
                step.terminated,
                step.truncated,
                {**step.info, "math_verify": self._check.detail},
                stop_reason=StopReason.PARSE_ERROR,
                tool_errors=step.tool_errors,
            )
        return step

    async def reward(self, task: Task, messages: list[Message]) -> float:
        # MathVerifyUnavailable (infrastructure) propagates: the rollout scores the episode NaN.
        for reading in answer_readings(messages[-1].content):
            self._check = await amath_check(reading, str(task.answer), self.math_timeout_s)
            if self._check.equal or self._check.status == "timeout":  # a runaway is not read twice
                break
        return float(self._check is not None and self._check.equal)

    @classmethod
    def load_tasks(
        cls,
        split: str = "train",
        seed: int = 0,
        *,
        n: int = 2000,
        dataset: str = "gsm_symbolic",
        **dataset_kwargs: Any,
    ) -> Sequence[Task]:
        """`n` problems of `split` ("train" or "eval") from reasoning-gym's `dataset` generator.

        `dataset_kwargs` go to the generator's config (an unknown one is an error that names it).
        Split by a hash of the question (`envs.reasoning_gym_env.reasoning_gym_tasks`).
        """
        if "weight" in dataset_kwargs:
            raise TypeError("PythonMathEnv.load_tasks: one dataset has no weight")
        return reasoning_gym_tasks({dataset: dataset_kwargs}, split, seed, n)
