"""agentgrpo: agentic, multi-turn GRPO for tool-using LLM agents."""

from agentgrpo.types import EnvStep, Group, Message, StopReason, Task, ToolCall, Trajectory  # noqa: I001
from agentgrpo.env.tool import tool  # binds the name `tool` to the decorator, not the submodule
from agentgrpo.env.base import Env, ToolEnv
from agentgrpo.checks.env_check import (
    check_env,
)  # the run-level checker: the package face re-exports it
from agentgrpo.agents.agent_env import AgentEnv

__all__ = [
    "AgentEnv",
    "Env",
    "EnvStep",
    "Group",
    "Message",
    "StopReason",
    "Task",
    "ToolCall",
    "ToolEnv",
    "Trajectory",
    "check_env",
    "tool",
]
