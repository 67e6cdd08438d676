"""OpenAI's Chat Completions API in front of an `Engine`, recording every token per episode: the
episode core that the Responses API (`responses.py`) and Anthropic's Messages API
(`anthropic.py`) translate onto, so every call of every API lands in one record.

Per call: `chat.prompt_ids` (or, when the request continues the conversation this endpoint
answered, the previous prompt + the sampled ids + `chat.suffix_ids` of the new messages: the
text the client sends back is never re-tokenized), then `engine.generate`, then
`chat.parse_assistant`; the call (prompt ids, sampled ids, logprobs, weight version, finish
reason) is recorded in `EndpointEpisode.calls`. `EndpointEpisode.trajectory` joins the calls
into token-exact segments, or under `chat.trajectory_mode` "single" ends before a call whose
prompt does not extend the previous one. docs/agents.md, "From calls to a trajectory".
"""

from __future__ import annotations

import asyncio
import math
import secrets
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

from starlette.responses import JSONResponse, Response

from agentgrpo.agents.api_error import APIError, check_model
from agentgrpo.agents.chat_request import read_request
from agentgrpo.agents.streaming import chat_stream, stream_options
from agentgrpo.chat.format import ChatFormat, TemplateError
from agentgrpo.chat.parsers import ParseError
from agentgrpo.chat.trajectory import PromptDiverged, TrajectoryBuilder
from agentgrpo.deadlines import DeadlineExpired, Deadlines
from agentgrpo.engine.base import Completion, Engine, SamplingParams
from agentgrpo.rollout.seeds import episode_seed
from agentgrpo.types import Message, StopReason, Trajectory


@dataclass
class Call:
    """One chat completion of an episode, token-exact."""

    prompt_ids: list[int]
    token_ids: list[int]  # sampled, stop token included
    logprobs: list[float]
    weight_version: str | None
    finish_reason: str  # the engine's: stop | length | abort
    reply: Message
    malformed: list[ParseError] = field(default_factory=list)
    # (count, weight version) over the sampled ids (`Completion.token_version_runs`)
    version_runs: list[tuple[int, str | None]] = field(default_factory=list)


@dataclass
class EndpointEpisode:
    """The calls of one episode, and how it may sample.

    `fixed_sampling`: requests may not choose temperature or top_p (a training episode: the
    learner assumes the run's). `seed`: the episode's; call k samples with
    `episode_seed(seed, turn=k)` (the one seed rule, as a rollout's turn k), and a request's own
    seed is used only when the episode has none.
    `max_calls` / `max_tokens` bound the episode (calls; tokens after the first prompt); a call
    past them is a 400 with code `episode_limit`, and `cut` says which limit ended it.
    """

    id: str
    engine: Engine
    chat: ChatFormat
    params: SamplingParams  # defaults; params.max_new_tokens caps every call
    context_len: int | None = None
    fixed_sampling: bool = False
    seed: int | None = None
    max_calls: int | None = None
    max_tokens: int | None = None
    clock: Deadlines | None = None
    calls: list[Call] = field(default_factory=list)
    cut: tuple[StopReason, str] | None = None  # a limit or deadline that ended the episode
    deadline: str | None = None  # which deadline, when one did: turn | episode | step
    infra: tuple[StopReason, str] | None = None  # an engine failure (unscorable)
    reward: float | None = None  # given through the server's API (serve-policy)
    # The api_key of this episode's own routes (`/episodes/<id>/v1/...`): an agent holding it can
    # call the model in this episode and nothing else (not another episode, not the episode API).
    token: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    # what an API's translation keeps per episode (the Responses API's stored responses)
    api_state: dict[str, Any] = field(default_factory=dict)
    _history: list[Message] | None = None  # the last request's messages + the reply given
    _tools: list[dict[str, Any]] | None = None
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def messages(self) -> list[Message]:
        """The conversation as of the last call (its messages and the reply)."""
        return list(self._history or [])

    def trajectory(self, task_id: str) -> tuple[Trajectory, str | None]:
        """The calls as token sequences (loss mask 1 exactly on sampled ids), built by the
        trajectory builder (`agentgrpo.chat.trajectory`): one sequence while each call's prompt
        extends the previous prompt + completion, a new segment (its prompt the call's) where one
        does not, or at every call under "stepwise"; and None. Under `chat.trajectory_mode`
        "single": the sequence up to the last call that extends, and a message naming the call
        that does not. The record says COMPLETED with a NaN reward: the caller decides the ending
        and the reward (`dataclasses.replace`)."""
        tokens, kinds = TrajectoryBuilder(self.chat), Counter()
        turns = tool_calls = 0
        diverged = None
        for k, call in enumerate(self.calls, start=1):
            try:
                tokens.extend_to(call.prompt_ids)
            except PromptDiverged as e:
                diverged = (
                    f"call {k}'s prompt does not extend call {k - 1}'s prompt + completion "
                    f"(first difference at token {e.at} of {e.length}): the agent changed "
                    "its history, or the chat template renders it differently "
                    "(rollout.trajectory_mode=auto trains it as a new segment)"
                )
                break
            runs = call.version_runs or [(len(call.token_ids), call.weight_version)]
            tokens.sampled(call.token_ids, call.logprobs, runs)
            turns, tool_calls = k, tool_calls + len(call.reply.tool_calls or [])
            kinds.update(e.kind.value for e in call.malformed)
        errors = sum(kinds.values())
        return Trajectory.of_segments(
            tokens.segments(),
            task_id=task_id,
            messages=self.messages,
            stop_reason=StopReason.COMPLETED,
            num_turns=turns,
            tool_calls=tool_calls + errors,
            tool_errors=errors,
            tool_error_kinds=kinds,
            weight_versions=tokens.weight_versions,
            token_versions=tokens.token_versions,
        ), diverged

    def ending(
        self, diverged: str | None, otherwise: tuple[StopReason, str] = (StopReason.COMPLETED, "")
    ) -> tuple[StopReason, str]:
        """Why the episode ended: an engine failure (it explains whatever came after), else a call
        whose prompt diverged (`trajectory`'s message: the tokens after it are not one sequence),
        else the limit or deadline that cut it, else `otherwise` (the agent's own ending)."""
        if self.infra is not None:
            return self.infra
        if diverged is not None:
            return StopReason.ENV_ERROR, diverged
        return self.cut or otherwise

    async def complete(self, body: Any) -> dict[str, Any]:
        """One chat completion (the request body as parsed JSON); raises APIError."""
        req = read_request(body)
        async with self._lock:  # one call at a time: parallel calls would fork the sequence
            return await self._complete(req)

    async def _complete(self, req: dict[str, Any]) -> dict[str, Any]:
        k = len(self.calls) + 1
        self._check_open(k)
        messages, tools = req["messages"], req["tools"]
        _check_tool_choice(req["tool_choice"], tools)
        prompt = self._prompt(messages, tools)
        params = self._params(req, k, prompt)
        out = await self._generate(k, prompt, params)
        parse = bool(tools) and req["tool_choice"] != "none"
        turn = self.chat.parse_assistant(out.token_ids, parse_tools=parse, tools=tools)
        reply = turn.message
        if turn.errors:  # malformed calls come back as plain content (counted in the record)
            text = self.chat.parse_assistant(out.token_ids, parse_tools=False).message.content
            reply = reply.model_copy(update={"content": text})
        self.calls.append(
            Call(
                prompt,
                list(out.token_ids),
                list(out.logprobs),
                out.weight_version,
                out.finish_reason,
                reply,
                list(turn.errors),
                out.token_version_runs,
            )
        )
        self._history, self._tools = [*messages, reply], tools
        if out.finish_reason == "abort":
            self.infra = (StopReason.ABORTED, out.detail or "the engine aborted the request")
            raise APIError(
                503,
                f"the engine aborted the request: {out.detail}",
                kind="server_error",
                code="aborted",
            )
        return _completion_object(req["model"], prompt, out, reply)

    def _check_open(self, k: int) -> None:
        """APIError when the episode has ended, or when call `k` is past `max_calls` (which
        then ends it)."""
        if self.cut is not None or self.infra is not None:
            reason, detail = self.cut or self.infra  # type: ignore[misc]
            raise APIError(
                400, f"this episode has ended ({reason.value}: {detail})", code="episode_limit"
            )
        if self.max_calls is not None and k > self.max_calls:
            self.cut = (StopReason.MAX_TURNS, f"{self.max_calls} turns")
            raise APIError(400, f"this episode allows {self.max_calls} calls", code="episode_limit")

    async def _generate(self, k: int, prompt: list[int], params: SamplingParams) -> Completion:
        """Call `k`'s completion under the turn's deadline; an expired deadline cuts the episode
        (408), an engine failure marks it unscorable (503)."""
        if self.clock is not None:
            self.clock.start_turn(k)
        try:
            gen = self.engine.generate(prompt, params)
            return await (self.clock.run(gen) if self.clock is not None else gen)
        except DeadlineExpired as e:
            self.cut, self.deadline = (StopReason.TIMEOUT, str(e)), e.which
            raise APIError(408, f"deadline expired: {e}", code="timeout") from e
        except Exception as e:  # noqa: BLE001 - any engine failure is infrastructure: unscorable
            self.infra = (StopReason.ENGINE_ERROR, f"generate raised {type(e).__name__}: {e}")
            raise APIError(
                503,
                f"the engine failed: {type(e).__name__}: {e}",
                kind="server_error",
                code="engine_error",
            ) from e

    def _prompt(self, messages: list[Message], tools: list[dict[str, Any]] | None) -> list[int]:
        """The previous call's ids + the new messages' suffix when the request continues the
        conversation this endpoint answered (as the rollout continues an episode:
        `TrajectoryBuilder.continue_with`); else the template's rendering from scratch."""
        prev, last = self._history, self.calls[-1] if self.calls else None
        if (
            prev is not None
            and last is not None
            and tools == self._tools
            and len(messages) > len(prev)
            and messages[: len(prev)] == prev
            and last.token_ids
            and last.token_ids[-1] in self.chat.end_of_turn_ids
        ):
            tokens = TrajectoryBuilder(self.chat)
            tokens.open_segment(last.prompt_ids)
            tokens.sampled(last.token_ids, last.logprobs)
            try:
                tokens.continue_with(prev, messages[len(prev) :], tools)
                return tokens.token_ids
            except TemplateError:
                pass  # rendered from scratch below; the trajectory tells whether it still extends
        try:
            return self.chat.prompt_ids(messages, tools)
        except TemplateError as e:
            raise APIError(
                400, f"the chat template cannot render these messages: {e}", param="messages"
            ) from e

    def _params(self, req: dict[str, Any], k: int, prompt: list[int]) -> SamplingParams:
        base = self.params
        if self.fixed_sampling:
            for name, ours in (("temperature", base.temperature), ("top_p", base.top_p)):
                if req[name] is not None and not math.isclose(req[name], ours):
                    raise APIError(
                        400,
                        f"this episode samples with {name}={ours} (the run's "
                        f"rollout.{name}, which the learner assumes), not {req[name]}",
                        param=name,
                    )
        budget = min(x for x in (req["max_tokens"], base.max_new_tokens) if x is not None)
        if self.context_len is not None:
            if len(prompt) >= self.context_len:
                raise APIError(
                    400,
                    f"the prompt is {len(prompt)} tokens; this model's context is "
                    f"{self.context_len} tokens",
                    param="messages",
                    code="context_length_exceeded",
                )
            budget = min(budget, self.context_len - len(prompt))
        if self.max_tokens is not None and self.calls:
            used = len(prompt) - len(self.calls[0].prompt_ids)
            if self.max_tokens - used <= 0:
                self.cut = (StopReason.MAX_TOKENS, "token budget used up before the turn")
                raise APIError(
                    400,
                    f"this episode's token budget ({self.max_tokens}) is used up",
                    code="episode_limit",
                )
            budget = min(budget, self.max_tokens - used)
        seed = episode_seed(self.seed, turn=k) if self.seed is not None else req["seed"]
        stops = tuple(
            sorted(
                set(base.stop_token_ids)
                | set(self.chat.stop_token_ids)
                | set(self._stop_ids(req["stop"]))
            )
        )
        return replace(
            base,
            max_new_tokens=budget,
            seed=seed,
            stop_token_ids=stops,
            temperature=base.temperature if req["temperature"] is None else req["temperature"],
            top_p=base.top_p if req["top_p"] is None else req["top_p"],
        )

    def _stop_ids(self, stop: list[str]) -> list[int]:
        ids = []
        for s in stop:
            enc = self.chat.tokenizer.encode(s, add_special_tokens=False)
            if len(enc) != 1:
                raise APIError(
                    400,
                    f"stop string {s!r} is {len(enc)} tokens; only stop strings "
                    "that are one token of this model are supported (a longer one would "
                    "hide sampled text from the reply)",
                    param="stop",
                )
            ids.append(enc[0])
        return ids


def _check_tool_choice(choice: Any, tools: list[dict[str, Any]] | None) -> None:
    """A named tool_choice must name one of the tools; anything but none/auto needs tools."""
    if tools:
        names = {t["function"]["name"] for t in tools}
        if isinstance(choice, dict) and choice["function"]["name"] not in names:
            raise APIError(
                400,
                f"tool_choice names {choice['function']['name']!r}, which is not "
                f"among the tools {sorted(names)}",
                param="tool_choice",
            )
    elif choice not in (None, "none", "auto"):
        raise APIError(400, "tool_choice needs tools", param="tool_choice")


def _completion_object(
    model: str, prompt: list[int], out: Completion, reply: Message
) -> dict[str, Any]:
    """OpenAI's `chat.completion` object for a recorded call."""
    finish = (
        "length" if out.finish_reason == "length" else "tool_calls" if reply.tool_calls else "stop"
    )
    message: dict[str, Any] = {"role": "assistant", "content": reply.content or None}
    if reply.tool_calls:
        message["tool_calls"] = [tc.to_dict() for tc in reply.tool_calls]
    elif message["content"] is None:
        message["content"] = ""
    n_out = len(out.token_ids)
    return {
        "id": f"chatcmpl-{secrets.token_hex(12)}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": out.weight_version,
        "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
        "usage": {
            "prompt_tokens": len(prompt),
            "completion_tokens": n_out,
            "total_tokens": len(prompt) + n_out,
        },
    }


async def chat_answer(ep: EndpointEpisode, body: Any, served: str) -> Response:
    """A Chat Completions call: the reply as one object, or as OpenAI's chunks with `stream`."""
    model = check_model(body.get("model") if isinstance(body, dict) else None, served)
    stream = isinstance(body, dict) and body.get("stream") is True
    include_usage = stream_options(body) if isinstance(body, dict) else False
    reply = {**await ep.complete(body), "model": model}
    return chat_stream(reply, include_usage) if stream else JSONResponse(reply)
