"""`EpisodeRunner`: an env that runs its own episodes instead of the rollout's reset/step loop.

Most envs are driven turn by turn by the rollout (`agentgrpo.rollout.episode.run_episode`). An
env whose episode is someone else's loop (an agent written against the OpenAI client:
`agentgrpo.agents.agent_env.AgentEnv`) inherits this class and implements `run_own_episode`;
the rollout checks `isinstance(env, EpisodeRunner)` and hands it the episode. Inheriting is the
declaration: a method of that name alone does not make an env a runner.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the env layer does not import the layers above it
    from agentgrpo.chat.format import ChatFormat
    from agentgrpo.engine.base import Engine, SamplingParams
    from agentgrpo.rollout.episode import EpisodeLimits
    from agentgrpo.types import Task, Trajectory


class EpisodeRunner(abc.ABC):
    """Mixed into an `Env` whose episodes run themselves.

    `run_own_episode` takes what `run_episode` takes and returns the finished, sealed record; like
    `run_episode` it never raises for env, engine or deadline failures (they end the trajectory
    with their stop reason), and cancellation propagates. The rollout applies the env's `rubric`
    and closes the env afterwards, as for any env.

    Example (the declaration; `agentgrpo.agents.agent_env.AgentEnv` is a whole one):
        >>> from agentgrpo.env.base import Env
        >>> from agentgrpo.env.runner import EpisodeRunner
        >>> class Replay(Env, EpisodeRunner):
        ...     async def run_own_episode(self, engine, chat, task, params, *, limits, seed=None,
        ...                               context_len=None, deadline=None):
        ...         ...  # drive the engine, build the Trajectory with agentgrpo.chat.trajectory
        >>> isinstance(Replay(), EpisodeRunner)  # what the rollout checks
        True
    """

    @abc.abstractmethod
    async def run_own_episode(
        self,
        engine: Engine,
        chat: ChatFormat,
        task: Task,
        params: SamplingParams,
        *,
        limits: EpisodeLimits,
        seed: int | None = None,
        context_len: int | None = None,
        deadline: float | None = None,
    ) -> Trajectory:
        """Run one episode of `task` and return its record."""
