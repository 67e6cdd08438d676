"""The calculator agent written with the OpenAI Agents SDK (`pip install openai-agents`), on the
SDK's default model: the Responses API.

Plain SDK code: an `Agent` with a `function_tool`, run by `Runner.run`, with a model provider
built on the episode's client (`OpenAIProvider(openai_client=client)`; its default model speaks
the Responses API, which the episode endpoint serves). Train it with
`agentgrpo train examples/openai_agent.yaml env.name=examples.openai_agents_sdk:CalculatorSDKAgent`.
`OpenAIChatCompletionsModel(model=self.model, openai_client=client)` as the agent's model works
as well (Chat Completions).
"""

from __future__ import annotations

from fractions import Fraction

import openai
from agents import (
    Agent,
    MaxTurnsExceeded,
    ModelBehaviorError,
    OpenAIProvider,
    RunConfig,
    Runner,
    function_tool,
    set_tracing_disabled,
)

from agentgrpo import AgentEnv, Task
from envs.calculator import CalculatorEnv, last_number
from tools.calculator import calculator

set_tracing_disabled(True)  # the SDK would otherwise send traces to OpenAI's servers


@function_tool(name_override="calculator")
def calculator_tool(expression: str) -> str:
    """Evaluate an arithmetic expression and return the result.

    Args:
        expression: arithmetic using numbers, + - * / // % ** and parentheses, e.g. "(12+7)*3"
    """
    try:
        return calculator(expression=expression)
    except Exception as e:  # noqa: BLE001 - the model's expression: tell it what failed
        return f"error: {type(e).__name__}: {e}"


class CalculatorSDKAgent(AgentEnv):
    """Arithmetic with a calculator tool, as an Agents SDK agent: reward 1 for the exact answer."""

    load_tasks = CalculatorEnv.load_tasks

    def __init__(self, max_turns: int = 3) -> None:
        self.max_turns = max_turns

    async def run(self, client: openai.AsyncOpenAI, task: Task) -> float:
        agent = Agent(
            name="calculator",
            instructions=CalculatorEnv.system_prompt,
            tools=[calculator_tool],
            model=self.model,
        )
        config = RunConfig(model_provider=OpenAIProvider(openai_client=client))
        try:
            result = await Runner.run(
                agent, str(task.prompt), max_turns=self.max_turns, run_config=config
            )
        except (MaxTurnsExceeded, ModelBehaviorError):
            # the policy's doing (too many turns, a reply cut at the token limit, a malformed
            # call), so a reward of 0, not an env error
            return 0.0
        number = last_number(str(result.final_output))
        return float(number is not None and number == Fraction(str(task.answer)))
