"""The calculator task with a reward per turn: a correct tool use pays before the answer does.

Same tasks, tool and prompt as `envs.calculator`. The difference is when reward arrives: the first
turn whose calculator call returns the task's exact result earns `tool_reward` (0.5 by default) in
that turn's `env.step`, and the answer turn earns 1.0 when its last number is the exact result.
An episode therefore scores 0, 0.5, 1 or 1.5, and its `Trajectory.turn_rewards` say which turn
earned what: the signal a turn-level advantage estimator (`advantage.estimator: turn_grpo`) assigns
to that turn's tokens, where an outcome-only estimator spreads the sum over every turn.

The tool reward is paid once per episode, so calling the calculator again and again until the turn
limit earns no more than calling it once.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

from agentgrpo import EnvStep, Message
from envs.calculator import CalculatorEnv


class CalculatorStepsEnv(CalculatorEnv):
    """Arithmetic with a `calculator` tool; `tool_reward` for the first call that returns the exact
    result, 1.0 for the exact answer.

    Example:
        >>> import asyncio
        >>> from agentgrpo import ToolCall
        >>> env = CalculatorStepsEnv()
        >>> task = CalculatorStepsEnv.load_tasks("train", seed=0, n=1)[0]
        >>> _ = env.reset(seed=0, options={"task": task})
        >>> call = ToolCall(id="c1", name="calculator",
        ...                 arguments={"expression": task.metadata["expression"]})
        >>> asyncio.run(env.step(Message(role="assistant", content="", tool_calls=[call]))).reward
        0.5
    """

    def __init__(self, demo: bool = True, tool_reward: float = 0.5) -> None:
        super().__init__(demo=demo)
        if not 0.0 <= tool_reward <= 1.0:
            raise ValueError(f"tool_reward must be in [0, 1], got {tool_reward}")
        self.tool_reward = tool_reward
        self.tool_paid = False

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[list[Message], dict[str, Any]]:
        self.tool_paid = False
        return super().reset(seed=seed, options=options)

    async def step(self, action: Message) -> EnvStep:
        step = await super().step(action)
        if step.terminated or self.tool_paid or not self._returns_answer(step.messages):
            return step
        self.tool_paid = True
        return EnvStep(
            step.messages, self.tool_reward, False, False, step.info, tool_errors=step.tool_errors
        )

    def _returns_answer(self, tool_messages: list[Message]) -> bool:
        """Whether a calculator result in this turn is the task's exact result (an error message
        holds no number that could match by accident: it starts with "Error")."""
        answer = Fraction(str(self.task.answer))
        for m in tool_messages:
            if m.name != "calculator" or m.content.startswith("Error"):
                continue
            try:
                if Fraction(m.content.strip()) == answer:
                    return True
            except ValueError:
                continue
        return False
