"""A mixture of environments (`envs:` in a run config): several envs in one run.

Each entry is any env (`name`, `kwargs`, `tasks` as for `env:`) with a `weight`, a `label` and its
own episode limits (`rollout:` over the run's). Every task is renamed `<label>/<its id>`, which is
how the run knows its env: `Mixture.route` gives the rollout that env and those limits per task,
and a group, being one task, never mixes envs.

Tasks are drawn by weight: the env of stream position p is a draw seeded by (seed, p), and the
task is the next of that env's own shuffled stream (the rule of a single env's `TaskStream`). So
the task at a position is a function of the position alone, and a checkpoint's data position
resumes the mixture exactly, as it does one env.

Metrics split by env as `env/<label>/<metric>` (docs/environments.md, "Mixtures", has the rest).
"""

from __future__ import annotations

import hashlib
import random
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from agentgrpo.checks.reward_audit import recheck_step
from agentgrpo.env.base import Env
from agentgrpo.rollout.episode import EpisodeLimits, RolloutConfig, rollout_metrics
from agentgrpo.run.config import ConfigError, MixtureEntry, RunConfig
from agentgrpo.types import Group, Task


class Stream(Protocol):
    """What a mixture needs of one env's task stream (`agentgrpo.run.train.TaskStream`)."""

    tasks: list[Task]

    def task_at(self, position: int) -> Task: ...


@dataclass
class Source:
    """One env of a mixture: its class, episode limits and tasks (ids prefixed by its label)."""

    label: str
    entry: MixtureEntry
    env_cls: type[Env]
    limits: RolloutConfig
    train: list[Task] = field(repr=False)
    eval: list[Task] = field(repr=False)

    def make_env(self) -> Env:
        return self.env_cls(**self.entry.kwargs)


def labels(entries: Sequence[MixtureEntry]) -> list[str]:
    """Each entry's label: its own, else its env's name (the class name for `module:Class`),
    numbered from the second entry that shares it (`calculator`, `calculator-2`). Two entries
    with one label are a ConfigError."""
    out: list[str] = []
    seen: Counter[str] = Counter()
    for e in entries:
        if e.label is not None:
            out.append(e.label)
            continue
        base = e.name.rpartition(":")[2].replace(".", "_")
        seen[base] += 1
        out.append(base if seen[base] == 1 else f"{base}-{seen[base]}")
    if repeated := sorted(label for label, n in Counter(out).items() if n > 1):
        raise ConfigError(f"envs: label {repeated} names two entries; give each its own label")
    return out


def _renamed(tasks: Sequence[Task], label: str) -> list[Task]:
    return [t.model_copy(update={"id": f"{label}/{t.id}"}) for t in tasks]


class Mixture:
    """The envs of a run's `envs:`, their tasks, and which env plays a task."""

    def __init__(self, sources: Sequence[Source], seed: int) -> None:
        self.sources = {s.label: s for s in sources}
        self.seed = seed

    @classmethod
    def load(cls, cfg: RunConfig, *, with_eval: bool) -> Mixture:
        """Each entry's env class and tasks (train; eval too when `with_eval`); a ConfigError
        names the entry when its env or tasks cannot be had."""
        assert cfg.envs is not None
        sources = []
        for i, (label, entry) in enumerate(zip(labels(cfg.envs), cfg.envs, strict=True)):
            try:
                env_cls = entry.env_class()
                train = entry.load_tasks(env_cls, "train", cfg.seed)
                evals = entry.load_tasks(env_cls, cfg.eval.split, cfg.seed) if with_eval else []
            except ConfigError as e:
                raise ConfigError(f"envs[{i}] ({label}): {e}") from None
            if not train:
                raise ConfigError(f"envs[{i}] ({label}): the env returned no training tasks")
            if with_eval and not evals:
                raise ConfigError(
                    f"envs[{i}] ({label}) has no tasks in split {cfg.eval.split!r} (eval.split)"
                )
            limits = RolloutConfig.model_validate({**cfg.rollout.model_dump(), **entry.rollout})
            sources.append(
                Source(
                    label, entry, env_cls, limits, _renamed(train, label), _renamed(evals, label)
                )
            )
        return cls(sources, cfg.seed)

    def source(self, task: Task) -> Source:
        label = task.id.partition("/")[0]
        if label not in self.sources:
            raise KeyError(f"task {task.id!r} belongs to no env of this mixture")
        return self.sources[label]

    def route(self, task: Task) -> tuple[Callable[[], Env], EpisodeLimits]:
        """The env that plays `task` and its episode limits (`agentgrpo.rollout.episode`)."""
        s = self.source(task)
        return s.make_env, s.limits

    def stream(self, make_stream: Callable[[list[Task], int], Stream]) -> MixtureStream:
        """The run's task stream: each env's own stream (`make_stream(tasks, seed)`), drawn by
        weight."""
        streams = {
            label: make_stream(s.train, _seed(self.seed, label))
            for label, s in self.sources.items()
        }
        weights = {label: s.entry.weight for label, s in self.sources.items()}
        return MixtureStream(streams, weights, self.seed)

    def eval_tasks(self, per_env: int | None) -> list[Task]:
        """The first `per_env` evaluation tasks of each env (all: None), env after env."""
        return [t for s in self.sources.values() for t in s.eval[:per_env]]

    async def recheck_step(self, groups: Sequence[Group], *, seed: int) -> tuple[list[Group], int]:
        """`recheck_step` env by env: each env's groups with its rubric and `audit` settings, in
        their order; returns the groups (flaky ones made unscorable) and how many were flaky."""
        out, flaky = list(groups), 0
        for label, s in self.sources.items():
            mine = [i for i, g in enumerate(groups) if self.source(g.task).label == label]
            if not mine:
                continue
            checked, n = await recheck_step(
                [groups[i] for i in mine], s.make_env, s.entry.audit, seed=seed
            )
            for i, g in zip(mine, checked, strict=True):
                out[i] = g
            flaky += n
        return out, flaky

    def metrics(self, groups: Sequence[Group], prefix: str = "") -> dict[str, float]:
        """Every rollout metric of each env's groups, as `env/<label>/<prefix><metric>`."""
        out: dict[str, float] = {}
        for label in self.sources:
            mine = [g for g in groups if self.source(g.task).label == label]
            if not mine:
                continue
            values = rollout_metrics(mine)
            values.pop("user_threads_stuck", None)  # process-wide, not the env's
            values["groups"] = float(len(mine))
            out.update({f"env/{label}/{prefix}{k}": v for k, v in values.items()})
        return out


def _seed(seed: int, label: str) -> int:
    return int(hashlib.sha256(f"mixture/{seed}/{label}".encode()).hexdigest()[:12], 16)


class MixtureStream:
    """Tasks of several envs in one seeded order, with `TaskStream`'s interface (`position`,
    `resume`, `next_position`, `task_at`, `take`): position p draws its env by weight (seeded by
    p), and takes that env's next task, counted over the positions before p."""

    def __init__(
        self, streams: dict[str, Stream], weights: dict[str, float], seed: int, position: int = 0
    ) -> None:
        self.streams, self.seed, self.position = streams, seed, position
        self.labels = list(streams)
        self.weights = [weights[label] for label in self.labels]
        self.resume: list[int] = []
        self.tasks = [t for s in streams.values() for t in s.tasks]
        self._drawn: list[tuple[str, int]] = []  # per position: (env, its index in that env)
        self._count: Counter[str] = Counter()

    def _draw(self, position: int) -> tuple[str, int]:
        while len(self._drawn) <= position:
            p = len(self._drawn)
            label = random.Random(f"mixture/{self.seed}/{p}").choices(self.labels, self.weights)[0]
            self._drawn.append((label, self._count[label]))
            self._count[label] += 1
        return self._drawn[position]

    def env_at(self, position: int) -> str:
        return self._draw(position)[0]

    def task_at(self, position: int) -> Task:
        label, index = self._draw(position)
        return self.streams[label].task_at(index)

    def next_position(self) -> int:  # `resume` is the pipeline's to admit first, as TaskStream's
        self.position += 1
        return self.position - 1

    def take(self, n: int) -> list[Task]:
        return [self.task_at(self.next_position()) for _ in range(n)]


def describe(mixture: Mixture) -> str:
    """The start-up line naming the envs, their weights and limits that differ from the run's."""
    parts = []
    for label, s in mixture.sources.items():
        own = ", ".join(f"{k}={v}" for k, v in s.entry.rollout.items())
        parts.append(
            f"{label} ({s.entry.name}, weight {s.entry.weight:g}{'; ' + own if own else ''})"
        )
    return "envs: " + "; ".join(parts)
