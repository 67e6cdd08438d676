"""Reading a Chat Completions request: the fields the episode honours, checked and normalised.

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
"""

from __future__ import annotations

import math
import re
from typing import Any

from agentgrpo.agents.api_error import APIError
from agentgrpo.types import Message

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


def read_request(body: Any) -> dict[str, Any]:
    """The request's fields, checked and normalised; APIError naming the first problem."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    _check_fields(body)
    messages = _read_messages(body.get("messages"))
    tools = body.get("tools") or None
    _check_tools(tools)
    choice = body.get("tool_choice")
    _check_tool_choice(choice)
    stop = _read_stop(body.get("stop"))
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    _check_numbers(body, max_tokens)
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


def _check_fields(body: dict[str, Any]) -> None:
    """Every field known and, where it would change sampling, at its default; `stream` a
    boolean and `n` 1."""
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


def _read_messages(raw: Any) -> list[Message]:
    """The request's messages as records ("developer" read as "system")."""
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
    return messages


def _check_tools(tools: Any) -> None:
    """None, or a list of OpenAI function tools each with a name."""
    if tools is None:
        return
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
            "tools must be a list of {type: function, function: {name, description, parameters}}",
            param="tools",
        )


def _check_tool_choice(choice: Any) -> None:
    """none, auto, required or a named function (whether the name exists is the episode's)."""
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


def _read_stop(stop: Any) -> list[str]:
    """`stop` as a list of at most 4 non-empty strings."""
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not (
        isinstance(stop, list) and len(stop) <= 4 and all(isinstance(s, str) and s for s in stop)
    ):
        raise APIError(400, "stop must be a string or a list of at most 4 strings", param="stop")
    return stop


def _check_numbers(body: dict[str, Any], max_tokens: Any) -> None:
    """temperature, top_p, max_tokens and seed: finite numbers in their range, when given."""
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
