"""One episode, turn by turn, token-exact: `run_episode` and the `Episode` whose parts it runs.

Per turn: the engine continues the token ids as they are (sampled ids appended verbatim, loss mask
1, the engine's logprobs); `chat.parse_assistant` reads the message and its tool calls; the env
steps; `TrajectoryBuilder.continue_with` appends the env's messages (loss mask 0) or opens a new
segment, as `chat.trajectory_mode` says. The record is sealed when the episode ends.

Contract: `run_episode` never raises for env, engine or deadline failures. User code that fails
ends its trajectory with ENV_ERROR, the engine with ENGINE_ERROR, a deadline with TIMEOUT, all
unscorable (reward NaN, never 0). Malformed tool calls are answered with an error tool message and
counted per kind. Tool output is cut in bytes before anything tokenizes it. Turn k samples with
`episode_seed(params.seed, turn=k)`. The whole story (turns, bounds, deadlines, failures):
docs/rollouts.md ("One episode, turn by turn") and docs/environments.md ("Why an episode ended").
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import replace
from typing import Any

from agentgrpo.chat.format import ChatFormat, TemplateError, truncation_note
from agentgrpo.chat.parsers import ParsedTurn
from agentgrpo.chat.trajectory import TrajectoryBuilder
from agentgrpo.deadlines import DeadlineExpired, Deadlines
from agentgrpo.engine.base import Completion, Engine, SamplingParams
from agentgrpo.env.base import Env, ToolEnv, call_env, reset_messages
from agentgrpo.rollout.config import EpisodeLimits
from agentgrpo.rollout.seeds import episode_seed
from agentgrpo.types import EnvStep, Message, StopReason, Task, Trajectory


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
