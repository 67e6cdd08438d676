"""The calculator agent written with LangGraph (`pip install langgraph langchain-openai`).

A prebuilt ReAct agent (`create_react_agent`) over LangChain's `ChatOpenAI` pointed at the
episode's `base_url`, with the calculator as a LangChain tool: the graph calls the model, runs the
tool calls it makes, and loops until the model answers. Train it with
`agentgrpo train examples/openai_agent.yaml env.name=examples.langgraph_agent:CalculatorGraphAgent`.
"""

from __future__ import annotations

from fractions import Fraction

import openai
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.errors import GraphRecursionError
from langgraph.prebuilt import create_react_agent

from agentgrpo import AgentEnv, Task
from envs.calculator import CalculatorEnv, last_number
from tools.calculator import calculator as evaluate


@tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return the result.

    Args:
        expression: arithmetic using numbers, + - * / // % ** and parentheses, e.g. "(12+7)*3"
    """
    try:
        return evaluate(expression=expression)
    except Exception as e:  # noqa: BLE001 - the model's expression: tell it what failed
        return f"error: {type(e).__name__}: {e}"


class CalculatorGraphAgent(AgentEnv):
    """Arithmetic with a calculator tool, as a LangGraph agent: reward 1 for the exact answer."""

    load_tasks = CalculatorEnv.load_tasks

    def __init__(self, max_turns: int = 3) -> None:
        self.max_turns = max_turns

    async def run(self, client: openai.AsyncOpenAI, task: Task) -> float:
        model = ChatOpenAI(
            model=self.model, base_url=self.base_url, api_key=self.api_key, max_retries=0
        )
        graph = create_react_agent(model, [calculator], prompt=CalculatorEnv.system_prompt)
        try:  # one model call and one tool step per turn: 2 graph steps each, and the answer's
            state = await graph.ainvoke(
                {"messages": [("user", str(task.prompt))]},
                {"recursion_limit": 2 * self.max_turns + 1},
            )
        except GraphRecursionError:
            return 0.0
        number = last_number(str(state["messages"][-1].content))
        return float(number is not None and number == Fraction(str(task.answer)))
