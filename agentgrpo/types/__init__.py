"""Typed records passed between the stages of the pipeline.

`Message`, `ToolCall` and `Task` are pydantic models because they come from users and from model
output (validated at the boundary; OpenAI-style dicts in and out); messages and tool calls are
frozen. The records the pipeline makes are frozen dataclasses, each written by one stage:
`Trajectory` (what an episode produced; the rollout), `Score` (its reward; the rubric),
`Advantage` (the training step) and `TrainingRow` (what the learner's loss reads). They are joined
by the trajectory's id, never by position. They hold long token sequences and are made thousands
of times per step, so they check their invariants explicitly (`Trajectory.check()`) or cheaply.
One module each: messages, episode (how a step and an episode end), trajectory, training, records
(what the frozen records share); import them from here.
"""

from __future__ import annotations

from agentgrpo.types.episode import (
    ENV_STOP_REASONS,
    EnvStep,
    InfrastructureError,
    StopReason,
    ToolErrorKind,
)
from agentgrpo.types.messages import Message, Role, Task, ToolCall
from agentgrpo.types.records import FrozenDict
from agentgrpo.types.training import Advantage, Score, TrainingRow
from agentgrpo.types.trajectory import EMPTY_SEGMENT, Group, Segment, Trajectory

__all__ = [
    "EMPTY_SEGMENT",
    "ENV_STOP_REASONS",
    "Advantage",
    "EnvStep",
    "FrozenDict",
    "Group",
    "InfrastructureError",
    "Message",
    "Role",
    "Score",
    "Segment",
    "StopReason",
    "Task",
    "ToolCall",
    "ToolErrorKind",
    "TrainingRow",
    "Trajectory",
]
