"""Terminal tasks: the model works in a bash shell of its own and is scored on the end state.

Four kinds of tasks generated from a seed (`count`, `find`, `make`, `fix`; `load_tasks(kinds=...)`
picks some). The model calls `bash(command)` in a sandbox session on a fork of the task's files;
its first reply without a tool call ends the episode. Reward 1.0 when the end state is right:
`fix` runs the model's program in a fresh fork on numbers it never saw, so printing the visible
answer earns nothing. `train` and `eval` are separate seeded streams. The details:
docs/environments.md ("Terminal tasks").
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from agentgrpo import Message, Task
from agentgrpo.verify.workspace import Workspace
from tools.workspace import WorkspaceEnv, checked

KINDS = ("count", "find", "make", "fix")
_WORDS = (
    "alpha bravo cedar delta ember fjord grove harbor island jasper kettle lumen meadow nectar "
    "orbit prism quartz raven summit tundra umber velvet willow xenon yonder zephyr"
).split()
_SUM = """import sys


def total(path):
    with open(path) as f:
        numbers = [int(line) for line in f if line.strip()]
    {body}


print(total(sys.argv[1]))
"""
_BUGS = (  # each is wrong for most files of numbers
    "return sum(numbers[1:])",
    "return sum(numbers) - numbers[-1]",
    "return max(numbers)",
    "return sum(n for n in numbers if n > 0)",
    "return len(numbers)",
)


def _sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n))


def _count(rng: random.Random) -> tuple[str, dict[str, str], dict[str, Any]]:
    levels = ("INFO", "WARN", "ERROR")
    lines = [
        f"2026-12-{rng.randint(1, 28):02d} {rng.choice(levels)} {_sentence(rng, 4)}"
        for _ in range(rng.randint(20, 60))
    ]
    answer = str(sum("ERROR" in line for line in lines))
    prompt = (
        "Count the lines of logs/app.log that contain the word ERROR and write that number "
        "(only the number) to the file answer.txt."
    )
    return (
        prompt,
        {"logs/app.log": "\n".join(lines) + "\n"},
        {"path": "answer.txt", "equals": answer},
    )


def _find(rng: random.Random) -> tuple[str, dict[str, str], dict[str, Any]]:
    names = rng.sample(_WORDS, 12)
    paths = [f"docs/{'notes/' if i % 3 == 0 else ''}{n}.txt" for i, n in enumerate(names)]
    files = {p: "\n".join(_sentence(rng, 8) for _ in range(5)) + "\n" for p in paths}
    target = rng.choice(paths)
    files[target] += f"the code word is {rng.choice(_WORDS)}\n"
    prompt = (
        "One file under docs/ contains the phrase 'code word'. Write that file's path, relative "
        "to the workspace (like docs/example.txt), to the file answer.txt."
    )
    return prompt, files, {"path": "answer.txt", "equals": target}


def _make(rng: random.Random) -> tuple[str, dict[str, str], dict[str, Any]]:
    path = f"out/{rng.choice(_WORDS)}/{rng.choice(_WORDS)}.txt"
    line = _sentence(rng, 3)
    prompt = f"Create the file {path} (and its directories) containing exactly this line: {line}"
    return prompt, {"README": "Your workspace.\n"}, {"path": path, "equals": line}


def _fix(rng: random.Random) -> tuple[str, dict[str, str], dict[str, Any]]:
    visible = [rng.randint(-50, 99) for _ in range(rng.randint(4, 8))]
    hidden = [rng.randint(-50, 99) for _ in range(9)]
    files = {
        "sum.py": _SUM.format(body=rng.choice(_BUGS)),
        "numbers.txt": "\n".join(map(str, visible)) + "\n",
    }
    prompt = (
        "The program sum.py should print the sum of the integers in the file it is given (run "
        "it as: python3 sum.py numbers.txt), but what it prints is wrong. Fix sum.py."
    )
    check = {
        "program": "sum.py",
        "input": "\n".join(map(str, hidden)) + "\n",
        "equals": str(sum(hidden)),
    }
    return prompt, files, check


_MAKERS = {"count": _count, "find": _find, "make": _make, "fix": _fix}


class TerminalEnv(WorkspaceEnv):
    """Shell tasks with checkable end states; reward 1 when the end state is right.

    Constructor: as `tools.workspace.WorkspaceEnv` (`sandbox`, `limits`, `max_output_chars`).

    Example:
        >>> env = TerminalEnv(limits={"call_timeout_s": 10})
        >>> env.tool_names
        ('bash',)

        >>> tasks = TerminalEnv.load_tasks("train", seed=0, n=4)
        >>> [t.metadata["kind"] for t in tasks]
        ['count', 'find', 'make', 'fix']
        >>> sorted(tasks[0].metadata["workspace"].files)
        ['logs/app.log']
    """

    tool_names = ("bash",)
    system_prompt = (
        "You work in a Linux shell: run commands with the bash tool (the working directory is "
        "your workspace). Do the task, then reply with a short message without a tool call."
    )

    async def reward(self, task: Task, messages: list[Message]) -> float:
        check = task.metadata["check"]
        session = self.live_session()
        if "program" in check:
            return await self._program_right(task, check)
        res = checked(await session.exec(["cat", "--", check["path"]]))
        return float(res.status == "ok" and res.stdout.strip() == check["equals"])

    async def _program_right(self, task: Task, check: dict[str, Any]) -> float:
        """Run the model's program in a fresh fork of the task, on an input it never saw."""
        res = checked(await self.live_session().exec(["cat", "--", check["program"]]))
        if res.status != "ok":  # the model removed or broke its program
            return 0.0
        fresh = await self.fresh_fork(task)
        try:
            await fresh.write(check["program"], res.stdout)
            await fresh.write("hidden-input.txt", check["input"])
            out = checked(await fresh.exec(["python3", check["program"], "hidden-input.txt"]))
        finally:
            await fresh.close()
        return float(out.status == "ok" and out.stdout.strip() == check["equals"])

    @classmethod
    def load_tasks(
        cls, split: str = "train", seed: int = 0, *, n: int = 1000, kinds: Sequence[str] = KINDS
    ) -> list[Task]:
        """`n` tasks of `split` ("train" or "eval"), the kinds taking turns."""
        if split not in ("train", "eval"):
            raise ValueError(f"TerminalEnv.load_tasks: split is 'train' or 'eval', got {split!r}")
        if unknown := set(kinds) - set(KINDS):
            raise ValueError(f"unknown terminal task kinds {sorted(unknown)}; known: {KINDS}")
        if n < 1 or not kinds:
            raise ValueError("n must be >= 1 and kinds not empty")
        tasks = []
        for i in range(n):
            kind = kinds[i % len(kinds)]
            rng = random.Random(f"terminal/{split}/{seed}/{i}")
            prompt, files, check = _MAKERS[kind](rng)
            workspace = Workspace(files=files)  # one object per task: its key is hashed once
            tasks.append(
                Task(
                    id=f"terminal-{split}-{seed}-{i}",
                    prompt=prompt,
                    answer=check["equals"],
                    metadata={"kind": kind, "workspace": workspace, "check": check},
                )
            )
        return tasks
