"""Ready environments, registered by name for configs (`env.name: calculator`).

- `calculator`: arithmetic with a calculator tool.
- `python_math`: reasoning-gym word problems solved with a sandboxed `python` tool.
- `code_tests`: HumanEval with a `run_tests` tool over the docstring's examples; hidden tests score.
- `gym_text`: any Gymnasium env with a discrete action space, played in text (FrozenLake by default).
"""

from agentgrpo.env import register_env
from envs.calculator import CalculatorEnv
from envs.code_tests import CodeTestsEnv
from envs.gym_text import GymTextEnv
from envs.python_math import PythonMathEnv

register_env("calculator", CalculatorEnv)
register_env("python_math", PythonMathEnv)
register_env("code_tests", CodeTestsEnv)
register_env("gym_text", GymTextEnv)

__all__ = ["CalculatorEnv", "CodeTestsEnv", "GymTextEnv", "PythonMathEnv"]
