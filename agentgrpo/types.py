"""Typed records passed between the stages of the pipeline.

`Message`, `ToolCall` and `Task` are pydantic models because they come from users and from model
output (validated at the boundary; OpenAI-style dicts in and out). `Trajectory` and `Group` are
plain dataclasses: they are built by our own code, hold long token lists, and are created thousands
of times per step, so they skip validation and check their one invariant explicitly
(`Trajectory.check()`).
"""

from __future__ import annotations

import enum
import json
import math
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

    model_config = ConfigDict(extra="forbid")

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
                raise ValueError(f"tool call {fn.get('name')!r}: arguments are not JSON ({e})") from e
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

    model_config = ConfigDict(extra="forbid")

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
                raise ValueError(f"content parts of type {sorted({k for k in kinds if k != 'text'})}: only "
                                 "text parts are supported")
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
        and the other trajectories of the step, while the policy's own length is bounded (and scored)
        by MAX_TURNS and MAX_TOKENS. A tool call that overruns its deadline is different: the model
        chose the call, so it becomes an error tool message (`ToolErrorKind.TOOL_TIMEOUT`).
        """
        return self in (StopReason.ENV_ERROR, StopReason.ENGINE_ERROR, StopReason.ABORTED,
                        StopReason.TIMEOUT)


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
    TOO_MANY_CALLS = "too_many_calls"  # more calls in one turn than allowed; the extra ones were not run


@dataclass
class Trajectory:
    """One episode as token ids, exactly as the model saw and produced them.

    Invariant (`check()`): `len(token_ids) == len(loss_mask) == len(logprobs)`; `loss_mask[i] == 1`
    exactly for tokens sampled by the policy, whose `logprobs[i]` are the engine's sampling logprobs;
    every other token (prompt, tool and env output, chat-template glue) has mask 0 and logprob 0.
    `reward` is NaN when the episode could not be scored (infrastructure failure).
    """

    task_id: str
    token_ids: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    prompt_len: int
    messages: list[Message]
    stop_reason: StopReason
    reward: float = math.nan
    group_id: str = ""
    num_turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_error_kinds: dict[str, int] = field(default_factory=dict)  # ToolErrorKind value -> count
    stop_detail: str = ""  # human-readable reason (the exception, the deadline that expired, ...)
    reward_parts: dict[str, float] = field(default_factory=dict)
    weight_version: str | None = None
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def num_sampled(self) -> int:
        return sum(self.loss_mask)

    def check(self) -> None:
        n = len(self.token_ids)
        if not (n == len(self.loss_mask) == len(self.logprobs)):
            raise ValueError(
                f"trajectory {self.task_id!r}: token_ids/loss_mask/logprobs lengths differ: "
                f"{n}/{len(self.loss_mask)}/{len(self.logprobs)}"
            )
        if any(m not in (0, 1) for m in self.loss_mask):
            raise ValueError(f"trajectory {self.task_id!r}: loss_mask holds values other than 0/1")
        if any(self.loss_mask[: self.prompt_len]):
            raise ValueError(f"trajectory {self.task_id!r}: prompt tokens carry loss_mask 1")
        if any(lp != 0.0 for lp, m in zip(self.logprobs, self.loss_mask, strict=True) if not m):
            raise ValueError(f"trajectory {self.task_id!r}: a masked-out token has a non-zero logprob")

    def to_dict(self) -> dict[str, Any]:
        return {
            "task_id": self.task_id,
            "group_id": self.group_id,
            "token_ids": self.token_ids,
            "loss_mask": self.loss_mask,
            "logprobs": self.logprobs,
            "prompt_len": self.prompt_len,
            "messages": [m.to_dict() for m in self.messages],
            "stop_reason": self.stop_reason.value,
            "stop_detail": self.stop_detail,
            "reward": None if math.isnan(self.reward) else self.reward,
            "reward_parts": {k: None if math.isnan(v) else v for k, v in self.reward_parts.items()},  # strict JSON
            "num_turns": self.num_turns,
            "tool_calls": self.tool_calls,
            "tool_errors": self.tool_errors,
            "tool_error_kinds": self.tool_error_kinds,
            "weight_version": self.weight_version,
            "info": self.info,
        }


@dataclass
class Group:
    """The G trajectories sampled for one task from the same start state (same task, same seed)."""

    group_id: str
    task: Task
    trajectories: list[Trajectory]

    @property
    def rewards(self) -> list[float]:
        return [t.reward for t in self.trajectories]
