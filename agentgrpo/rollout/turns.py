"""Rollouts: run multi-turn episodes against an engine, token-exact, many at once, bounded in time.

Each trajectory is its own asyncio task; a turn's request goes to the engine as soon as that
trajectory is ready (no lock-step batching of turn k across trajectories), so one trajectory's tool
latency overlaps with other trajectories' generation. Per turn:

    sampled = engine.generate(token_ids)          -> appended verbatim, loss_mask 1, engine logprobs
    message = chat.parse_assistant(sampled)       -> content + tool calls (+ malformed calls)
    env.step(message)                             -> tool/env messages, reward, terminated
    chat.suffix_ids(history, new messages)        -> appended, loss_mask 0, logprob 0

The token sequences are the trajectory builder's (`agentgrpo.chat.trajectory`): when the template
renders the history anew (`HistoryRewritten`: Qwen3's templates drop the reasoning of earlier
turns) and `chat.trajectory_mode` is "auto", or at every turn under "stepwise", the trajectory goes
on in a new segment whose prompt is `chat.prompt_ids` of the whole history; under "single" that
ends the episode with ENV_ERROR, which the start-up audit prevents. The record is sealed (frozen)
when the episode ends; `run_group` names it and scores the group (`Score`, joined by id).

Bounds (RolloutConfig): episodes in flight per step (`max_concurrent_trajectories`, each holds an
env), engine requests in flight (`max_concurrent_requests`), turns and tokens per trajectory, tool
calls per turn and tool output tokens (cut with a marker). Sync env methods, tools and verifiers
run in the `agentgrpo-user` worker threads (`agentgrpo.env.tool.to_user_thread`), async ones
natively.

Deadlines: a tool call overrunning `tool_timeout_s` is an error tool message (the model chose the
call and may retry). A turn (generation + env step), an episode, or the step's whole collection
overrunning its deadline ends that trajectory with `StopReason.TIMEOUT` and `stop_detail` naming
the deadline; what was generated so far is kept, the rest of the group and step go on. Timeouts,
like env and engine failures, are unscorable (reward NaN, left out of the group statistics): they
measure load, not the policy (see `StopReason.is_infra_error`). Sync env code cannot be killed: a
step that overruns keeps running in its thread, and its result is discarded.

Malformed tool calls (bad JSON, unknown tool, invalid arguments, too many calls, a tool that fails)
are answered with an error tool message, counted per kind (`Trajectory.tool_error_kinds`), and
optionally penalised (`tool_error_penalty` per error). A call cut off by the token limit (unclosed)
is counted and penalised too, though the cut turn ends the episode.

Failures end one trajectory, never the step: an env that raises, or returns values that break its
contract (`agentgrpo.env.base.reset_messages`, `agentgrpo.types.EnvStep.of`), ends it with ENV_ERROR
naming the problem; any exception of the engine (`EngineError` after its retries, or anything else a
client library raises) ends it with ENGINE_ERROR and the exception in `stop_detail`. Both are
unscorable (reward NaN, never 0).

Seeds: one rule, `agentgrpo.rollout.seeds.episode_seed`: a group's seed follows from the run's
and the group's draw, its members share the env seed and sample with their own seed per turn.
"""

from __future__ import annotations

import asyncio
import json
import math
import secrets
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from agentgrpo.chat.format import TRUNCATION_MARKER, ChatFormat, TemplateError, truncation_note
from agentgrpo.chat.parsers import ParsedTurn
from agentgrpo.chat.trajectory import TrajectoryBuilder
from agentgrpo.deadlines import DeadlineExpired, Deadlines
from agentgrpo.engine.base import Completion, Engine, SamplingParams
from agentgrpo.env.base import Env, ToolEnv, call_env, close_env, env_rubric, reset_messages
from agentgrpo.env.rubric import Rubric, score_group
from agentgrpo.env.runner import EpisodeRunner
from agentgrpo.env.tool import stuck_user_calls
from agentgrpo.rollout.seeds import episode_seed
from agentgrpo.types import EnvStep, Group, Message, Score, StopReason, Task, Trajectory


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


# ---------------------------------------------------------------------------------------------
# One episode


class EpisodeEnds(Exception):
    """Raised inside an episode by the part that ends it; `run_episode` turns it into the
    trajectory's stop reason and detail."""

    def __init__(self, reason: StopReason, detail: str = "") -> None:
        super().__init__(detail)
        self.reason, self.detail = reason, detail


class Episode:
    """One episode in progress: its env, what it has done so far, and the parts of a turn.

    Each method is one part of a turn and raises `EpisodeEnds` when that part ends the episode;
    `run_episode` strings them together and `finish` seals the record. The token sequences are the
    trajectory builder's (`agentgrpo.chat.trajectory`). User code (the env, the parser, the
    template's rendering of what the env said) is caught narrowly here: its failure ends this
    trajectory, never the step.
    """

    def __init__(
        self,
        env: Env,
        engine: Engine,
        chat: ChatFormat,
        task: Task,
        params: SamplingParams,
        limits: EpisodeLimits,
        context_len: int | None,
        clock: Deadlines,
    ) -> None:
        self.env, self.engine, self.chat, self.limits = env, engine, chat, limits
        self.task, self.context_len, self.clock = task, context_len, clock
        stops = tuple(sorted(set(params.stop_token_ids) | set(chat.stop_token_ids)))
        self.params = replace(params, stop_token_ids=stops)
        self.tools: list[dict[str, Any]] = []
        self.max_calls: int | None = None  # tool calls per turn the env runs (rendered); None = all
        self.tokens = TrajectoryBuilder(chat)
        self.messages = task.prompt_messages()  # until the first prompt: the task's own
        self.reward = 0.0
        self.turn_rewards: list[float] = []
        self.num_turns = self.tool_calls = self.tool_errors = self.truncated = 0
        self.error_kinds: Counter[str] = Counter()
        self.env_info: dict[str, Any] = {}
        self.deadline: str | None = None

    async def start(self, seed: int | None) -> None:
        """Reset the env and render the first prompt."""
        if isinstance(self.env, ToolEnv):
            self.env.set_tool_limits(
                timeout_s=self.limits.tool_timeout_s,
                max_calls_per_turn=self.limits.max_tool_calls_per_turn,
            )
            self.max_calls = self.env.max_tool_calls_per_turn
        try:
            first = await self.clock.run(
                call_env(self.env.reset, seed=seed, options={"task": self.task})
            )
            self.tools = self.env.tool_schemas()
        except DeadlineExpired:
            raise
        except Exception as e:  # noqa: BLE001 - env code is user code: its failure ends this episode
            raise EpisodeEnds(StopReason.ENV_ERROR, f"reset raised {type(e).__name__}: {e}") from e
        try:
            messages = reset_messages(first)
            token_ids = self.chat.prompt_ids(messages, self.tools)
        except ValueError as e:  # a broken reset value, or a TemplateError on the first prompt
            detail = f"first prompt: {e}" if isinstance(e, TemplateError) else str(e)
            raise EpisodeEnds(StopReason.ENV_ERROR, detail) from e
        self.messages = messages
        self.env_info = _as_json(first[1])  # reset's info (a workspace's checksum, ...)
        self.tokens.open_segment(token_ids)

    async def sample(self, turn: int) -> Completion:
        """The model's next turn: the engine continues the token ids as they are."""
        tokens = self.tokens
        budget = min(self.params.max_new_tokens, self.limits.max_tokens - tokens.used)
        if self.context_len is not None:
            budget = min(budget, self.context_len - len(tokens.token_ids))
        if budget <= 0:
            raise EpisodeEnds(StopReason.MAX_TOKENS, "token budget used up before the turn")
        self.clock.start_turn(turn)
        seed = episode_seed(self.params.seed, turn=turn)
        params = replace(self.params, max_new_tokens=budget, seed=seed)
        try:
            out: Completion = await self.clock.run(
                self.engine.generate(list(tokens.token_ids), params)
            )
        except DeadlineExpired:
            raise
        except Exception as e:  # noqa: BLE001 - EngineError or not (a client's TimeoutError, a CUDA
            # error), the engine failed: infrastructure, unscorable, and the rest of the step
            # goes on
            raise EpisodeEnds(
                StopReason.ENGINE_ERROR, f"generate raised {type(e).__name__}: {e}"
            ) from e
        self.num_turns = turn
        tokens.sampled(out.token_ids, out.logprobs, out.token_version_runs)
        if out.finish_reason == "abort":
            raise EpisodeEnds(StopReason.ABORTED, out.detail or "the engine aborted the request")
        return out

    def read(self, out: Completion, turn: int) -> ParsedTurn:
        """The sampled turn as a message and its tool calls; malformed calls are counted here.

        A turn cut by the token limit (no end-of-turn token sampled) ends the episode, as in verl
        and slime: its malformed calls (a cut call is unclosed) are counted, none runs, and the
        record keeps the text as the model wrote it.
        """
        try:
            parsed = self.chat.parse_assistant(
                out.token_ids, parse_tools=bool(self.tools), tools=self.tools
            )
        except Exception as e:  # noqa: BLE001 - a parser that raises (a bug) costs its episode only
            raise EpisodeEnds(
                StopReason.ENV_ERROR, f"the tool-call parser raised {type(e).__name__}: {e}"
            ) from e
        self.tool_calls += len(parsed.message.tool_calls or []) + len(parsed.errors)
        self.tool_errors += len(parsed.errors)
        self.error_kinds.update(err.kind.value for err in parsed.errors)
        if out.finish_reason == "length":
            self.messages.append(
                self.chat.parse_assistant(out.token_ids, parse_tools=False).message
            )
            raise EpisodeEnds(
                StopReason.MAX_TOKENS, out.detail or f"turn {turn} hit the token limit"
            )
        self.messages.append(parsed.message)
        return parsed

    async def act(self, parsed: ParsedTurn) -> list[Message]:
        """The env's answer to the turn (its messages, then one error message per malformed
        call); ends the episode when the env ends it."""
        if parsed.message.tool_calls or not parsed.errors:
            try:
                result = await self.clock.run(call_env(self.env.step, parsed.message))
            except DeadlineExpired:
                raise
            except Exception as e:  # noqa: BLE001 - env code is user code
                raise EpisodeEnds(
                    StopReason.ENV_ERROR, f"step raised {type(e).__name__}: {e}"
                ) from e
            try:
                step = EnvStep.of(result)
            except ValueError as e:
                raise EpisodeEnds(StopReason.ENV_ERROR, str(e)) from e
        else:  # only malformed calls: the env sees nothing, the model gets the errors
            step = EnvStep([])
        self.turn_rewards.append(float(step.reward))
        self.reward += float(step.reward)
        self.tool_errors += sum(step.tool_errors.values())
        self.error_kinds.update({kind.value: n for kind, n in step.tool_errors.items()})
        new = step.messages + [
            Message(role="tool", content=f"Error: malformed tool call: {err.reason}")
            for err in parsed.errors
        ]
        new = [self._cut_tool_output(m) for m in new]
        if step.stop_reason is not None:
            self.messages.extend(new)
            self.env_info = {**self.env_info, **_as_json(step.info)}
            raise EpisodeEnds(step.stop_reason)
        if not new:
            raise EpisodeEnds(
                StopReason.ENV_ERROR, "step returned no messages but did not end the episode"
            )
        return new

    def observe(self, new: list[Message]) -> None:
        """The env's messages as tokens the model did not sample (loss mask 0), or a new segment
        whose prompt is the template's rendering of the whole history, as `chat.trajectory_mode`
        says (`TrajectoryBuilder.continue_with`). The env's messages in a new segment's prompt do
        not count against `max_tokens` again (sampled tokens and the env's messages inside a
        segment do)."""
        try:
            self.tokens.continue_with(self.messages, new, self.tools, max_tool_calls=self.max_calls)
        except Exception as e:  # noqa: BLE001 - a TemplateError (HistoryRewritten under "single"
            # included), or a tokenizer's, on what the env said
            detail = (
                str(e)
                if isinstance(e, TemplateError)
                else f"rendering the env's messages raised {type(e).__name__}: {e}"
            )
            raise EpisodeEnds(StopReason.ENV_ERROR, detail) from e
        self.messages.extend(new)

    def finish(self, reason: StopReason, detail: str = "") -> Trajectory:
        """The episode's record, sealed: frozen from here on."""
        reward = self.reward
        if reason.is_infra_error:
            reward = math.nan
        elif self.tool_errors and self.limits.tool_error_penalty:
            reward -= self.limits.tool_error_penalty * self.tool_errors
        return Trajectory.of_segments(
            self.tokens.segments(),
            task_id=self.task.id,
            messages=self.messages,
            stop_reason=reason,
            stop_detail=detail,
            deadline=self.deadline,
            reward=reward,
            num_turns=self.num_turns,
            turn_rewards=self.turn_rewards,
            tool_calls=self.tool_calls,
            tool_errors=self.tool_errors,
            tool_error_kinds=self.error_kinds,
            tool_outputs_truncated=self.truncated,
            env_info=self.env_info,
            weight_versions=self.tokens.weight_versions,
            token_versions=self.tokens.token_versions,
        )

    def _cut_tool_output(self, m: Message) -> Message:
        """A tool message cut to `max_tool_output_bytes`, then to `max_tool_output_tokens`, each
        with the marker: the byte cut comes first so that what is tokenized is bounded whatever a
        tool answers (issue 42: a 50 MB answer cost +7.5 GB and 105 s to tokenize)."""
        limits = self.limits
        if m.role != "tool":
            return m
        text, cut = m.content, False
        if limits.max_tool_output_bytes is not None:
            text, omitted = cut_to_bytes(text, limits.max_tool_output_bytes)
            if omitted:
                text += truncation_note(limits.truncation_marker, omitted, "bytes")
                cut = True
        if limits.max_tool_output_tokens is not None:
            text, omitted = self.chat.truncate(
                text, limits.max_tool_output_tokens, limits.truncation_marker
            )
            cut = cut or bool(omitted)
        if not cut:
            return m
        self.truncated += 1
        return m.model_copy(update={"content": text})


def cut_to_bytes(text: str, max_bytes: int) -> tuple[str, int]:
    """`text` cut to its first `max_bytes` UTF-8 bytes (at a character boundary; lone surrogates
    count as their 3-byte encoding), and the number of bytes dropped. Only the kept part is ever
    encoded whole: cutting a 50 MB answer allocates about what the cut keeps."""
    if len(text) * 4 <= max_bytes:  # at most 4 bytes a character: it fits
        return text, 0
    head = text[: max_bytes + 1].encode("utf-8", "surrogatepass")
    if len(head) <= max_bytes:  # all of it: text has at most max_bytes characters
        return text, 0
    cut = max_bytes
    while head[cut] & 0xC0 == 0x80:  # a continuation byte: the character straddles the cut
        cut -= 1
    kept = head[:cut].decode("utf-8", "surrogatepass")
    return kept, _utf8_size(text) - cut


def _utf8_size(text: str) -> int:
    """The UTF-8 size of `text`, encoded a megabyte of characters at a time."""
    if text.isascii():
        return len(text)
    step = 1 << 20
    return sum(
        len(text[i : i + step].encode("utf-8", "surrogatepass")) for i in range(0, len(text), step)
    )


async def run_episode(
    env: Env,
    engine: Engine,
    chat: ChatFormat,
    task: Task,
    params: SamplingParams,
    *,
    seed: int | None = None,
    limits: EpisodeLimits = EpisodeLimits(),
    context_len: int | None = None,
    deadline: float | None = None,
) -> Trajectory:
    """Run one episode and return its Trajectory; never raises for env, engine or deadline failures
    (cancellation still propagates).

    `deadline` is an absolute `time.monotonic()` time by which the episode must end (the step's
    deadline); `limits` bound turns, tokens, tool calls and time. The reward is the env's own: an
    env's `rubric` is applied by `run_group`, once the whole group has ended. Turn k samples with
    `episode_seed(params.seed, turn=k)`. The record's `id` and `group_id` are empty: `run_group`
    names the trajectories of a group.

    With a `ToolEnv`, the chat template renders each assistant turn with only the calls the env
    ran (`max_tool_calls_per_turn`; see `ChatFormat.suffix_ids`), so a template without parallel
    calls (Llama 3.1) continues after an error message for the extra ones; a turn the template
    still cannot render ends the episode with ENV_ERROR, which `agentgrpo check-template` reports
    before training.
    """
    clock = Deadlines(limits.turn_timeout_s, limits.episode_timeout_s, deadline)
    episode = Episode(env, engine, chat, task, params, limits, context_len, clock)
    try:
        await episode.start(seed)
        for turn in range(1, limits.max_turns + 1):
            completion = await episode.sample(turn)
            parsed = episode.read(completion, turn)
            new_messages = await episode.act(parsed)
            episode.observe(new_messages)
        return episode.finish(StopReason.MAX_TURNS, f"{limits.max_turns} turns")
    except EpisodeEnds as end:
        return episode.finish(end.reason, end.detail)
    except DeadlineExpired as e:
        episode.deadline = e.which  # "turn" | "episode" | "step"
        return episode.finish(StopReason.TIMEOUT, str(e))


def _as_json(info: dict[str, Any]) -> dict[str, Any]:
    """An ending step's `info` (the env's own: why an answer scored 0, test results, ...) as JSON
    values for trajectories.jsonl (anything else as its `str`); EpisodeEnds (ENV_ERROR) when it
    cannot be (a circular reference, a value whose `str` raises)."""
    try:
        return json.loads(json.dumps(info, default=str, skipkeys=True)) if info else {}
    except Exception as e:  # noqa: BLE001 - the values are user objects: any of them may fail
        raise EpisodeEnds(
            StopReason.ENV_ERROR, f"step's info cannot be kept as JSON ({type(e).__name__}: {e})"
        ) from e


def _empty_trajectory(
    task: Task, reason: StopReason, detail: str, deadline: str | None = None
) -> Trajectory:
    return Trajectory(
        task_id=task.id,
        token_ids=(),
        loss_mask=(),
        logprobs=(),
        prompt_len=0,
        messages=task.prompt_messages(),
        stop_reason=reason,
        stop_detail=detail,
        deadline=deadline,  # type: ignore[arg-type]
    )


# ---------------------------------------------------------------------------------------------
# Groups and steps


class BoundedEngine:
    """An Engine that lets at most `limit` requests of this process reach `engine` at once.

    The bound keeps a remote server's queue (and our open connections) small when thousands of
    trajectories are in flight; requests over it wait here, inside their turn's deadline.
    """

    def __init__(self, engine: Engine, limit: int) -> None:
        self.engine = engine
        self._slots = asyncio.Semaphore(limit)

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
        async with self._slots:
            return await self.engine.generate(prompt_ids, params)

    async def update_weights(self, weights: Any, *, version: str) -> None:
        await self.engine.update_weights(weights, version=version)


async def _run_new_env(
    env_factory: Callable[[], Env],
    engine: Engine,
    chat: ChatFormat,
    task: Task,
    params: SamplingParams,
    limits: EpisodeLimits,
    **kwargs: Any,
) -> tuple[Trajectory, Rubric | None, str]:
    """One episode on a new env: its record, the env's rubric, and what closing the env said.

    With a rubric the reward waits for the group (`score_group`), and the episode runs without
    the tool-error penalty (the rubric's reward gets it). An env that runs its own episodes
    (`EpisodeRunner`: an AgentEnv) is handed the episode. The env is closed once the episode has
    ended, whatever ended it (cancellation included); a `close` that fails is noted, and the
    episode's outcome stands.
    """
    try:
        env = env_factory()
    except Exception as e:  # noqa: BLE001 - the env's constructor is user code
        detail = f"creating the env raised {type(e).__name__}: {e}"
        return _empty_trajectory(task, StopReason.ENV_ERROR, detail), None, ""
    try:
        try:
            rubric = env_rubric(env)
        except Exception as e:  # noqa: BLE001 - a rubric property is user code
            detail = f"the env's rubric: {type(e).__name__}: {e}"
            traj, rubric = _empty_trajectory(task, StopReason.ENV_ERROR, detail), None
        else:
            if rubric is not None:
                limits = limits.model_copy(update={"tool_error_penalty": 0.0})
            if isinstance(env, EpisodeRunner):
                run = env.run_own_episode(engine, chat, task, params, limits=limits, **kwargs)
            else:
                run = run_episode(env, engine, chat, task, params, limits=limits, **kwargs)
            traj = await run
    finally:
        problem = await close_env(env)
    return traj, rubric, problem or ""


async def _acquire(slots: asyncio.Semaphore, deadline: float | None) -> bool:
    """Wait for an episode slot until the step's deadline; False when the deadline passed first.
    Only this wait is timed here: an episode ends on its own deadlines (`run_episode`)."""
    wait = None if deadline is None else max(0.0, deadline - time.monotonic())
    try:
        await asyncio.wait_for(slots.acquire(), wait)
    except asyncio.TimeoutError:
        return False
    return True


async def run_group(
    env_factory: Callable[[], Env],
    engine: Engine,
    chat: ChatFormat,
    task: Task,
    group_size: int,
    params: SamplingParams,
    *,
    seed: int | None = None,
    group_id: str | None = None,
    limits: EpisodeLimits = EpisodeLimits(),
    context_len: int | None = None,
    deadline: float | None = None,
    slots: asyncio.Semaphore | None = None,
    on_done: Callable[[Trajectory, Score], None] | None = None,
) -> Group:
    """Sample `group_size` trajectories of one task concurrently, all from the same env seed, and
    score them.

    Member i samples with `episode_seed(params.seed, member=i, turn=k)` on turn k, so members
    differ; the env seed is shared so all members start from the same state. `seed=None` draws
    one env seed for the whole group (from the OS), never one per member. `slots` bounds the
    episodes in flight (shared by all groups of a step); `deadline` is the step's absolute
    deadline, which also bounds scoring. Member i's record is sealed with id `<group_id>/<i>`.
    Its `Score` is its own reward, or, when the env has a `rubric`, the rubric's once all members
    have ended (`agentgrpo.env.rubric.score_group`); `on_done(trajectory, score)` is called as each
    has one.
    """
    gid = group_id or task.id
    rubrics: list[Rubric | None] = [None] * group_size
    if seed is None:  # each env would seed itself from the OS: members would start apart
        seed = secrets.randbits(32)

    async def one(i: int) -> Trajectory:
        p = replace(params, seed=episode_seed(params.seed, member=i), session_id=f"{gid}/{i}")
        start, problem = time.monotonic(), ""
        if slots is None or await _acquire(slots, deadline):
            try:
                traj, rubrics[i], problem = await _run_new_env(
                    env_factory,
                    engine,
                    chat,
                    task,
                    p,
                    limits,
                    seed=seed,
                    context_len=context_len,
                    deadline=deadline,
                )
            finally:
                if slots is not None:
                    slots.release()
        else:
            detail = "step deadline expired before the episode started"
            traj = _empty_trajectory(task, StopReason.TIMEOUT, detail, deadline="step")
        traj = replace(  # sealed: named, timed, and what closing its env said
            traj,
            id=f"{gid}/{i}",
            group_id=gid,
            wall_s=round(time.monotonic() - start, 4),
            stop_detail="; ".join(x for x in (traj.stop_detail, problem) if x),
        )
        if on_done is not None and rubrics[i] is None:
            on_done(traj, Score(traj.id, traj.reward))
        return traj

    trajs = list(await asyncio.gather(*(one(i) for i in range(group_size))))
    by_rubric = [(t, r) for t, r in zip(trajs, rubrics, strict=True) if r is not None]
    scores = {t.id: Score(t.id, t.reward) for t in trajs}
    scores |= await _rubric_scores(by_rubric, task, limits.tool_error_penalty, deadline)
    group = Group(group_id=gid, task=task, trajectories=trajs, scores=scores)
    if on_done is not None:
        for t, _ in by_rubric:
            on_done(t, group.score(t))
    return group


async def _rubric_scores(
    by_rubric: list[tuple[Trajectory, Rubric]],
    task: Task,
    penalty: float,
    deadline: float | None,
) -> dict[str, Score]:
    """The rubric's scores of a group's members whose env has one, by trajectory id; those that
    ended with an infrastructure failure keep their own (NaN)."""
    scorable = [t for t, _ in by_rubric if not t.stop_reason.is_infra_error]
    if not scorable:
        return {}
    rubric = by_rubric[0][1]
    scored = await score_group(
        rubric, scorable, task, tool_error_penalty=penalty, deadline=deadline
    )
    return {s.trajectory_id: s for s in scored}


# Which env plays a task, and under which episode limits (a mixture of envs: agentgrpo.run.mixture).
EnvRoute = Callable[[Task], tuple[Callable[[], Env], EpisodeLimits]]


class GroupSampler:
    """Samples groups under bounds that every group in flight shares: at most
    `max_concurrent_trajectories` episodes and `max_concurrent_requests` engine requests at once,
    however many groups run (one step's in `collect`, several steps' in the asynchronous pipeline).
    `seed` is the run's: a group's seeds follow from it and the group's draw (`episode_seed`).
    `on_done(trajectory, score)` is called as each trajectory finishes (and is scored, when the env
    has a rubric). `route`, when given, picks each task's env and episode limits (else
    `env_factory` and `cfg`): a group is one task, so it never mixes envs."""

    def __init__(
        self,
        env_factory: Callable[[], Env],
        engine: Engine,
        chat: ChatFormat,
        cfg: RolloutConfig,
        *,
        seed: int = 0,
        context_len: int | None = None,
        on_done: Callable[[Trajectory, Score], None] | None = None,
        route: EnvRoute | None = None,
    ) -> None:
        self.env_factory, self.chat, self.cfg, self.seed = env_factory, chat, cfg, seed
        self.context_len, self.on_done, self.route = context_len, on_done, route
        self.params = cfg.sampling_params()
        self.slots = (
            None
            if cfg.max_concurrent_trajectories is None
            else asyncio.Semaphore(cfg.max_concurrent_trajectories)
        )
        self.engine = (
            engine
            if cfg.max_concurrent_requests is None
            else BoundedEngine(engine, cfg.max_concurrent_requests)
        )

    async def group(
        self,
        task: Task,
        *,
        draw: int,
        group_id: str | None = None,
        deadline: float | None = None,
    ) -> Group:
        """The group of `task` drawn `draw`-th (its place in the task stream, or in the task list
        of an evaluation): its members share the env seed `episode_seed(seed, draw=draw)` and
        sample from it (`run_group`). `group_id` defaults to `<draw>:<task id>`."""
        group_seed = episode_seed(self.seed, draw=draw)
        env_factory, limits = (
            self.route(task) if self.route is not None else (self.env_factory, self.cfg)
        )
        return await run_group(
            env_factory,
            self.engine,
            self.chat,
            task,
            self.cfg.group_size,
            replace(self.params, seed=group_seed),
            seed=group_seed,
            group_id=group_id or f"{draw}:{task.id}",
            limits=limits,
            context_len=self.context_len,
            deadline=deadline,
            slots=self.slots,
            on_done=self.on_done,
        )


async def collect(
    env_factory: Callable[[], Env],
    engine: Engine,
    chat: ChatFormat,
    tasks: Sequence[Task],
    cfg: RolloutConfig,
    *,
    seed: int = 0,
    draws: Sequence[int] | None = None,
    context_len: int | None = None,
    on_done: Callable[[Trajectory, Score], None] | None = None,
    route: EnvRoute | None = None,
) -> list[Group]:
    """All groups of one step, concurrently, within the config's bounds and step deadline.

    `seed` is the run's; `draws` name each task's group (training: the tasks' positions in the
    task stream; default: their index), which decides its seeds (`GroupSampler.group`).
    `on_done` is called as each trajectory finishes (and is scored, when the env has a rubric);
    `route` picks each task's env and limits (`GroupSampler`).
    """
    draws = range(len(tasks)) if draws is None else draws
    if len(draws) != len(tasks):
        raise ValueError(f"{len(tasks)} tasks but {len(draws)} draws")
    sampler = GroupSampler(
        env_factory,
        engine,
        chat,
        cfg,
        seed=seed,
        context_len=context_len,
        on_done=on_done,
        route=route,
    )
    deadline = None if cfg.step_timeout_s is None else time.monotonic() + cfg.step_timeout_s
    return list(
        await asyncio.gather(
            *(
                sampler.group(task, draw=d, deadline=deadline)
                for d, task in zip(draws, tasks, strict=True)
            )
        )
    )


def rollout_metrics(groups: Sequence[Group]) -> dict[str, float]:
    """What a step's (or an evaluation's) trajectories did, for metrics.jsonl.

    Means over the trajectories (NaN when there are none): `reward_mean` / `reward_std` (over the
    scorable ones), `turns_mean`, `tool_calls_mean`, `tool_errors_mean`, `response_tokens_mean`
    (sampled tokens); `sampled_tokens` in all. Counts:
    `stop/<reason>`: trajectories per StopReason; `timeout/<turn|episode|step>`: which deadline
    ended them; `tool_errors/<kind>`: malformed or failed tool calls per ToolErrorKind;
    `tool_outputs_truncated`: tool messages cut to `max_tool_output_tokens`; `unscorable`:
    trajectories with a NaN reward (left out of their group's statistics); `reward_parts/<name>`:
    the mean score of each rubric verifier over the trajectories it could score;
    `user_threads_stuck`: sync user calls that overran a deadline and still hold a worker thread now
    (process-wide, read when called; see `agentgrpo.env.tool.stuck_user_calls`).
    """
    scored = [(t, g.score(t)) for g in groups for t in g.trajectories]
    trajs = [t for t, _ in scored]
    rewards = [s.reward for _, s in scored if math.isfinite(s.reward)]

    def mean(xs: Sequence[float]) -> float:
        return float(sum(xs) / len(xs)) if xs else math.nan

    reward_mean = mean(rewards)
    out: dict[str, float] = {
        "reward_mean": reward_mean,
        "reward_std": math.sqrt(mean([(r - reward_mean) ** 2 for r in rewards])),
        "turns_mean": mean([t.num_turns for t in trajs]),
        "tool_calls_mean": mean([t.tool_calls for t in trajs]),
        "tool_errors_mean": mean([t.tool_errors for t in trajs]),
        "response_tokens_mean": mean([t.num_sampled for t in trajs]),
        "sampled_tokens": float(sum(t.num_sampled for t in trajs)),
    }
    parts: dict[str, list[float]] = {}

    def add(key: str, n: float = 1.0) -> None:
        out[key] = out.get(key, 0.0) + n

    for t, score in scored:
        add(f"stop/{t.stop_reason.value}")
        if t.stop_reason == StopReason.TIMEOUT:
            add(f"timeout/{t.deadline or 'episode'}")
        for kind, n in t.tool_error_kinds.items():
            add(f"tool_errors/{kind}", n)
        add("tool_outputs_truncated", t.tool_outputs_truncated)
        add("unscorable", float(score.unscorable))
        for name, v in score.parts.items():
            if math.isfinite(v):
                parts.setdefault(name, []).append(v)
    out.update({f"reward_parts/{name}": sum(vs) / len(vs) for name, vs in parts.items()})
    out["user_threads_stuck"] = float(stuck_user_calls())
    return out
