"""The CLI's own parsing: check-env passes constructor arguments as a config's env.kwargs would."""

from __future__ import annotations

from agentgrpo.cli import main
from agentgrpo.env.base import Env


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
    assert (
        main(
            [
                "check-env",
                "tests.test_cli:NeedsArgs",
                "--kwarg",
                "target=7",
                "--kwarg",
                "options.mode=strict",
            ]
        )
        == 0
    ), capsys.readouterr()


WEATHER = """
from agentgrpo import Env


class Weather(Env):
    def step(self, action):
        return [], float(action.content.strip() == str(self.task.answer)), True, False, {}
"""


def test_a_module_in_the_current_directory_is_found_and_tasks_come_from_a_file(
    tmp_path, monkeypatch, capsys
):
    """As the README has users do: `mymodule.py` beside them, tasks in data/{split}.jsonl."""
    import json
    import sys

    (tmp_path / "mymodule_weather.py").write_text(WEATHER)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "train.jsonl").write_text(
        json.dumps({"question": "Say 7.", "answer": "7"}) + "\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert (
        main(["check-env", "mymodule_weather:Weather"]) == 1
    )  # found, but it has no tasks of its own
    assert "--tasks file=" in capsys.readouterr().err
    assert (
        main(
            [
                "check-env",
                "mymodule_weather:Weather",
                "--tasks",
                "file=data/{split}.jsonl",
                "--tasks",
                "prompt_key=question",
            ]
        )
        == 0
    ), capsys.readouterr()
    assert sys.path[-1] == str(tmp_path)  # appended: it never shadows an installed package


def test_a_module_that_is_not_found_or_a_class_that_is_not_there_is_a_config_error(
    tmp_path, monkeypatch
):
    import pytest

    from agentgrpo.run.config import ConfigError, EnvConfig

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"env.name: .*no module named 'nowhere_mod'.*PYTHONPATH"):
        EnvConfig(name="nowhere_mod:Env").env_class()
    with pytest.raises(ConfigError, match=r"module 'tests.test_cli' has no 'Nope'"):
        EnvConfig(name="tests.test_cli:Nope").env_class()
    (tmp_path / "broken_dep_mod.py").write_text("import not_installed_pkg_xyz\n")
    with pytest.raises(
        ModuleNotFoundError, match="not_installed_pkg_xyz"
    ):  # their import: their traceback
        EnvConfig(name="broken_dep_mod:Env").env_class()


def test_task_sources_that_cannot_work_are_config_errors(tmp_path):
    import pytest

    from agentgrpo.run.config import ConfigError, EnvConfig
    from tests.test_env import Echo

    with pytest.raises(ConfigError, match=r"env.tasks: Echo.load_tasks is not implemented"):
        EnvConfig().load_tasks(Echo, "train", 0)
    with pytest.raises(ConfigError, match=r"env.tasks.file: cannot read the tasks of split 'eval'"):
        EnvConfig(tasks={"file": str(tmp_path / "{split}.jsonl")}).load_tasks(Echo, "eval", 0)
    (tmp_path / "train.jsonl").write_text('{"prompt": "x"}\n')
    with pytest.raises(ConfigError, match=r"env.tasks: Echo.load_tasks cannot take .*prompt_keys"):
        EnvConfig(tasks={"file": str(tmp_path / "{split}.jsonl"), "prompt_keys": "q"}).load_tasks(
            Echo, "train", 0
        )


def test_train_with_a_misspelt_env_fails_before_loading_the_model(tmp_path, capsys, monkeypatch):
    import agentgrpo.models.embedded as models

    def no_model(*a, **k):
        raise AssertionError("the model loaded before the env name was checked")

    monkeypatch.setattr(models, "load_policy", no_model)
    config = tmp_path / "c.yaml"
    config.write_text(f"env: {{name: calculatr}}\noutput_dir: {tmp_path / 'run'}\n")
    assert main(["train", str(config)]) == 2
    err = capsys.readouterr().err
    assert "error: env.name: unknown environment 'calculatr'" in err and "Traceback" not in err


def test_task_file_and_module_name_mistakes_say_what_to_change(tmp_path, monkeypatch, capsys):
    import pytest

    from agentgrpo.run.config import ConfigError, EnvConfig
    from tests.test_env import Echo

    with pytest.raises(ConfigError, match=r"\{split\} is the only placeholder"):
        EnvConfig(tasks={"file": "data/{name}.jsonl"}).load_tasks(Echo, "train", 0)
    with pytest.raises(ConfigError, match=r"name the module, not its file: tests.test_env:Echo"):
        EnvConfig(name="tests.test_env.py:Echo").env_class()
    (tmp_path / "train.jsonl").write_text("")
    assert (
        main(["check-env", "tests.test_env:Echo", "--tasks", f"file={tmp_path}/{{split}}.jsonl"])
        == 1
    )
    assert "cannot load its tasks: ConfigError: env.tasks.file:" in capsys.readouterr().err


def test_train_with_a_missing_task_file_fails_before_loading_the_model(
    tmp_path, capsys, monkeypatch
):
    import agentgrpo.models.embedded as models

    def no_model(*a, **k):
        raise AssertionError("the model loaded before the task file was read")

    monkeypatch.setattr(models, "load_policy", no_model)
    config = tmp_path / "c.yaml"
    config.write_text(
        f"env: {{name: 'tests.test_env:Echo', tasks: {{file: '{tmp_path}/{{split}}.jsonl'}}}}\n"
        f"output_dir: {tmp_path / 'run'}\n"
    )
    assert main(["train", str(config)]) == 2
    err = capsys.readouterr().err
    assert (
        "error: env.tasks.file: cannot read the tasks of split 'train'" in err
        and "Traceback" not in err
    )


def test_options_a_custom_load_tasks_rejects_are_config_errors_that_say_where(capsys):
    import pytest

    from agentgrpo.run.config import ConfigError, EnvConfig
    from envs.calculator import CalculatorEnv

    # CalculatorEnv.load_tasks takes **kwargs and raises TypeError on one it does not know, so the
    # signature check before the call cannot catch it.
    with pytest.raises(
        ConfigError,
        match=r"env.tasks \{'digts': 3\}: CalculatorEnv.load_tasks\('train'\) "
        r"raised TypeError: .*unknown options \['digts'\] \(at .*calculator.py:\d+\)",
    ):
        EnvConfig(tasks={"digts": 3}).load_tasks(CalculatorEnv, "train", 0)
    with pytest.raises(ConfigError, match=r"raised ValueError: need digits >= 1"):
        EnvConfig(tasks={"digits": 0}).load_tasks(CalculatorEnv, "train", 0)
    assert main(["check-env", "calculator", "--tasks", "digts=3"]) == 1
    err = capsys.readouterr().err
    assert "unknown options ['digts']" in err and "Traceback" not in err


def test_a_custom_load_tasks_bug_names_the_envs_own_line_and_a_bad_return_is_named():
    import pytest

    from agentgrpo import Env, Task
    from agentgrpo.run.config import ConfigError, EnvConfig

    class BadRow(Env):
        @classmethod
        def load_tasks(cls, split, seed=0, **kw):
            return [Task(id=1, prompt="p")]  # pydantic raises (a ValueError) inside its own code

    class NoReturn(Env):
        @classmethod
        def load_tasks(cls, split, seed=0, **kw):
            [Task(id="1", prompt="p")]

    with pytest.raises(
        ConfigError, match=r"(?s)raised ValidationError: .*\(at .*test_cli.py:\d+\)"
    ) as info:
        EnvConfig().load_tasks(BadRow, "train", 0)
    assert info.value.__cause__ is not None  # the whole traceback is kept for a bug hunt
    with pytest.raises(
        ConfigError, match=r"NoReturn.load_tasks\('train'\) returned NoneType, not a list"
    ):
        EnvConfig().load_tasks(NoReturn, "train", 0)


def test_an_env_without_a_source_file_still_gets_a_config_error(monkeypatch):
    import sys
    import types

    import pytest

    from agentgrpo.run.config import ConfigError, EnvConfig

    mod = types.ModuleType("notebook_cell")  # a class typed into a notebook or `python -c`
    monkeypatch.setitem(sys.modules, "notebook_cell", mod)
    exec(
        "from agentgrpo import Env\n"
        "class Cell(Env):\n"
        "    @classmethod\n"
        "    def load_tasks(cls, split, seed=0, **kw):\n"
        "        raise ValueError('no such level')\n",
        mod.__dict__,
    )
    with pytest.raises(
        ConfigError, match=r"Cell.load_tasks\('train'\) raised ValueError: no such level"
    ):
        EnvConfig().load_tasks(mod.Cell, "train", 0)
