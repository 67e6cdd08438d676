"""Rollouts: one asyncio task per episode, groups of them per task, collected under deadlines."""

from agentgrpo.rollout.episode import collect, run_episode, run_group

__all__ = ["collect", "run_episode", "run_group"]
