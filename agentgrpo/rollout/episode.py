"""The rollout's public names, importable from here as they always were: one episode turn by turn
(`agentgrpo.rollout.turns`), groups and steps (`agentgrpo.rollout.group`) and their bounds
(`agentgrpo.rollout.config`)."""

from agentgrpo.rollout.config import EpisodeLimits, RolloutConfig
from agentgrpo.rollout.group import (
    BoundedEngine,
    EnvRoute,
    GroupSampler,
    collect,
    rollout_metrics,
    run_group,
)
from agentgrpo.rollout.turns import Episode, EpisodeEnds, cut_to_bytes, run_episode

__all__ = [
    "BoundedEngine",
    "Episode",
    "EpisodeEnds",
    "EpisodeLimits",
    "EnvRoute",
    "GroupSampler",
    "RolloutConfig",
    "collect",
    "cut_to_bytes",
    "rollout_metrics",
    "run_episode",
    "run_group",
]
