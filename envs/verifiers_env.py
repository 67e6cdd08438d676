"""PrimeIntellect's `verifiers` environments, trained as they are: `env: {name: verifiers, tasks:
{id: my-env, args: {...}}}`.

`vf.load_environment(id, **args)` builds the environment (its module must be installed); its
dataset gives the tasks; its own rollout code plays each episode against the episode's
OpenAI-compatible endpoint (`AgentEnv`), so every call lands token-exactly in the trajectory; its
rubric gives the reward and its metrics go to `env_info`.

What does not map is refused when the environment loads, naming it (verifiers 0.4's v1 stack,
group-level rubrics, completion-style messages); a reward function that raises makes the episode
unscorable (NaN), where verifiers would score 0. What carries over and what does not:
docs/environments.md, "verifiers environments".
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
from collections.abc import Iterator, Sequence
from typing import Any

from agentgrpo import AgentEnv, Message, Task

try:
    import verifiers as vf
    from verifiers.clients import OpenAIChatCompletionsClient
except ImportError as e:  # the optional extra
    raise ImportError(
        "env 'verifiers' needs PrimeIntellect's verifiers package, v0 API (0.3.x): pip install "
        f"'agentgrpo[verifiers]' ({e})"
    ) from e

_loaded: dict[str, Any] = {}


def _key(env_id: str, args: dict[str, Any]) -> str:
    return json.dumps({"id": env_id, "args": args}, sort_keys=True, default=str)


def load(env_id: str, args: dict[str, Any] | None = None) -> Any:
    """The verifiers environment `vf.load_environment(env_id, **args)`, loaded once per process
    and checked to map (ValueError naming what does not)."""
    args = dict(args or {})
    key = _key(env_id, args)
    if key in _loaded:
        return _loaded[key]
    if not hasattr(vf, "Environment"):
        raise ValueError(
            f"verifiers {vf.__version__} has no v0 API (vf.Environment); this adapter runs v0 "
            "environments: pip install 'verifiers>=0.3.1,<0.4'"
        )
    env = vf.load_environment(env_id, **args)
    if not isinstance(env, vf.Environment):
        raise ValueError(
            f"verifiers env {env_id!r}: load_environment returned {type(env).__name__}, not a "
            "vf.Environment (SingleTurnEnv, MultiTurnEnv, ToolEnv, ...): v1 environments do not map"
        )
    if env.message_type != "chat":
        raise ValueError(
            f"verifiers env {env_id!r}: message_type {env.message_type!r}; only chat maps (the "
            "episode endpoint serves Chat Completions)"
        )
    if env.rubric.has_group_rewards:
        raise ValueError(
            f"verifiers env {env_id!r}: its rubric has group reward functions (they score a "
            "whole group at once), which do not map; score per rollout, or declare a Rubric "
            "with a group_hook on a subclass of VerifiersEnv"
        )
    if env.rubric.has_advantages:
        raise ValueError(
            f"verifiers env {env_id!r}: its rubric computes advantages; agentgrpo's advantage "
            "estimator (advantage.estimator) does that, so it does not map"
        )
    _loaded[key] = env
    return env


def _dataset(env: Any, env_id: str, split: str) -> Any:
    if split == "train":
        return env.get_dataset()
    if split == "eval":
        if env.eval_dataset is None and getattr(env, "eval_dataset_source", None) is None:
            raise ValueError(f"verifiers env {env_id!r} has no eval_dataset (split 'eval')")
        return env.get_eval_dataset()
    raise ValueError(f"verifiers env {env_id!r}: split must be 'train' or 'eval', got {split!r}")


# Reward functions that raised while this context scored (verifiers logs them and scores 0).
_failed: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar(
    "verifiers_failed", default=None
)


class _RewardErrors(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        failed = _failed.get()
        message = record.getMessage()
        if failed is not None and message.startswith("Error calling reward function"):
            failed.append(message)


logging.getLogger("verifiers").addHandler(_RewardErrors(level=logging.ERROR))


@contextlib.contextmanager
def _reward_errors() -> Iterator[list[str]]:
    failed: list[str] = []
    token = _failed.set(failed)
    try:
        yield failed
    finally:
        _failed.reset(token)


class VerifiersError(RuntimeError):
    """The verifiers environment's rollout or rubric failed: the episode ends as ENV_ERROR."""


class VerifiersEnv(AgentEnv):
    """A verifiers environment's episode: its rollout against this episode's endpoint, its rubric.

    Tasks (`load_tasks(split, seed, id=..., args=..., n=...)`) carry which environment plays them
    (`metadata["verifiers"]`) and their dataset row (`metadata["row"]`), so one instance plays
    any of them.

    Example:
        >>> tasks = VerifiersEnv.load_tasks("train", id="vf-math-python", n=100)  # doctest: +SKIP
    """

    def _env(self, task: Task) -> Any:
        spec = task.metadata.get("verifiers")
        if not isinstance(spec, dict):
            raise ValueError(
                f"task {task.id!r} names no verifiers environment (metadata['verifiers']); "
                "load tasks with VerifiersEnv.load_tasks"
            )
        return load(spec["id"], spec.get("args"))

    def tool_schemas(self) -> list[dict[str, Any]]:
        """The environment's tools in OpenAI's form (for the start-up template audit)."""
        if self.task is None:
            return []
        return [
            {
                "type": "function",
                "function": t.model_dump(include={"name", "description", "parameters"}),
            }
            for t in self._env(self.task).tool_defs or []
        ]

    async def run(self, client: Any, task: Task) -> float:
        env = self._env(task)
        row = dict(task.metadata["row"])
        state = await env.rollout(row, OpenAIChatCompletionsClient(client), self.model, {})
        if state.get("error") is not None:
            raise VerifiersError(f"the rollout failed: {state['error']!r}")
        with _reward_errors() as failed:
            await env.rubric.score_rollout(state)
        await env.rubric.cleanup(state)
        self.episode_info = {
            "verifiers": {
                "reward": state.get("reward"),
                "metrics": dict(state.get("metrics") or {}),
                "stop_condition": state.get("stop_condition"),
            }
        }
        if failed:  # verifiers scored them 0: here the episode is unscorable, never 0
            raise VerifiersError("; ".join(failed))
        return float(state["reward"])

    @classmethod
    def load_tasks(
        cls,
        split: str = "train",
        seed: int = 0,
        *,
        id: str,
        args: dict[str, Any] | None = None,
        n: int | None = None,
    ) -> Sequence[Task]:
        """The rows of the environment's dataset for `split` ("train": its dataset, "eval": its
        eval_dataset), the first `n` of them (all: None), in the dataset's order."""
        env = load(id, args)
        rows = _dataset(env, id, split)
        if n is not None:
            rows = rows.select(range(min(n, len(rows))))
        spec = {"id": id, "args": dict(args or {})}
        tasks = []
        for i, row in enumerate(rows):
            tasks.append(
                Task(
                    id=f"{id}/{split}/{row.get('example_id', i)}",
                    prompt=[Message.from_dict(m) for m in row["prompt"]],
                    answer=row.get("answer"),
                    metadata={"verifiers": spec, "row": row},
                )
            )
        return tasks
