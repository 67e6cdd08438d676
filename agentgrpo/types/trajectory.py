"""What an episode produced: `Trajectory` and its `Segment`s, frozen once the rollout has built
them, and `Group`, one task's trajectories with their scores."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from agentgrpo.types.episode import StopReason
from agentgrpo.types.messages import Message, Task
from agentgrpo.types.records import _TOKENS, FrozenDict, _number, _set
from agentgrpo.types.training import Advantage, Score


@dataclass(frozen=True)
class Segment:
    """One training sequence of an episode: token ids exactly as the engine received and sampled
    them, with the invariant of `Trajectory.check()` (the first `prompt_len` ids are its prompt)."""

    token_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    logprobs: tuple[float, ...]
    prompt_len: int

    def __post_init__(self) -> None:
        _set(self, *_TOKENS)

    @property
    def num_sampled(self) -> int:
        return sum(self.loss_mask)

    @property
    def num_turns(self) -> int:
        """Sampled turns in this segment: its runs of loss_mask == 1 (a turn's sampled ids are
        contiguous, and the env's messages or template glue, mask 0, separate two turns)."""
        m = self.loss_mask
        return sum(1 for j, x in enumerate(m) if x and (j == 0 or not m[j - 1]))

    def check(self, name: str = "segment") -> None:
        n = len(self.token_ids)
        if not (n == len(self.loss_mask) == len(self.logprobs)):
            raise ValueError(
                f"{name}: token_ids/loss_mask/logprobs lengths differ: "
                f"{n}/{len(self.loss_mask)}/{len(self.logprobs)}"
            )
        if any(m not in (0, 1) for m in self.loss_mask):
            raise ValueError(f"{name}: loss_mask holds values other than 0/1")
        if any(self.loss_mask[: self.prompt_len]):
            raise ValueError(f"{name}: prompt tokens carry loss_mask 1")
        if any(lp != 0.0 for lp, m in zip(self.logprobs, self.loss_mask, strict=True) if not m):
            raise ValueError(f"{name}: a masked-out token has a non-zero logprob")

    def to_dict(self) -> dict[str, Any]:
        return {
            "token_ids": list(self.token_ids),
            "loss_mask": list(self.loss_mask),
            "logprobs": list(self.logprobs),
            "prompt_len": self.prompt_len,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Segment:
        return cls(d["token_ids"], d["loss_mask"], d["logprobs"], int(d["prompt_len"]))


EMPTY_SEGMENT = Segment((), (), (), 0)


@dataclass(frozen=True)
class Trajectory:
    """One episode as token ids, exactly as the model saw and produced them: the record the
    rollout seals when the episode ends, frozen from then on (sequences are tuples, mappings
    `FrozenDict`s; `dataclasses.replace` makes a new record, it never changes this one).

    Invariant (`check()`): `len(token_ids) == len(loss_mask) == len(logprobs)`; `loss_mask[i] == 1`
    exactly for tokens sampled by the policy, whose `logprobs[i]` are the engine's sampling
    logprobs; every other token (prompt, tool and env output, chat-template glue) has mask 0 and
    logprob 0.

    Segments: when the chat template renders the next prompt as something that does not extend
    the tokens sampled so far (`chat.trajectory_mode`, `agentgrpo.chat.trajectory`), the episode
    goes on in a new sequence. `token_ids`, `loss_mask`, `logprobs` and `prompt_len` are then the
    *last* segment and `earlier_segments` the closed ones, in order; `segments` lists them all.

    `reward` is the episode's own: what the env's steps returned, summed (an AgentEnv: what `run`
    returned), less the tool-error penalty; NaN when the episode could not be scored. What a run
    trains on is the trajectory's `Score` (its group's rubric, when the env has one) and its
    `Advantage`, separate records joined by `id` (unique in its group; `run_group` names it).
    """

    task_id: str
    token_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    logprobs: tuple[float, ...]
    prompt_len: int
    messages: tuple[Message, ...]
    stop_reason: StopReason
    reward: float = math.nan
    id: str = ""  # "<group_id>/<member>" once run_group has sealed it
    group_id: str = ""
    num_turns: int = 0
    turn_rewards: tuple[float, ...] = ()  # what each env.step returned
    tool_calls: int = 0
    tool_errors: int = 0
    tool_error_kinds: Mapping[str, int] = field(default_factory=FrozenDict)  # ToolErrorKind -> n
    tool_outputs_truncated: int = 0  # tool messages cut to max_tool_output_bytes or _tokens
    stop_detail: str = ""  # human-readable reason (the exception, the deadline that expired, ...)
    deadline: Literal["turn", "episode", "step"] | None = None  # which one ended it (TIMEOUT)
    # reset's info, updated by the ending step's (as JSON): why an answer scored 0, test results,
    # the workspace checksum of a session env
    env_info: Mapping[str, Any] = field(default_factory=FrozenDict)
    weight_versions: tuple[int, ...] = ()  # the weight versions that sampled its tokens, sorted
    # The version of every sampled token, run-length over the sampled tokens in episode order
    # (segment by segment): ((n1, v1), (n2, v2), ...) = the first n1 from v1, and so on. A version
    # the engine did not number is -1. The counts sum to `num_sampled`.
    token_versions: tuple[tuple[int, int], ...] = ()
    wall_s: float = 0.0  # from the episode's start to its end
    info: Mapping[str, Any] = field(default_factory=FrozenDict)  # the user's; no framework key
    earlier_segments: tuple[Segment, ...] = ()  # step-wise: the closed segments

    def __post_init__(self) -> None:
        _set(
            self,
            *_TOKENS,
            "messages",
            "turn_rewards",
            "weight_versions",
            "earlier_segments",
            stop_reason=StopReason(self.stop_reason),
            tool_error_kinds=FrozenDict(self.tool_error_kinds),
            env_info=FrozenDict(self.env_info),
            token_versions=tuple(tuple(r) for r in self.token_versions),
            info=FrozenDict(self.info),
        )

    @classmethod
    def of_segments(cls, segments: Sequence[Segment], **fields: Any) -> Trajectory:
        """A trajectory whose token sequences are `segments`, in order (none: no tokens)."""
        *earlier, last = segments or (EMPTY_SEGMENT,)
        return cls(
            token_ids=last.token_ids,
            loss_mask=last.loss_mask,
            logprobs=last.logprobs,
            prompt_len=last.prompt_len,
            earlier_segments=tuple(earlier),
            **fields,
        )

    @property
    def segments(self) -> tuple[Segment, ...]:
        """Every segment in order; the last is a view of the flat fields (no copy)."""
        return (
            *self.earlier_segments,
            Segment(self.token_ids, self.loss_mask, self.logprobs, self.prompt_len),
        )

    @property
    def num_sampled(self) -> int:
        return sum(self.loss_mask) + sum(s.num_sampled for s in self.earlier_segments)

    def sampled_turn_rewards(self) -> list[float]:
        """One reward per sampled turn, in order (what a turn-level estimator reads):
        `turn_rewards`, then 0.0 for each sampled turn no env.step answered (the last turn of an
        episode cut by a limit, a deadline or an error earned nothing)."""
        n = sum(s.num_turns for s in self.segments)
        if len(self.turn_rewards) > n:
            raise ValueError(
                f"trajectory {self.task_id!r}: {len(self.turn_rewards)} turn rewards but only "
                f"{n} sampled turns (runs of loss_mask == 1)"
            )
        return [*self.turn_rewards, *[0.0] * (n - len(self.turn_rewards))]

    def check(self) -> None:
        segments = self.segments
        for k, s in enumerate(segments):
            where = f" segment {k}" if len(segments) > 1 else ""
            s.check(f"trajectory {self.task_id!r}{where}")

    def to_dict(
        self, score: Score | None = None, advantage: Advantage | None = None
    ) -> dict[str, Any]:
        """The row of trajectories.jsonl: this record joined with its score and advantage (by id;
        a record of another trajectory is an error). Without a score the reward is the episode's
        own; without an advantage, `advantage` is null (not trained on)."""
        for other in (score, advantage):
            if other is not None and other.trajectory_id != self.id:
                raise ValueError(
                    f"{type(other).__name__} of {other.trajectory_id!r} joined to trajectory "
                    f"{self.id!r}"
                )
        score = score or Score(self.id, self.reward)
        return {
            "id": self.id,
            "task_id": self.task_id,
            "group_id": self.group_id,
            "token_ids": list(self.token_ids),
            "loss_mask": list(self.loss_mask),
            "logprobs": list(self.logprobs),
            "prompt_len": self.prompt_len,
            "messages": [m.to_dict() for m in self.messages],
            "stop_reason": self.stop_reason.value,
            "stop_detail": self.stop_detail,
            "deadline": self.deadline,
            "reward": _number(score.reward),
            "turn_rewards": list(self.turn_rewards),
            "env_reward": _number(score.env_reward),
            "reward_parts": {k: _number(v) for k, v in score.parts.items()},
            "reward_detail": score.detail,
            "reward_info": dict(score.info),
            "advantage": None if advantage is None else advantage.value,
            "turn_advantages": None if advantage is None else advantage.turn_list(),
            "num_turns": self.num_turns,
            "tool_calls": self.tool_calls,
            "tool_errors": self.tool_errors,
            "tool_error_kinds": dict(self.tool_error_kinds),
            "tool_outputs_truncated": self.tool_outputs_truncated,
            "weight_versions": list(self.weight_versions),
            "token_versions": [list(r) for r in self.token_versions],
            "wall_s": self.wall_s,
            "env_info": dict(self.env_info),
            "info": dict(self.info),
        } | ({"segments": [s.to_dict() for s in self.segments]} if self.earlier_segments else {})


@dataclass(frozen=True)
class Group:
    """The G trajectories sampled for one task from the same start state (same task, same seed),
    and their scores, joined by trajectory id (default: each trajectory's own reward)."""

    group_id: str
    task: Task
    trajectories: tuple[Trajectory, ...]
    scores: Mapping[str, Score] = field(default_factory=FrozenDict)

    def __post_init__(self) -> None:
        trajs = tuple(self.trajectories)
        ids = [t.id for t in trajs]
        if len(set(ids)) < len(ids):
            raise ValueError(f"group {self.group_id!r}: trajectory ids repeat: {ids}")
        scores = dict(self.scores) or {t.id: Score(t.id, t.reward) for t in trajs}
        if set(scores) != set(ids) or any(s.trajectory_id != k for k, s in scores.items()):
            raise ValueError(
                f"group {self.group_id!r}: scores for {sorted(scores)}, trajectories {ids}"
            )
        _set(self, trajectories=trajs, scores=FrozenDict(scores))

    def score(self, trajectory: Trajectory) -> Score:
        return self.scores[trajectory.id]

    @property
    def rewards(self) -> list[float]:
        return [self.scores[t.id].reward for t in self.trajectories]
