"""The CLI's own parsing: check-env passes constructor arguments as a config's env.kwargs would."""

from __future__ import annotations

from agentgrpo.cli import main
from agentgrpo.env import Env


class NeedsArgs(Env):
    """An env whose constructor requires arguments (a check-env with `cls()` could not build it)."""

    def __init__(self, target: int, options: dict) -> None:
        super().__init__()
        assert isinstance(target, int) and options == {"mode": "strict"}, (target, options)
        self.target = target

    @classmethod
    def load_tasks(cls, split="train", seed=0, **kwargs):
        from agentgrpo.types import Task

        return [Task(id="t0", prompt="Say 7.", answer="7")]

    def step(self, action):
        return [], float(action.content.strip() == "7"), True, False, {}


def test_check_env_builds_the_env_with_its_constructor_arguments(capsys):
    assert main(["check-env", "tests.test_cli:NeedsArgs"]) == 1  # cannot be built without them
    assert "cannot create the env" in capsys.readouterr().err
    assert main(["check-env", "tests.test_cli:NeedsArgs", "--kwarg", "target=7",
                 "--kwarg", "options.mode=strict"]) == 0, capsys.readouterr()
