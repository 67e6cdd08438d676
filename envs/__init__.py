"""Ready environments, found by name in configs (`env.name: calculator`) through the entry points
pyproject.toml declares in the `agentgrpo.envs` group, as any installed package can declare its own.

- `calculator`: arithmetic with a calculator tool.
- `python_math`: reasoning-gym word problems solved with a sandboxed `python` tool.
- `code_tests`: HumanEval with a `run_tests` tool over the docstring's examples; hidden tests score.
- `gym_text`: any Gymnasium env with a discrete action space, played in text (FrozenLake by
  default).
- `reasoning_gym`: reasoning-gym's generators as tasks, scored by their own scorers; optional tools.
"""

from envs.calculator import CalculatorEnv
from envs.code_tests import CodeTestsEnv
from envs.gym_text import GymTextEnv
from envs.python_math import PythonMathEnv
from envs.reasoning_gym_env import ReasoningGymEnv

__all__ = ["CalculatorEnv", "CodeTestsEnv", "GymTextEnv", "PythonMathEnv", "ReasoningGymEnv"]
