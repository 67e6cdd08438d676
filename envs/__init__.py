"""Ready environments, registered by name for configs (`env.name: calculator`)."""

from agentgrpo.env import register_env
from envs.calculator import CalculatorEnv

register_env("calculator", CalculatorEnv)

__all__ = ["CalculatorEnv"]
