"""An agent written only against the OpenAI client, trained with GRPO on the calculator tasks.

Nothing below imports a model or the engine: `run` gets an `openai.AsyncOpenAI` whose base_url is
this episode's endpoint (`agentgrpo.AgentEnv`); its own loop sends the messages and the tool
schema, runs the calculator when the model calls it, sends the result back, and stops when the
model answers without a call. Training reads the tokens the endpoint recorded, so the agent needs
no change to be trained (see docs/agents.md).

    agentgrpo train examples/openai_agent.yaml
"""

from __future__ import annotations

import json
from fractions import Fraction

import openai

from agentgrpo import AgentEnv, Task
from envs.calculator import CalculatorEnv, last_number
from tools.calculator import calculator

TOOLS = [calculator.schema]  # OpenAI's {"type": "function", "function": {...}} form


class CalculatorAgent(AgentEnv):
    """Arithmetic with a calculator tool, as an OpenAI-client agent: reward 1 for the exact answer.

    The prompt (system message and, with `demo`, one worked tool call) is the calculator env's, so
    the two envs train the same model on the same conversations.
    """

    load_tasks = CalculatorEnv.load_tasks

    def __init__(self, demo: bool = True, max_turns: int = 3) -> None:
        self.demo, self.max_turns = demo, max_turns

    async def run(self, client: openai.AsyncOpenAI, task: Task) -> float:
        messages = [m.to_dict() for m in CalculatorEnv(demo=self.demo).prompt(task)]
        answer = ""
        for _ in range(self.max_turns):
            reply = await client.chat.completions.create(
                model=self.model, messages=messages, tools=TOOLS
            )
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            answer = message.content or ""
            if not message.tool_calls or reply.choices[0].finish_reason == "length":
                break
            for call in message.tool_calls:
                try:
                    result = calculator(**json.loads(call.function.arguments))
                except Exception as e:  # noqa: BLE001 - the model's arguments: tell it what failed
                    result = f"error: {type(e).__name__}: {e}"
                messages.append(
                    {
                        "role": "tool",
                        "tool_call_id": call.id,
                        "name": call.function.name,
                        "content": str(result),
                    }
                )
        number = last_number(answer)
        return float(number is not None and number == Fraction(str(task.answer)))
