"""Tasks from a JSONL/JSON file: `env.tasks: {file: ...}` trains any env that does not generate
its own, with a dataset's columns mapped by key and bad rows named."""

from __future__ import annotations

import json

import pytest

from agentgrpo.env.base import Env, tasks_from_file
from agentgrpo.run.log import read_jsonl
from tests.short_runs import train


class FileEcho(Env):
    """Reward 1 when the reply contains the task's answer; tasks only from a file."""

    def step(self, action):
        return [], float(str(self.task.answer) in action.content), True, False, {}


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_rows_become_tasks_with_mapped_columns_and_openai_prompts(tmp_path):
    _write(
        tmp_path / "train.jsonl",
        [
            {"question": "What is 2+2?", "answer": 4, "level": "easy"},
            {
                "question": [
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "3+3?"},
                ],
                "answer": "6",
                "id": "q-six",
            },
        ],
    )
    tasks = FileEcho.load_tasks(
        "train", file=str(tmp_path / "{split}.jsonl"), prompt_key="question"
    )
    assert [t.id for t in tasks] == ["train-1", "q-six"]
    assert (
        tasks[0].prompt == "What is 2+2?"
        and tasks[0].answer == 4
        and tasks[0].metadata == {"level": "easy"}
    )
    assert [m.role for m in tasks[1].prompt_messages()] == ["system", "user"]
    (tmp_path / "list.json").write_text(json.dumps([{"prompt": "hi", "answer": 1}]))
    assert tasks_from_file(tmp_path / "list.json", split="eval")[0].id == "eval-1"


@pytest.mark.parametrize(
    "content, message",
    [
        (
            '{"prompt": "ok"}\n{"answer": 1}\n',
            r"rows\.jsonl:2: expected an object with a 'prompt' field",
        ),
        ('{"prompt": "ok"}\n{oops\n', r"rows\.jsonl:2: not JSON"),
        ('{"prompt": [{"role": "robot", "content": "x"}]}\n', r"(?s)rows\.jsonl:1: .*role"),
        ("\n", r"no tasks"),
    ],
)
def test_a_row_that_does_not_fit_is_named(tmp_path, content, message):
    (tmp_path / "rows.jsonl").write_text(content)
    with pytest.raises(ValueError, match=message):
        tasks_from_file(tmp_path / "rows.jsonl")


def test_an_env_without_tasks_says_how_to_give_them():
    with pytest.raises(NotImplementedError, match="env.tasks.file"):
        FileEcho.load_tasks("train")


def test_training_from_a_task_file(tmp_path, tiny_model_dir):
    data = _write(
        tmp_path / "train.jsonl", [{"prompt": f"Say {i}.", "answer": i} for i in range(5)]
    )
    out = tmp_path / "run"
    assert (
        train(
            out,
            tiny_model_dir,
            1,
            "env.name=tests.test_task_files:FileEcho",
            "env.audit.reward_hacks=skip",  # a toy verifier: not what this tests
            f"env.tasks={{file: {data}}}",
        )
        == 0
    )
    ids = {r["task_id"] for r in read_jsonl(out / "trajectories.jsonl")}
    assert len(ids) == 2 and ids <= {f"train-{i}" for i in range(1, 6)}  # 2 tasks per step
