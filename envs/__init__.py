"""Ready environments, registered by name for configs (`env.name: calculator`).

- `calculator`: arithmetic with a calculator tool.
- `python_math`: reasoning-gym word problems solved with a sandboxed `python` tool.
"""

from agentgrpo.env import register_env
from envs.calculator import CalculatorEnv
from envs.python_math import PythonMathEnv

register_env("calculator", CalculatorEnv)
register_env("python_math", PythonMathEnv)

__all__ = ["CalculatorEnv", "PythonMathEnv"]
