"""The calculator agent written against Anthropic's client (`pip install anthropic`), with tool use.

Nothing here knows agentgrpo's engine: `run` makes an `anthropic.AsyncAnthropic` at the episode's
`anthropic_base_url` (the endpoint serves Anthropic's Messages API there) and runs the usual tool
loop: send the messages and the tool, run each `tool_use`, send its `tool_result` back, stop at an
answer without a tool use. Train it with

    agentgrpo train examples/openai_agent.yaml \
        env.name=examples.anthropic_agent:CalculatorClaudeAgent
"""

from __future__ import annotations

from fractions import Fraction

import anthropic
import openai

from agentgrpo import AgentEnv, Task
from envs.calculator import CalculatorEnv, last_number
from tools.calculator import calculator

TOOL = {
    "name": "calculator",
    "description": calculator.schema["function"]["description"],
    "input_schema": calculator.schema["function"]["parameters"],
}


class CalculatorClaudeAgent(AgentEnv):
    """Arithmetic with a calculator tool, as an Anthropic-client agent: reward 1 for the exact
    answer."""

    load_tasks = CalculatorEnv.load_tasks

    def __init__(self, max_turns: int = 3) -> None:
        self.max_turns = max_turns

    async def run(self, client: openai.AsyncOpenAI, task: Task) -> float:
        claude = anthropic.AsyncAnthropic(
            base_url=self.anthropic_base_url, api_key=self.api_key, max_retries=0
        )
        messages: list[dict] = [{"role": "user", "content": str(task.prompt)}]
        answer = ""
        async with claude:
            for _ in range(self.max_turns):
                reply = await claude.messages.create(
                    model=self.model,
                    max_tokens=256,
                    system=CalculatorEnv.system_prompt,
                    tools=[TOOL],
                    messages=messages,
                )
                messages.append({"role": "assistant", "content": reply.content})
                answer = "".join(b.text for b in reply.content if b.type == "text")
                uses = [b for b in reply.content if b.type == "tool_use"]
                if not uses or reply.stop_reason == "max_tokens":
                    break
                messages.append({"role": "user", "content": [self._result(u) for u in uses]})
        number = last_number(answer)
        return float(number is not None and number == Fraction(str(task.answer)))

    @staticmethod
    def _result(use: anthropic.types.ToolUseBlock) -> dict:
        try:
            content, error = calculator(**use.input), False
        except Exception as e:  # noqa: BLE001 - the model's arguments: tell it what failed
            content, error = f"error: {type(e).__name__}: {e}", True
        return {"type": "tool_result", "tool_use_id": use.id, "content": content, "is_error": error}
