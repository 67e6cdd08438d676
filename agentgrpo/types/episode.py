"""How an env step and an episode end: `EnvStep` (Gymnasium's 5-tuple with typed fields),
`StopReason`, `ToolErrorKind`, and `InfrastructureError`, which ends an episode unscorable."""

from __future__ import annotations

import enum
import math
import numbers
from typing import Any

from agentgrpo.types.messages import Message


class InfrastructureError(RuntimeError):
    """A failure of infrastructure (inference engine, sandbox, verifier backend), never the policy's
    doing. Tools and envs raise it instead of answering the model; the rollout then ends the
    trajectory as unscorable (reward NaN, left out of its group's statistics), never scored 0."""


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
