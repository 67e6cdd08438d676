"""What bounds a rollout: an episode's limits (`EpisodeLimits`) and a step's sampling and
concurrency (`RolloutConfig`, which extends them)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from agentgrpo.chat.format import TRUNCATION_MARKER
from agentgrpo.engine.base import SamplingParams


class EpisodeLimits(BaseModel):
    """What bounds one episode: turns, tokens, tool calls and time (None = no limit). The
    rollout's part of `RolloutConfig`, which extends it with how a step samples."""

    model_config = ConfigDict(extra="forbid")

    max_turns: int = Field(4, ge=1, description="assistant turns per episode")
    max_tokens: int = Field(
        512, ge=1, description="tokens after the prompt per trajectory (sampled + env)"
    )
    turn_timeout_s: float | None = Field(
        None,
        gt=0,
        description="deadline of one turn, generation + env step; ends the episode with TIMEOUT "
        "(None = none)",
    )
    episode_timeout_s: float | None = Field(
        None, gt=0, description="deadline of one episode; ends it with TIMEOUT (None = none)"
    )
    tool_timeout_s: float | None = Field(
        None,
        gt=0,
        description="deadline of one tool call, answered with an error message "
        "(None = the env's tool_timeout_s)",
    )
    max_tool_calls_per_turn: int | None = Field(
        None,
        ge=1,
        description="tool calls run per turn, extra ones answered with an error "
        "(None = the env's own limit)",
    )
    max_tool_output_bytes: int | None = Field(
        65_536,
        ge=1,
        description="tool message content cut to this many UTF-8 bytes plus truncation_marker, "
        "before anything tokenizes it (None = no cut; raise it for tools whose long output the "
        "model should read)",
    )
    max_tool_output_tokens: int | None = Field(
        None,
        ge=1,
        description="tool message content (after the byte cut) cut to this many tokens plus "
        "truncation_marker (None = no cut)",
    )
    truncation_marker: str = Field(
        TRUNCATION_MARKER,
        description="appended to cut tool output; {omitted} becomes the number of bytes or tokens "
        "dropped and {unit} 'bytes' or 'tokens' (other braces stay as written)",
    )
    tool_error_penalty: float = Field(
        0.0, ge=0.0, description="subtracted from the reward per malformed or failed tool call"
    )


class RolloutConfig(EpisodeLimits):
    """How trajectories are sampled, bounded and timed (the episode's bounds: `EpisodeLimits`)."""

    group_size: int = Field(8, ge=1, description="trajectories per task (G)")
    tasks_per_step: int = Field(4, ge=1, description="tasks (groups) per optimizer step")
    max_new_tokens: int = Field(128, ge=1, description="tokens sampled per assistant turn")
    temperature: float = Field(
        1.0, ge=0.0, description="sampling temperature (the learner uses the same)"
    )
    top_p: float = Field(
        1.0,
        gt=0.0,
        le=1.0,
        description="nucleus sampling; rollout logprobs stay the full "
        "distribution's (both engines), so < 1 samples off the policy the loss assumes",
    )
    top_k: int = Field(-1, description="top-k sampling, -1 for all (logprobs: as for top_p)")
    max_concurrent_trajectories: int | None = Field(
        None,
        ge=1,
        description="episodes in flight at once in a step (None = all of them); each holds an env",
    )
    max_concurrent_requests: int | None = Field(
        None,
        ge=1,
        description="engine requests in flight at once (None = unbounded; the engine queues)",
    )
    episode_timeout_s: float = Field(
        600.0, gt=0, description="deadline of one episode; ends it with TIMEOUT"
    )
    step_timeout_s: float | None = Field(
        None,
        gt=0,
        description="deadline of a step's whole collection; unfinished episodes end with TIMEOUT "
        "(None = none)",
    )
    template_fallback: Literal["none", "keep_history"] = Field(
        "none",
        description="what to do when the chat template rewrites earlier turns: none = refuse, "
        "keep_history = continue the tokens the model saw (see agentgrpo check-template)",
    )
    trajectory_mode: Literal["single", "auto", "stepwise"] = Field(
        "auto",
        description="single = one token sequence per episode (a template that rewrites "
        "history is refused or needs keep_history); auto = a new segment (prompt: the re-rendered "
        "history) whenever the template rewrites history, so one sequence where it does not; "
        "stepwise = a new segment every turn",
    )
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="extra chat-template variables, e.g. {preserve_thinking: true}",
    )

    @model_validator(mode="after")
    def _one_answer_to_rewritten_history(self) -> RolloutConfig:
        if self.template_fallback == "keep_history" and self.trajectory_mode == "auto":
            self.trajectory_mode = "single"  # the explicit fallback decides what auto would
        if self.template_fallback == "keep_history" and self.trajectory_mode != "single":
            raise ValueError(
                "template_fallback=keep_history with trajectory_mode="
                f"{self.trajectory_mode}: choose one (keep_history continues one "
                "sequence, segments re-render it)"
            )
        return self

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
        )
