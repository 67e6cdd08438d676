"""Arithmetic questions answered with a calculator tool.

Tasks are generated from a seed (no data files): `terms` integers of `digits` digits joined by the
operators in `ops`. The model may call `calculator`; the episode ends when it answers without a tool
call, and the reward is 1.0 when the last number in that answer equals the exact result.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

from agentgrpo import Message, Task, ToolCall, ToolEnv
from tools.calculator import calculator, evaluate, format_number

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


_THINKING = re.compile(r"<think>.*?(?:</think>|\Z)", re.S)


def drop_thinking(text: str) -> str:
    """The reply without its `<think>` blocks (an unclosed one runs to the end): the answer is
    what the reply commits to, not a number met while reasoning (the reward-hack audit's "answer
    in a think block")."""
    return _THINKING.sub("", text)


def last_number(text: str) -> Fraction | None:
    found = _NUMBER.findall(text)
    if not found:
        return None
    try:
        return Fraction(found[-1].replace(",", ""))
    except ValueError:
        return None


class CalculatorEnv(ToolEnv):
    """Arithmetic with a `calculator` tool; reward 1 for the exact answer.

    Example:
        >>> env = CalculatorEnv()
        >>> task = CalculatorEnv.load_tasks("train", seed=0, n=1)[0]
        >>> msgs, _ = env.reset(seed=0, options={"task": task})
    """

    tools = (calculator,)
    system_prompt = (
        "You are a careful assistant. Call the calculator tool to compute the answer, "
        "then reply with only the final number."
    )

    def __init__(self, demo: bool = True) -> None:
        self.demo = demo

    def prompt(self, task: Task) -> list[Message]:
        """System prompt, then (with `demo`) one worked exchange showing the tool-call format: a
        135M model has never seen Hermes tool calls and would otherwise never try one, leaving
        GRPO nothing to reinforce."""
        msgs = [Message(role="system", content=self.system_prompt)]
        if self.demo:
            msgs += [
                Message(role="user", content="What is 12 + 30?"),
                Message(
                    role="assistant",
                    content="",
                    tool_calls=[
                        ToolCall(
                            id="call_demo", name="calculator", arguments={"expression": "12 + 30"}
                        )
                    ],
                ),
                Message(role="tool", content="42", tool_call_id="call_demo", name="calculator"),
                Message(role="assistant", content="42"),
            ]
        return msgs + task.prompt_messages()

    def reward(self, task: Task, messages: list[Message]) -> float:
        answer = last_number(drop_thinking(messages[-1].content))
        return float(answer is not None and answer == Fraction(str(task.answer)))

    @classmethod
    def load_tasks(
        cls,
        split: str = "train",
        seed: int = 0,
        *,
        n: int = 10_000,
        digits: int = 2,
        terms: int = 2,
        ops: str = "+",
        **kwargs: Any,
    ) -> Sequence[Task]:
        if kwargs:
            raise TypeError(f"CalculatorEnv.load_tasks: unknown options {sorted(kwargs)}")
        if digits < 1 or terms < 2 or not ops or set(ops) - set("+-*"):
            raise ValueError("need digits >= 1, terms >= 2 and ops drawn from '+-*'")
        # Splits draw from disjoint seed streams so evaluation tasks are held out.
        rng = random.Random(f"calculator/{split}/{seed}")
        lo, hi = (0 if digits == 1 else 10 ** (digits - 1)), 10**digits - 1
        tasks = []
        for i in range(n):
            nums = [rng.randint(lo, hi) for _ in range(terms)]
            expr = str(nums[0])
            for x in nums[1:]:
                expr += f" {rng.choice(ops)} {x}"
            tasks.append(
                Task(
                    id=f"{split}-{seed}-{i}",
                    prompt=f"What is {expr}?",
                    answer=format_number(evaluate(expr)),
                    metadata={"expression": expr},
                )
            )
        return tasks
