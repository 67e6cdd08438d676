"""OpenAI's Chat Completions API in front of an `Engine`, recording every token per episode: the
episode core that the Responses API (`agentgrpo.agents.responses`) and Anthropic's Messages API
(`agentgrpo.agents.anthropic`) translate onto, so every call of every API lands in one record.

An agent written against the OpenAI client needs only a `base_url`:
`http://HOST:PORT/episodes/<id>/v1`. Each episode has its own URL prefix, so concurrent episodes
never mix. Per call:

    chat.prompt_ids(messages, tools)      -> prompt ids (the chat template, as in training)
    engine.generate(prompt ids)           -> sampled ids + logprobs (token-in/token-out)
    chat.parse_assistant(sampled ids)     -> content + OpenAI tool_calls (malformed: plain content)

and the call (prompt ids, sampled ids, logprobs, weight version, finish reason) is recorded in
its episode (`EndpointEpisode.calls`). When a request's messages are the previous request's
messages plus the reply this endpoint gave plus new messages (the usual agent loop), its prompt is
the previous prompt + the sampled ids + `chat.suffix_ids(new messages)`, exactly as in
`agentgrpo.rollout.episode`: the text the client sends back is never re-tokenized. Any other
request is rendered from scratch; `EndpointEpisode.trajectory` then finds whether it still extends
the previous call token-exactly. When it does not (the agent trimmed or summarised its history, or
the template renders it anew), the episode goes on in a new segment, as in
`agentgrpo.rollout.episode`, under `chat.trajectory_mode` "auto" or "stepwise" ("stepwise": every
call renders from scratch and is a segment); under "single" the trajectory ends before that call,
naming it.

Requests: `messages`, `tools`, `tool_choice`, `temperature`, `top_p`, `max_tokens` /
`max_completion_tokens`, `stop` (strings that are one token each: stop strings spanning tokens
would hide sampled text), `n` (1 only), `seed`, `stream` (the recorded reply sent as events:
`agentgrpo.agents.streaming`). `tool_choice: "required"` or a named function are accepted
but not enforced: forcing a call would sample off the policy the loss assumes; an unknown name is
a 400. Fields of OpenAI's API that do not change sampling (`user`, `metadata`, `store`,
`parallel_tool_calls`, ...) are ignored; those that would (`frequency_penalty`, `logit_bias`,
`response_format`, ...) are refused unless they have their default value; a field OpenAI does not
know is refused, as OpenAI does. Errors have OpenAI's shape, `{"error": {"message", "type",
"param", "code"}}`, with a 4xx status for bad input and a 5xx one for an engine failure.

Server: starlette on uvicorn (well-kept, asynchronous, light: the app is a few routes and needs
no validation framework), set up in `agentgrpo.agents.server`: connections, request heads and
bodies bounded for every route (`ServerLimits`), the Host header checked on a loopback bind.
Binds 127.0.0.1 unless told otherwise; a token (`Authorization: Bearer`, which is what the OpenAI
client sends as its api_key, or `x-api-key`, Anthropic's) is then required, compared in constant
time. Each episode has a key of its own (`EndpointEpisode.token`), good only for its
`/episodes/<id>/v1/` routes (every API's). Request bodies, read for every route by
`PolicyEndpoint._json`: at most `max_body_bytes` (413), JSON at most `MAX_JSON_DEPTH` deep (400).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import re
import secrets
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from agentgrpo.agents import anthropic, responses
from agentgrpo.agents.api_error import APIError, check_model
from agentgrpo.agents.server import Auth, Effective, HostRule, ServerLimits, is_loopback, serve_app
from agentgrpo.agents.streaming import chat_stream, stream_options
from agentgrpo.chat.format import ChatFormat, TemplateError
from agentgrpo.chat.parsers import ParseError
from agentgrpo.chat.trajectory import PromptDiverged, TrajectoryBuilder
from agentgrpo.deadlines import DeadlineExpired, Deadlines
from agentgrpo.engine.base import Completion, Engine, SamplingParams
from agentgrpo.rollout.seeds import episode_seed
from agentgrpo.types import Message, StopReason, Trajectory

# Fields of OpenAI's Chat Completions request that do not change what is sampled: ignored.
IGNORED_FIELDS = frozenset(
    {
        "user",
        "metadata",
        "store",
        "parallel_tool_calls",
        "service_tier",
        "prompt_cache_key",
        "safety_identifier",
        "stream_options",
        "logprobs",
        "top_logprobs",
    }
)
# Fields of OpenAI's API that would change sampling: accepted only with their default value.
DEFAULT_ONLY = {
    "frequency_penalty": (0, 0.0),
    "presence_penalty": (0, 0.0),
    "logit_bias": ({},),
    "response_format": ({"type": "text"},),
    "modalities": (["text"],),
    "audio": (),
    "prediction": (),
    "web_search_options": (),
    "reasoning_effort": (),
    "verbosity": (),
    "functions": (),
    "function_call": (),
}
# Client input the server refuses with a 400 before it costs anything (issue 42): JSON nested past
# MAX_JSON_DEPTH (the body, and each tool call's arguments) would overflow Python's recursion in
# the template; seeds outside a signed 64-bit integer overflow the engines' generators; an
# episode id is 1-128 URL-safe characters (a longer one could not be reached once created).
MAX_JSON_DEPTH = 64
SEED_RANGE = (-(2**63), 2**63 - 1)
EPISODE_ID = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")
HONOURED = frozenset(
    {
        "model",
        "messages",
        "tools",
        "tool_choice",
        "temperature",
        "top_p",
        "max_tokens",
        "max_completion_tokens",
        "stop",
        "n",
        "seed",
        "stream",
    }
)


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
        req = _read_request(body)
        async with self._lock:  # one call at a time: parallel calls would fork the sequence
            return await self._complete(req)

    async def _complete(self, req: dict[str, Any]) -> dict[str, Any]:
        if self.cut is not None or self.infra is not None:
            reason, detail = self.cut or self.infra  # type: ignore[misc]
            raise APIError(
                400, f"this episode has ended ({reason.value}: {detail})", code="episode_limit"
            )
        k = len(self.calls) + 1
        if self.max_calls is not None and k > self.max_calls:
            self.cut = (StopReason.MAX_TURNS, f"{self.max_calls} turns")
            raise APIError(400, f"this episode allows {self.max_calls} calls", code="episode_limit")
        messages, tools = req["messages"], req["tools"]
        if tools:
            names = {t["function"]["name"] for t in tools}
            choice = req["tool_choice"]
            if isinstance(choice, dict) and choice["function"]["name"] not in names:
                raise APIError(
                    400,
                    f"tool_choice names {choice['function']['name']!r}, which is not "
                    f"among the tools {sorted(names)}",
                    param="tool_choice",
                )
        elif req["tool_choice"] not in (None, "none", "auto"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        prompt = self._prompt(messages, tools)
        params = self._params(req, k, prompt)
        if self.clock is not None:
            self.clock.start_turn(k)
        try:
            gen = self.engine.generate(prompt, params)
            out: Completion = await (self.clock.run(gen) if self.clock is not None else gen)
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
        finish = (
            "length"
            if out.finish_reason == "length"
            else "tool_calls"
            if reply.tool_calls
            else "stop"
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
            "model": req["model"],
            "system_fingerprint": out.weight_version,
            "choices": [
                {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
            ],
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": n_out,
                "total_tokens": len(prompt) + n_out,
            },
        }

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


def _read_request(body: Any) -> dict[str, Any]:
    """The request's fields, checked and normalised; APIError naming the first problem."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    for key, value in body.items():
        if key in HONOURED or key in IGNORED_FIELDS:
            continue
        if key in DEFAULT_ONLY:
            if value is None or value in DEFAULT_ONLY[key]:
                continue
            raise APIError(
                400,
                f"{key}={value!r:.100} is not supported by this endpoint: sampling "
                "stays the policy's",
                param=key,
                code="unsupported_parameter",
            )
        raise APIError(400, f"Unrecognized request argument supplied: {key}", param=key)
    if body.get("stream") not in (None, True, False):
        raise APIError(400, f"stream must be a boolean, got {body['stream']!r:.50}", param="stream")
    if body.get("n") not in (None, 1):
        raise APIError(
            400,
            f"n={body['n']!r}: only n=1 is supported (an episode is one conversation)",
            param="n",
            code="unsupported_parameter",
        )
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise APIError(400, "messages must be a non-empty list", param="messages")
    messages = []
    for i, m in enumerate(raw):
        if isinstance(m, dict) and m.get("role") == "developer":  # OpenAI's new name for system
            m = {**m, "role": "system"}
        if (
            isinstance(m, dict)
            and m.get("role") == "tool"
            and not isinstance(m.get("tool_call_id"), str)
        ):
            raise APIError(  # as OpenAI answers: a tool result must say which call it answers
                400,
                f"Missing required parameter: 'messages[{i}].tool_call_id'.",
                param=f"messages[{i}].tool_call_id",
                code="missing_required_parameter",
            )
        try:
            messages.append(Message.from_dict(m))
        except Exception as e:  # noqa: BLE001 - pydantic's error, or a non-dict: client input
            raise APIError(400, f"messages[{i}]: {e}", param=f"messages[{i}]") from e
        if any(nested_deeper(tc.arguments, MAX_JSON_DEPTH) for tc in messages[-1].tool_calls or []):
            raise APIError(
                400,
                f"messages[{i}]: tool call arguments nest deeper than {MAX_JSON_DEPTH} levels",
                param=f"messages[{i}]",
            )
    tools = body.get("tools") or None
    if tools is not None:
        ok = isinstance(tools, list) and all(
            isinstance(t, dict)
            and t.get("type", "function") == "function"
            and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str)
            for t in tools
        )
        if not ok:
            raise APIError(
                400,
                "tools must be a list of {type: function, function: {name, "
                "description, parameters}}",
                param="tools",
            )
    choice = body.get("tool_choice")
    if not (
        choice in (None, "none", "auto", "required")
        or (
            isinstance(choice, dict)
            and isinstance(choice.get("function"), dict)
            and isinstance(choice["function"].get("name"), str)
        )
    ):
        raise APIError(
            400,
            f"tool_choice={choice!r:.100}: expected none, auto, required or "
            "{type: function, function: {name}}",
            param="tool_choice",
        )
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not (
        isinstance(stop, list) and len(stop) <= 4 and all(isinstance(s, str) and s for s in stop)
    ):
        raise APIError(400, "stop must be a string or a list of at most 4 strings", param="stop")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    checks = (
        ("temperature", body.get("temperature"), lambda x: 0 <= x <= 2, "between 0 and 2"),
        ("top_p", body.get("top_p"), lambda x: 0 < x <= 1, "in (0, 1]"),
        ("max_tokens", max_tokens, lambda x: x >= 1 and x == int(x), "an integer >= 1"),
        (
            "seed",
            body.get("seed"),
            lambda x: x == int(x) and SEED_RANGE[0] <= x <= SEED_RANGE[1],
            "a signed 64-bit integer",
        ),
    )
    for name, value, good, what in checks:
        if value is not None and (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
            or not good(value)
        ):
            raise APIError(400, f"{name} must be {what}, got {value!r:.50}", param=name)
    model = body.get("model")
    return {
        "model": model if isinstance(model, str) else "policy",
        "messages": messages,
        "tools": tools,
        "tool_choice": choice,
        "stop": stop,
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "max_tokens": None if max_tokens is None else int(max_tokens),
        "seed": None if body.get("seed") is None else int(body["seed"]),
    }


async def chat_answer(ep: EndpointEpisode, body: Any, served: str) -> Response:
    """A Chat Completions call: the reply as one object, or as OpenAI's chunks with `stream`."""
    model = check_model(body.get("model") if isinstance(body, dict) else None, served)
    stream = isinstance(body, dict) and body.get("stream") is True
    include_usage = stream_options(body) if isinstance(body, dict) else False
    reply = {**await ep.complete(body), "model": model}
    return chat_stream(reply, include_usage) if stream else JSONResponse(reply)


# ---------------------------------------------------------------------------------------------
# The HTTP server


class PolicyEndpoint:
    """The episodes table and its HTTP app (`app`): per episode `/episodes/<id>/v1/` +
    `chat/completions`, `responses` (`agentgrpo.agents.responses`), `messages` (Anthropic's:
    `agentgrpo.agents.anthropic`) and `models`; `/v1/models`.

    With `new_episode` (serve-policy) it also serves the episode API: `POST /episodes` (body
    `{"id"?, "seed"?}`: starts one made by `new_episode(id, seed)`, answers its id and URLs),
    `GET /episodes/<id>/trajectory`, `POST /episodes/<id>/reward` (`{"reward": float}`),
    `DELETE /episodes/<id>`. With `hand_out` instead (a remote run: `agentgrpo.agents.remote`),
    `POST /episodes` hands out an episode that waits for an agent.

    Example:
        >>> endpoint = PolicyEndpoint(model="policy")
        >>> ep = endpoint.add(EndpointEpisode(id="ep1", engine=engine, chat=chat,
        ...                                   params=SamplingParams(max_new_tokens=64)))
        >>> async with endpoint.serving() as base:   # http://127.0.0.1:PORT
        ...     ...  # an OpenAI client at f"{base}/episodes/ep1/v1"
    """

    def __init__(
        self,
        *,
        model: str = "policy",
        token: str | None = None,
        max_body_bytes: int = 4 << 20,
        max_episodes: int = 10_000,
        new_episode: Callable[[str, int | None], EndpointEpisode] | None = None,
        limits: ServerLimits | None = None,
        hand_out: Callable[[float], Awaitable[tuple[EndpointEpisode, dict] | None]] | None = None,
        on_done: Callable[[EndpointEpisode], None] | None = None,
    ) -> None:
        self.model, self.token, self.max_body_bytes = model, token, max_body_bytes
        self.limits = limits or ServerLimits()
        self.effective: Effective | None = None  # the limits in effect while serving
        self._hosts = HostRule()
        self.max_episodes = max_episodes  # episodes held at once (POST /episodes: 429 past it)
        self.episodes: dict[str, EndpointEpisode] = {}
        self.new_episode = new_episode
        # a remote run's episodes (agentgrpo.agents.remote): POST /episodes hands out one that
        # waits for an agent (`hand_out(wait_s)`: the episode and what else the answer carries,
        # or None when none came in time), and a reward or DELETE tells `on_done` it is over
        self.hand_out, self.on_done = hand_out, on_done
        routes = [
            Route("/v1/models", self._models, methods=["GET"]),
            Route("/episodes/{eid}/v1/models", self._models, methods=["GET"]),
            Route("/episodes/{eid}/v1/chat/completions", self._chat, methods=["POST"]),
            Route("/episodes/{eid}/v1/responses", self._responses, methods=["POST"]),
            Route("/episodes/{eid}/v1/messages", self._messages, methods=["POST"]),
        ]
        if new_episode is not None or hand_out is not None:
            routes += [
                Route("/episodes", self._start, methods=["POST"]),
                Route("/episodes/{eid}/trajectory", self._trajectory, methods=["GET"]),
                Route("/episodes/{eid}/reward", self._reward, methods=["POST"]),
                Route("/episodes/{eid}", self._end, methods=["DELETE"]),
            ]
        self.app = Starlette(
            routes=routes,
            exception_handlers={
                404: lambda _r, _e: APIError(
                    404, "no such route; chat completions are at /episodes/<id>/v1/chat/completions"
                ).response(),
                405: lambda _r, _e: APIError(405, "method not allowed").response(),
                Exception: lambda _r, e: APIError(
                    500, f"internal error: {type(e).__name__}", kind="server_error"
                ).response(),
            },
        )
        self.app.add_middleware(
            Auth,
            token=token,
            hosts=self._hosts,
            episode_token=self._episode_token,
            error=_refusal,
        )

    def add(self, episode: EndpointEpisode) -> EndpointEpisode:
        if not EPISODE_ID.fullmatch(episode.id):
            raise ValueError(f"episode id {episode.id!r:.60}: expected {EPISODE_ID.pattern}")
        if episode.id in self.episodes:
            raise ValueError(f"episode {episode.id!r} exists already")
        self.episodes[episode.id] = episode
        return episode

    def remove(self, eid: str) -> EndpointEpisode | None:
        return self.episodes.pop(eid, None)

    def _episode_token(self, path: str) -> str | None:
        """The token of the episode whose OpenAI routes `path` is under (`/episodes/<id>/v1/`)."""
        parts = path.split("/", 4)
        if len(parts) < 5 or parts[1] != "episodes" or parts[3] != "v1":
            return None
        ep = self.episodes.get(parts[2])
        return None if ep is None else ep.token

    def _episode(self, request: Request) -> EndpointEpisode:
        eid = request.path_params["eid"]
        ep = self.episodes.get(eid)
        if ep is None:
            raise APIError(
                404,
                f"no episode {eid!r} (ended, or never started)",
                param="episode",
                code="episode_not_found",
            )
        return ep

    async def _json(self, request: Request) -> Any:
        size = int(request.headers.get("content-length") or 0)
        if size > self.max_body_bytes:
            raise APIError(413, f"request body over {self.max_body_bytes} bytes")
        body = bytearray()

        async def read() -> None:
            async for chunk in request.stream():
                body.extend(chunk)
                if len(body) > self.max_body_bytes:
                    raise APIError(413, f"request body over {self.max_body_bytes} bytes")

        try:
            await asyncio.wait_for(read(), self.limits.body_timeout_s)
        except asyncio.TimeoutError as e:
            raise APIError(
                408, f"the request body did not arrive within {self.limits.body_timeout_s} s"
            ) from e
        try:
            parsed = json.loads(body) if body else {}
        except (ValueError, RecursionError) as e:
            raise APIError(400, f"We could not parse the JSON body of your request ({e})") from e
        if nested_deeper(parsed, MAX_JSON_DEPTH):
            raise APIError(400, f"the JSON body nests deeper than {MAX_JSON_DEPTH} levels")
        return parsed

    async def _chat(self, request: Request) -> Response:
        return await self._call(request, chat_answer, APIError.response)

    async def _responses(self, request: Request) -> Response:
        return await self._call(request, responses.answer, APIError.response)

    async def _messages(self, request: Request) -> Response:
        return await self._call(request, anthropic.answer, anthropic.error_response)

    async def _call(
        self,
        request: Request,
        answer: Callable[[EndpointEpisode, Any, str], Awaitable[Response]],
        error: Callable[[APIError], Response],
    ) -> Response:
        """One call of an API: its episode, its body, and the API's answer (`answer(episode,
        body, served model name)`, which calls `EndpointEpisode.complete`), or its error."""
        try:
            ep = self._episode(request)
            return await answer(ep, await self._json(request), self.model)
        except APIError as e:
            return error(e)

    async def _models(self, request: Request) -> JSONResponse:
        if "eid" in request.path_params:
            try:
                self._episode(request)
            except APIError as e:
                return e.response()
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {"id": self.model, "object": "model", "created": 0, "owned_by": "agentgrpo"}
                ],
            }
        )

    async def _start(self, request: Request) -> Response:
        if self.hand_out is not None:
            return await self._take(request)
        try:
            body = await self._json(request)
            if not isinstance(body, dict) or set(body) - {"id", "seed"}:
                raise APIError(400, 'body: {"id"?: str, "seed"?: int}')
            eid, seed = body.get("id") or secrets.token_urlsafe(12), body.get("seed")
            if not isinstance(eid, str) or not EPISODE_ID.fullmatch(eid):
                raise APIError(
                    400,
                    f"id must be 1-128 characters of A-Z a-z 0-9 . _ - (not starting with "
                    f"'.'), got {eid!r:.60}",
                    param="id",
                )
            if seed is not None and (
                type(seed) is not int or not SEED_RANGE[0] <= seed <= SEED_RANGE[1]
            ):
                raise APIError(
                    400, f"seed must be a signed 64-bit integer, got {seed!r:.60}", param="seed"
                )
            if eid in self.episodes:
                raise APIError(409, f"episode {eid!r} exists already", param="id")
            if len(self.episodes) >= self.max_episodes:
                raise APIError(
                    429,
                    f"{self.max_episodes} episodes are held: DELETE finished ones",
                    kind="rate_limit_error",
                    code="too_many_episodes",
                )
            ep = self.add(self.new_episode(eid, seed))  # type: ignore[misc]
            base = str(request.base_url).rstrip("/")  # the Host the client used (checked: Auth)
            return JSONResponse(episode_urls(ep, base))
        except APIError as e:
            return e.response()

    async def _take(self, request: Request) -> Response:
        """POST /episodes of a remote run: an episode waiting for an agent (its id, URLs and
        task), or 204 when none came within the body's `wait_s` (default 20, at most 60)."""
        try:
            body = await self._json(request)
            wait_s = body.get("wait_s", 20.0) if isinstance(body, dict) else None
            if (
                not isinstance(body, dict)
                or set(body) - {"wait_s"}
                or isinstance(wait_s, bool)
                or not isinstance(wait_s, int | float)
                or not 0 <= wait_s <= 60
            ):
                raise APIError(400, 'body: {"wait_s"?: seconds to wait for a task, 0 to 60}')
            taken = await self.hand_out(float(wait_s))  # type: ignore[misc]
            if taken is None:
                return Response(status_code=204)
            ep, extra = taken
            self.add(ep)
            base = str(request.base_url).rstrip("/")  # the Host the client used (checked: Auth)
            return JSONResponse({**episode_urls(ep, base), **extra})
        except APIError as e:
            return e.response()

    async def _trajectory(self, request: Request) -> JSONResponse:
        try:
            ep = self._episode(request)
        except APIError as e:
            return e.response()
        traj, diverged = ep.trajectory(ep.id)
        reason, detail = ep.ending(diverged)
        traj = replace(
            traj,
            stop_reason=reason,
            stop_detail=detail,
            deadline=ep.deadline if reason == StopReason.TIMEOUT else None,
            reward=math.nan if ep.reward is None or reason.is_infra_error else ep.reward,
        )
        traj.check()
        return JSONResponse(traj.to_dict())

    async def _reward(self, request: Request) -> JSONResponse:
        try:
            ep = self._episode(request)
            body = await self._json(request)
            reward = body.get("reward") if isinstance(body, dict) else None
            if (
                isinstance(reward, bool)
                or not isinstance(reward, int | float)
                or not math.isfinite(reward)
            ):
                raise APIError(400, 'body: {"reward": a finite number}', param="reward")
            ep.reward = float(reward)
            if self.on_done is not None:
                self.on_done(ep)
            return JSONResponse({"id": ep.id, "reward": ep.reward})
        except APIError as e:
            return e.response()

    async def _end(self, request: Request) -> JSONResponse:
        try:
            ep = self._episode(request)
        except APIError as e:
            return e.response()
        self.remove(ep.id)
        if self.on_done is not None:
            self.on_done(ep)
        return JSONResponse({"id": ep.id, "deleted": True})

    @contextlib.asynccontextmanager
    async def serving(
        self, host: str = "127.0.0.1", port: int = 0, *, allowed_hosts: tuple[str, ...] = ()
    ) -> AsyncIterator[str]:
        """Serve on this event loop while the block runs; yields the base URL (port 0: any free
        port). On a loopback `host`, requests must name a loopback Host or one of `allowed_hosts`
        (a reverse proxy's). `self.effective` holds the limits in effect. Signals are left to the
        host program (the training run handles its own)."""
        if self.token is None and not is_loopback(host):
            raise ValueError(
                f"refusing to bind {host} without a token: anyone who reaches it could "
                "sample from the policy and write into its episodes"
            )
        self._hosts.loopback_only = is_loopback(host)
        self._hosts.allowed = frozenset(h.lower() for h in allowed_hosts)
        async with serve_app(self.app, host, port, self.limits) as (base, self.effective):
            yield base


def _refusal(status: int, message: str, code: str, path: str) -> Response:
    """Auth's 401 or 421, in the shape of the API `path` belongs to (Anthropic's for
    `/v1/messages`, OpenAI's otherwise)."""
    kind = "authentication_error" if status == 401 else "invalid_request_error"
    error = APIError(status, message, code=code, kind=kind)
    return anthropic.error_response(error) if path.endswith("/v1/messages") else error.response()


def episode_urls(ep: EndpointEpisode, base: str) -> dict[str, str]:
    """Where an episode's clients point, and the key they send: `base_url` for OpenAI's (Chat
    Completions, Responses), `anthropic_base_url` for Anthropic's (which adds /v1/messages
    itself), `api_key` the episode's own (good for its calls and nothing else)."""
    return {
        "id": ep.id,
        "base_url": f"{base}/episodes/{ep.id}/v1",
        "anthropic_base_url": f"{base}/episodes/{ep.id}",
        "api_key": ep.token,
    }


def nested_deeper(value: Any, limit: int) -> bool:
    """Whether parsed JSON `value` nests lists and objects more than `limit` deep (iteratively:
    the check itself cannot overflow the stack)."""
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, dict | list):
            if depth > limit:
                return True
            stack.extend((x, depth + 1) for x in (v.values() if isinstance(v, dict) else v))
    return False
