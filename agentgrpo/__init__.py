"""agentgrpo: agentic, multi-turn GRPO for tool-using LLM agents."""

from agentgrpo.types import Group, Message, StopReason, Task, ToolCall, Trajectory

__all__ = [
    "Env", "Group", "Message", "StopReason", "Task", "ToolCall", "ToolEnv", "Trajectory",
    "check_env", "tool",
]


def __getattr__(name: str):
    # Env/ToolEnv/tool pull in gymnasium; load them on first use so `import agentgrpo` stays cheap.
    if name in ("Env", "ToolEnv", "check_env"):
        from agentgrpo import env

        return getattr(env, name)
    if name == "tool":
        from agentgrpo.tool import tool

        return tool
    raise AttributeError(name)
