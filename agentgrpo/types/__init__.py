"""Typed records passed between the stages of the pipeline.

`Message`, `ToolCall` and `Task` are pydantic models because they come from users and from model
output (validated at the boundary; OpenAI-style dicts in and out); messages and tool calls are
frozen. The records the pipeline makes are frozen dataclasses, each written by one stage:
`Trajectory` (what an episode produced; the rollout), `Score` (its reward; the rubric),
`Advantage` (the training step) and `TrainingRow` (what the learner's loss reads). They are joined
by the trajectory's id, never by position. They hold long token sequences and are made thousands
of times per step, so they check their invariants explicitly (`Trajectory.check()`) or cheaply.
"""

from __future__ import annotations

import enum
import json
import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Role = Literal["system", "user", "assistant", "tool"]


class InfrastructureError(RuntimeError):
    """A failure of infrastructure (inference engine, sandbox, verifier backend), never the policy's
    doing. Tools and envs raise it instead of answering the model; the rollout then ends the
    trajectory as unscorable (reward NaN, left out of its group's statistics), never scored 0."""


class ToolCall(BaseModel):
    """One function call requested by the model.

    `arguments` is the decoded JSON object. OpenAI's wire format carries arguments as a JSON
    *string*; validation (`ToolCall(**d)`, `model_validate`, `from_dict`) accepts both and
    `to_dict` emits the string form.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = ""
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _openai_form(cls, d: Any) -> Any:
        if not (isinstance(d, dict) and "function" in d):
            return d
        # OpenAI: {"id", "type": "function", "function": {"name", "arguments": "<JSON string>"}}
        if d.get("type", "function") != "function":
            raise ValueError(f"tool call of type {d['type']!r}: only 'function' calls exist here")
        fn = d["function"]
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"tool call {fn.get('name')!r}: arguments are not JSON ({e})"
                ) from e
        return {"id": d.get("id") or "", "name": fn.get("name"), "arguments": args}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ToolCall:
        return cls.model_validate(d)

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": json.dumps(self.arguments)},
        }


class Message(BaseModel):
    """A chat message. Accepts and emits OpenAI-style dicts (`Message.from_dict`, `to_dict`).

    Validation anywhere (`Message(**d)`, `Task(prompt=[...])`, `model_validate`) takes what
    OpenAI's API and chat datasets write: `content: null` (an assistant turn that only calls tools)
    and content as a list of text parts (joined); tool calls in OpenAI's form; keys OpenAI sends
    empty (`refusal: null`, `annotations: []`, ...) are dropped. An unknown key with a value, or a
    non-text content part (an image), is an error that names it: text is all the model sees here.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    role: Role
    content: str = ""
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _openai_form(cls, d: Any) -> Any:
        if not isinstance(d, dict):
            return d
        known = cls.model_fields
        d = {k: v for k, v in d.items() if k in known or v not in (None, "", [], {})}
        content = d.get("content")
        if content is None:
            d["content"] = ""
        elif isinstance(content, list):
            kinds = [p.get("type") if isinstance(p, dict) else type(p).__name__ for p in content]
            if any(k != "text" for k in kinds):
                raise ValueError(
                    f"content parts of type {sorted({k for k in kinds if k != 'text'})}: only "
                    "text parts are supported"
                )
            d["content"] = "".join(p.get("text", "") for p in content)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any] | Message) -> Message:
        return d if isinstance(d, Message) else cls.model_validate(d)

    def to_dict(self) -> dict[str, Any]:
        """OpenAI-style dict; optional fields are present only when set."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [tc.to_dict() for tc in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


class Task(BaseModel):
    """One problem: a prompt (text or messages), an optional reference answer, free metadata."""

    model_config = ConfigDict(extra="forbid")

    id: str
    prompt: str | list[Message]
    answer: Any = None
    metadata: dict[str, Any] = Field(default_factory=dict)

    def prompt_messages(self) -> list[Message]:
        if isinstance(self.prompt, str):
            return [Message(role="user", content=self.prompt)]
        return list(self.prompt)


class StopReason(str, enum.Enum):
    """Why an episode ended. Values are stable strings written to trajectories.jsonl."""

    COMPLETED = "completed"  # the env terminated the episode (task answered)
    TRUNCATED = "truncated"  # the env truncated the episode (its own time limit)
    MAX_TURNS = "max_turns"  # the rollout's turn limit was reached
    MAX_TOKENS = "max_tokens"  # the trajectory's token budget or the model's context was used up
    PARSE_ERROR = "parse_error"  # the env ended the episode because the model's output was unusable
    TOOL_ERROR = "tool_error"  # the env ended the episode because of a tool failure
    TIMEOUT = "timeout"  # a turn, episode or step deadline expired (tool deadlines are tool errors)
    ENV_ERROR = "env_error"  # the env raised in reset/step (a bug, not a model failure)
    ENGINE_ERROR = "engine_error"  # the inference engine failed after retries (infrastructure)
    ABORTED = "aborted"  # the engine aborted the request (weight update, shutdown)

    @property
    def is_infra_error(self) -> bool:
        """Endings that say nothing about the policy: their reward is NaN (unscorable), never 0.

        TIMEOUT is one of them: how long a turn or an episode takes depends on engine load, queueing
        and the other trajectories of the step, while the policy's own length is bounded (and
        scored) by MAX_TURNS and MAX_TOKENS. A tool call that overruns its deadline is different:
        the model chose the call, so it becomes an error tool message
        (`ToolErrorKind.TOOL_TIMEOUT`).
        """
        return self in (
            StopReason.ENV_ERROR,
            StopReason.ENGINE_ERROR,
            StopReason.ABORTED,
            StopReason.TIMEOUT,
        )


class ToolErrorKind(str, enum.Enum):
    """Why a tool call failed. Each is an RL event: the model gets an error tool message, the
    trajectory counts it (`Trajectory.tool_error_kinds`) and a config may penalise it."""

    BAD_JSON = "bad_json"  # the call's payload is not valid JSON
    BAD_CALL = "bad_call"  # valid JSON, but not {"name": str, "arguments": object}
    UNCLOSED = "unclosed"  # the call was cut off (e.g. no closing tag)
    UNKNOWN_TOOL = "unknown_tool"  # no tool of that name
    INVALID_ARGUMENTS = "invalid_arguments"  # arguments fail the tool's schema
    TOOL_FAILED = "tool_failed"  # the tool raised
    TOOL_TIMEOUT = "tool_timeout"  # the tool overran its per-call deadline
    TOO_MANY_CALLS = (
        "too_many_calls"  # more calls in one turn than allowed; the extra ones were not run
    )


# Endings an env may choose (`EnvStep.stop_reason`); the infrastructure endings are the rollout's.
ENV_STOP_REASONS = frozenset(
    {StopReason.COMPLETED, StopReason.TRUNCATED, StopReason.PARSE_ERROR, StopReason.TOOL_ERROR}
)


class EnvStep(tuple):
    """What one `Env.step` returns: Gymnasium's 5-tuple `(messages, reward, terminated, truncated,
    info)`, with typed fields for what the framework reads.

    An env returns a plain 5-tuple, or an `EnvStep` when it has more to say. It unpacks like the
    5-tuple, so Gymnasium's tools keep working; the rollout converts a plain tuple once with
    `EnvStep.of`. The framework reads no key of `info`: that dict is the env's own (kept in
    `Trajectory.env_info`, over reset's info, when the step ends the episode).

    - `stop_reason`: why the episode ends, for a step that ends it. Default: COMPLETED when
      terminated, TRUNCATED when truncated. An env may say PARSE_ERROR or TOOL_ERROR instead;
      the infrastructure endings are the rollout's to decide.
    - `tool_errors`: calls this step answered with an error message, counted by `ToolErrorKind`.

    Example (an answer the env cannot read ends the episode as a parse error):
        >>> from agentgrpo.types import EnvStep, StopReason
        >>> step = EnvStep([], -1.0, True, False, {"raw": "??"}, stop_reason=StopReason.PARSE_ERROR)
        >>> step.stop_reason
        <StopReason.PARSE_ERROR: 'parse_error'>
    """

    messages: list[Message]
    reward: float
    terminated: bool
    truncated: bool
    info: dict[str, Any]
    stop_reason: StopReason | None
    tool_errors: dict[ToolErrorKind, int]

    def __new__(
        cls,
        messages: list[Message],
        reward: float = 0.0,
        terminated: bool = False,
        truncated: bool = False,
        info: dict[str, Any] | None = None,
        *,
        stop_reason: StopReason | str | None = None,
        tool_errors: dict[ToolErrorKind, int] | None = None,
    ) -> EnvStep:
        info = {} if info is None else info
        self = super().__new__(cls, (messages, reward, terminated, truncated, info))
        if stop_reason is None:
            stop_reason = (
                StopReason.COMPLETED if terminated else StopReason.TRUNCATED if truncated else None
            )
        elif not (terminated or truncated):
            raise ValueError(
                f"stop_reason={stop_reason!r} on a step that ends nothing (set "
                "terminated or truncated)"
            )
        elif stop_reason not in ENV_STOP_REASONS:
            raise ValueError(
                f"stop_reason={stop_reason!r}: an env may choose one of "
                f"{sorted(r.value for r in ENV_STOP_REASONS)}"
            )
        kinds = {
            ToolErrorKind(k): int(n) if isinstance(n, numbers.Integral) else n
            for k, n in (tool_errors or {}).items()
        }
        if any(not isinstance(n, numbers.Integral) or n < 0 for n in kinds.values()):
            raise ValueError(f"tool_errors must count with non-negative ints, got {tool_errors!r}")
        vars(self).update(
            messages=messages,
            reward=reward,
            terminated=terminated,
            truncated=truncated,
            info=info,
            stop_reason=None if stop_reason is None else StopReason(stop_reason),
            tool_errors=kinds,
        )
        return self

    @classmethod
    def of(cls, result: Any) -> EnvStep:
        """`result` of a user's `step` as an EnvStep: the conversion at the env boundary.

        Only the shape is checked here (every step, so kept cheap): a 5-tuple whose messages are
        a list of `Message`, a real reward and a dict info. Raises ValueError naming the problem;
        the rollout ends that trajectory with ENV_ERROR. `check_env` checks the rest once.
        """
        if isinstance(result, EnvStep):
            step = result
        elif isinstance(result, tuple) and len(result) == 5:
            step = cls(*result)
        else:
            raise ValueError(
                "step must return (messages, reward, terminated, truncated, info), "
                f"got {result!r:.200}"
            )
        if not (
            isinstance(step.messages, list) and all(isinstance(m, Message) for m in step.messages)
        ):
            hint = (
                "; OpenAI-style dicts convert with Message.from_dict"
                if isinstance(step.messages, list)
                else ""
            )
            raise ValueError(
                f"step's messages must be a list of Message, got {step.messages!r:.200}{hint}"
            )
        reward = step.reward
        if (
            isinstance(reward, bool)
            or not isinstance(reward, numbers.Real)
            or not math.isfinite(reward)
        ):
            raise ValueError(f"step's reward must be a finite number, got {reward!r:.100}")
        if not isinstance(step.info, dict):
            raise ValueError(f"step's info must be a dict, got {type(step.info).__name__}")
        return step


class FrozenDict(dict):
    """A dict that refuses every change: the mappings inside a finished record (tool-error counts,
    the env's info, reward parts). It reads, compares, pickles and serialises as a dict."""

    def _refuse(self, *_args: Any, **_kwargs: Any) -> Any:
        raise TypeError("a record's mapping is read-only: records do not change once made")

    __setitem__ = __delitem__ = __ior__ = _refuse  # type: ignore[assignment]
    clear = pop = popitem = setdefault = update = _refuse  # type: ignore[assignment]

    def __reduce__(self) -> tuple[Any, ...]:
        return (FrozenDict, (dict(self),))


def _set(record: Any, *as_tuples: str, **values: Any) -> None:
    """Normalise fields of a frozen record in its `__post_init__`: the fields named in `as_tuples`
    become tuples, the others take `values` (dicts as FrozenDict, say). The one place a frozen
    record is written."""
    values.update((name, tuple(getattr(record, name))) for name in as_tuples)
    for name, value in values.items():
        object.__setattr__(record, name, value)


_TOKENS = ("token_ids", "loss_mask", "logprobs")  # a token sequence's three parallel fields


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


def _number(x: float | None) -> float | None:
    """Strict JSON: NaN is written as null."""
    return None if x is None or math.isnan(x) else x


@dataclass(frozen=True)
class Score:
    """What a trajectory's reward is, made once its group has been scored: the env's own reward,
    or its rubric's (`agentgrpo.env.rubric.score_group`). Joined to its trajectory by id.

    `reward` is NaN when the trajectory cannot be scored (an infrastructure failure, a verifier
    that failed): it is then left out of its group's statistics and trained on by no row.
    """

    trajectory_id: str
    reward: float
    parts: Mapping[str, float] = field(default_factory=FrozenDict)  # each verifier's score
    detail: str = ""  # the rubric's notes: errors, verifier details, why it is unscorable
    env_reward: float | None = None  # the env's own reward, when a rubric replaced it
    # what verifiers recorded about their judgement, by verifier name, as JSON values (an LLM
    # judge's prompt and answer: agentgrpo.verify.judge)
    info: Mapping[str, Any] = field(default_factory=FrozenDict)

    def __post_init__(self) -> None:
        _set(
            self,
            reward=float(self.reward),
            parts=FrozenDict(self.parts),
            info=FrozenDict(self.info),
        )

    @property
    def unscorable(self) -> bool:
        return math.isnan(self.reward)


@dataclass(frozen=True)
class Advantage:
    """How much better than its group a trajectory did: what the training step gives it
    (`agentgrpo.run.train.assign_advantages`), joined to it by id. A trajectory not trained on
    (unscorable, or cut and masked) has none.

    `value` weighs every sampled token; under a turn-level estimator `per_turn` holds one
    advantage per sampled turn (the k-th run of loss_mask == 1 across the segments in order),
    used for that turn's tokens instead, and `value` is the outcome term.
    """

    trajectory_id: str
    value: float
    per_turn: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        per_turn = None if self.per_turn is None else tuple(float(a) for a in self.per_turn)
        _set(self, value=float(self.value), per_turn=per_turn)
        if not all(math.isfinite(a) for a in (self.value, *(per_turn or ()))):
            raise ValueError(
                f"trajectory {self.trajectory_id!r}: advantages must be finite, got "
                f"{self.value} / {per_turn}: a trajectory not trained on has no Advantage"
            )

    def turn_list(self) -> list[float] | None:
        return None if self.per_turn is None else list(self.per_turn)


@dataclass(frozen=True)
class TrainingRow:
    """One sequence the learner trains on: a segment of a trajectory that holds a sampled token,
    with what the loss needs. `logprobs` are the rollout's (pi_old unless the learner recomputes
    them), 0 off the mask; `token_advantages`, when set, weigh each token (a turn-level
    estimator), else `advantage` weighs every loss token. Checked when made: equal lengths, a mask
    of 0/1 with at least one 1 and none at position 0 (nothing predicts it), finite advantages.
    """

    trajectory_id: str
    group_id: str
    token_ids: tuple[int, ...]
    loss_mask: tuple[int, ...]
    logprobs: tuple[float, ...]
    advantage: float
    token_advantages: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        per_token = self.token_advantages
        _set(
            self,
            *_TOKENS,
            advantage=float(self.advantage),
            token_advantages=None if per_token is None else tuple(per_token),
        )
        n, name = len(self.token_ids), f"training row of {self.trajectory_id!r}"
        lengths = {n, len(self.loss_mask), len(self.logprobs)}
        if per_token is not None:
            lengths.add(len(per_token))
        if len(lengths) > 1:
            raise ValueError(
                f"{name}: token_ids/loss_mask/logprobs/token_advantages lengths differ"
            )
        if not set(self.loss_mask) <= {0, 1} or 1 not in self.loss_mask:
            raise ValueError(f"{name}: loss_mask must be 0/1 with at least one loss token")
        if self.loss_mask[0]:
            raise ValueError(f"{name}: token 0 carries loss but nothing predicts it")
        if not math.isfinite(self.advantage) or not all(map(math.isfinite, per_token or ())):
            raise ValueError(f"{name}: advantages must be finite (a dropped trajectory has no row)")

    @property
    def num_sampled(self) -> int:
        return sum(self.loss_mask)


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
