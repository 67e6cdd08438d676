"""The environment contract: `Env` (a gymnasium.Env over chat messages), `ToolEnv`, `@tool`, and
the `Rubric` that scores an episode. Everything an env author imports lives here."""

from agentgrpo.env.base import Env, ToolEnv, get_env_class, register_env, tasks_from_file
from agentgrpo.env.rubric import Rubric, Verifier, VerifierResult
from agentgrpo.env.tool import Tool, ToolError, tool

__all__ = [
    "Env",
    "Rubric",
    "Tool",
    "ToolEnv",
    "ToolError",
    "Verifier",
    "VerifierResult",
    "get_env_class",
    "register_env",
    "tasks_from_file",
    "tool",
]
