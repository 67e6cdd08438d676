"""Tasks from a file: JSONL or a JSON list, a dataset's columns mapped to `Task` fields by name.
`Env.load_tasks` reads them when a config names a file (`env.tasks: {file: ...}`).
"""

from __future__ import annotations

import json
from pathlib import Path

from agentgrpo.types import Task


def tasks_from_file(
    path: str | Path,
    *,
    split: str = "train",
    prompt_key: str = "prompt",
    answer_key: str = "answer",
    id_key: str = "id",
) -> list[Task]:
    """Tasks from a JSONL file (one JSON object per line) or a JSON file holding a list of objects.

    Each object gives a task: `prompt_key` holds the prompt (text, or a list of OpenAI-style
    messages), `answer_key` the reference answer (optional), `id_key` the id (default
    `"<split>-<row>"`); every other field goes to `metadata`. So a dataset's columns map without
    rewriting it, e.g. `prompt_key: question` for GSM8K-style rows. A row that does not fit is a
    ValueError naming the file, the row and the problem. (Parquet / HF datasets: export to JSONL,
    e.g. `Dataset.to_json(path)`, which writes this format.)
    """
    path = Path(path)
    text = path.read_text()
    if path.suffix == ".json":
        rows = json.loads(text)
        if not isinstance(rows, list):
            raise ValueError(
                f"{path}: a JSON task file holds a list of objects, got {type(rows).__name__}"
            )
        numbered = list(enumerate(rows, 1))
    else:
        numbered = []
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    numbered.append((n, json.loads(line)))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n}: not JSON ({e})") from e
    tasks = []
    for n, row in numbered:
        where = f"{path}:{n}" if path.suffix != ".json" else f"{path}[{n - 1}]"
        if not isinstance(row, dict) or prompt_key not in row:
            raise ValueError(
                f"{where}: expected an object with a {prompt_key!r} field (the prompt)"
            )
        rest = {k: v for k, v in row.items() if k not in (prompt_key, answer_key, id_key)}
        try:
            tasks.append(
                Task(
                    id=str(row.get(id_key, f"{split}-{n}")),
                    prompt=row[prompt_key],
                    answer=row.get(answer_key),
                    metadata=rest,
                )
            )
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from e
    if not tasks:
        raise ValueError(f"{path}: no tasks")
    return tasks
