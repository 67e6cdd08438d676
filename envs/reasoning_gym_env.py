"""reasoning-gym's procedural generators as tasks, each scored by the generator's own scorer.

`env: {name: reasoning_gym, tasks: {datasets: {chain_sum: {}, basic_arithmetic: {weight: 2}}}}`
trains on a weighted mix of generators (100+ in reasoning-gym; a value's keys other than `weight`
are that generator's settings, e.g. `{max_terms: 3}`). The model answers inside
`<answer>...</answer>`, reasoning-gym's convention; the reward is the generator's `score_answer`,
in [0, 1] (partial credit where the generator gives it), and 0 when there is no answer tag.

Splits are stable: a question belongs to `eval` when `sha256(question) % 10 == 0`, to `train`
otherwise, so the two never share a question, whatever `n` each asks for (`reasoning_gym_tasks`,
which `python_math` uses too). The same seed gives the same tasks on every machine.

Tools: `env.kwargs.tools: [calculator]` or `[python]` (or both) makes it a tool-using env: the model
may call the calculator or a sandboxed Python before it answers. Without tools it is single-turn.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from typing import Any

import reasoning_gym
from reasoning_gym.factory import DATASETS as RG_DATASETS
from reasoning_gym.utils import SYSTEM_PROMPTS, extract_answer

from agentgrpo import EnvStep, Message, Task, ToolEnv, tool
from agentgrpo.verify.sandbox import Sandbox
from tools.calculator import calculator
from tools.python import PythonToolConfig, make_async_python_tool

_EVAL_BUCKET = 0  # sha256(question) % 10 == 0 -> eval
TOOLS = ("calculator", "python")


def _in_split(question: str, split: str) -> bool:
    bucket = int(hashlib.sha256(question.encode()).hexdigest(), 16) % 10
    return (bucket == _EVAL_BUCKET) == (split == "eval")


def _one_dataset(dataset: str, split: str, seed: int, n: int, config: dict[str, Any]) -> list[Task]:
    """`n` tasks of `split` from one generator: its stream of seed `seed`, filtered by split."""
    if dataset not in RG_DATASETS:
        raise ValueError(
            f"unknown reasoning-gym dataset {dataset!r}; known: {', '.join(sorted(RG_DATASETS))}"
        )
    # Generation is lazy per index; the stream is long enough for the eval bucket (1 in 10) to
    # fill n, and bounded so a tiny problem space cannot loop forever.
    limit = 40 * n + 1000
    try:
        ds = reasoning_gym.create_dataset(dataset, seed=seed, size=limit, **config)
    except TypeError as e:
        raise TypeError(f"reasoning-gym dataset {dataset!r}: bad option: {e}") from None
    tasks: list[Task] = []
    for i in range(limit):
        entry = ds[i]
        if not _in_split(entry["question"], split):
            continue
        meta = {"dataset": dataset, "split": split, "index": i, "entry": entry}
        tasks.append(
            Task(
                id=f"{dataset}-{seed}-{i}",
                prompt=entry["question"],
                answer=str(entry["answer"]),
                metadata=meta,
            )
        )
        if len(tasks) == n:
            break
    return tasks


def _shares(n: int, weights: dict[str, float]) -> dict[str, int]:
    """`n` split by weight, each share rounded by largest remainder (the shares add up to n)."""
    total = sum(weights.values())
    exact = {d: n * w / total for d, w in weights.items()}
    shares = {d: int(x) for d, x in exact.items()}
    by_remainder = sorted(weights, key=lambda d: (shares[d] - exact[d], d))
    for d in by_remainder[: n - sum(shares.values())]:
        shares[d] += 1
    return shares


def reasoning_gym_tasks(
    datasets: dict[str, dict[str, Any]] | Sequence[str], split: str, seed: int, n: int
) -> list[Task]:
    """`n` tasks of `split` ("train" or "eval") drawn from reasoning-gym generators by weight.

    `datasets` maps a generator's name to its settings, where `weight` (default 1) is the share of
    the tasks it gets and every other key goes to the generator (an unknown one is a TypeError
    naming it); a list of names weighs them equally. Each task's metadata holds the generator's
    entry (`entry`), which its scorer reads. Several generators are interleaved in an order fixed
    by the seed.
    """
    if split not in ("train", "eval"):
        raise ValueError(f"reasoning-gym tasks: split must be 'train' or 'eval', got {split!r}")
    if n < 1:
        raise ValueError("n must be >= 1")
    specs = {d: {} for d in datasets} if not isinstance(datasets, dict) else dict(datasets)
    if not specs:
        raise ValueError("datasets is empty: name at least one reasoning-gym generator")
    weights, configs = {}, {}
    for name, spec in specs.items():
        config = dict(spec or {})
        weight = config.pop("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not weight > 0:
            raise ValueError(f"datasets.{name}.weight must be a number > 0, got {weight!r}")
        weights[name], configs[name] = float(weight), config
    tasks = [
        t
        for name, share in _shares(n, weights).items()
        if share
        for t in _one_dataset(name, split, seed, share, configs[name])
    ]
    if len(specs) > 1:
        random.Random(f"reasoning_gym/{split}/{seed}").shuffle(tasks)
    return tasks


def score(task: Task, text: str) -> tuple[float, str | None]:
    """The generator's score of the answer in `text` (its last `<answer>` tag), and that answer;
    0 and None when there is none."""
    answer = extract_answer(text)
    if answer is None:
        return 0.0, None
    entry = task.metadata["entry"]
    scorer = reasoning_gym.get_score_answer_fn(entry["metadata"]["source_dataset"])
    return float(scorer(answer, entry)), answer


class ReasoningGymEnv(ToolEnv):
    """reasoning-gym tasks; reward = the generator's score of the `<answer>` the model gives.

    Constructor: `tools` (names from `TOOLS`: "calculator", "python"; none by default), `sandbox`
    and `python` (the python tool's sandbox and `PythonToolConfig`), `system_prompt` (default:
    reasoning-gym's own, which asks for `<answer>` tags).

    Example:
        >>> tasks = ReasoningGymEnv.load_tasks("train", seed=0, n=2, datasets=["chain_sum"])
        >>> env = ReasoningGymEnv(tools=["calculator"])
        >>> msgs, _ = env.reset(seed=0, options={"task": tasks[0]})
        >>> [m.role for m in msgs], sorted(env.get_tools())
        (['system', 'user'], ['calculator'])
    """

    def __init__(
        self,
        tools: Sequence[str] = (),
        sandbox: Sandbox | None = None,
        python: PythonToolConfig | dict[str, Any] | None = None,
        system_prompt: str | None = None,
    ) -> None:
        unknown = sorted(set(tools) - set(TOOLS))
        if unknown:
            raise ValueError(f"ReasoningGymEnv: unknown tools {unknown}; choose from {TOOLS}")
        chosen = []
        if "calculator" in tools:
            chosen.append(calculator)
        if "python" in tools:
            cfg = PythonToolConfig(**python) if isinstance(python, dict) else python
            chosen.append(tool(make_async_python_tool(sandbox, cfg)))
        self.tools = tuple(chosen)
        prompt = SYSTEM_PROMPTS["default"]
        if chosen:
            names = " and ".join(t.name for t in chosen)
            prompt += f"\nYou can call the {names} tool before you answer."
        self.system_prompt = system_prompt if system_prompt is not None else prompt
        self._answer: str | None = None  # the last scored answer, for the ending step's info

    async def step(self, action: Message) -> EnvStep:
        step = await super().step(action)
        if not step.terminated:
            return step
        return EnvStep(
            step.messages,
            step.reward,
            True,
            step.truncated,
            {"answer": self._answer},
            tool_errors=step.tool_errors,
        )

    def reward(self, task: Task, messages: list[Message]) -> float:
        value, self._answer = score(task, messages[-1].content)
        return value

    @classmethod
    def load_tasks(
        cls,
        split: str = "train",
        seed: int = 0,
        *,
        datasets: dict[str, dict[str, Any]] | Sequence[str] = ("chain_sum",),
        n: int = 2000,
    ) -> Sequence[Task]:
        """`n` tasks of `split` from `datasets` (see `reasoning_gym_tasks`)."""
        return reasoning_gym_tasks(datasets, split, seed, n)
