"""Anthropic's Messages API (`POST /episodes/<id>/v1/messages`) as a translation onto the episode's
Chat Completions core (`EndpointEpisode.complete`), so its calls land in the same record.

A request becomes chat messages: `system` a system message; a user turn's `tool_result` blocks
tool messages (before its text), its text blocks a user message; an assistant turn's `thinking`,
`text` and `tool_use` blocks one assistant message (the thinking joined back exactly through the
block's `signature`), so the conversation the client sends back continues the episode's tokens.
Custom tools become chat tools, `tool_choice` and `stop_sequences` map onto chat's. The reply's
reasoning, text and calls become `thinking`, `text` and `tool_use` blocks; `stream` sends
Anthropic's events; errors have Anthropic's shape, `{"type": "error", "error": {...}}`.

Not carried (docs/agents.md has the field table and this list): images and documents, server
tools, `top_k`, cache control; a stop sequence's text stays in the reply.
"""

from __future__ import annotations

import json
import secrets
from typing import TYPE_CHECKING, Any

from starlette.responses import JSONResponse, Response

from agentgrpo.agents.api_error import APIError, check_model
from agentgrpo.agents.streaming import sse_response
from agentgrpo.agents.thinking import Thought, join_thinking, split_thinking

if TYPE_CHECKING:
    from agentgrpo.agents.endpoint import EndpointEpisode

IGNORED = frozenset({"metadata", "service_tier", "thinking", "container", "context_management"})
HONOURED = frozenset(
    {
        "model",
        "messages",
        "max_tokens",
        "system",
        "tools",
        "tool_choice",
        "stop_sequences",
        "temperature",
        "top_p",
        "stream",
    }
)
DEFAULT_ONLY = {"top_k": (None,), "mcp_servers": (None, [])}
# Anthropic's error type for each status (its API reference, "HTTP errors"): another 4xx is an
# invalid_request_error there, another 5xx here an api_error (an engine failure, 503, included).
ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}
STOP_REASONS = {"stop": "end_turn", "tool_calls": "tool_use", "length": "max_tokens"}


def error_response(e: APIError) -> JSONResponse:
    """An APIError in Anthropic's shape, with its status."""
    kind = ERROR_TYPES.get(e.status, "api_error" if e.status >= 500 else "invalid_request_error")
    return JSONResponse({"type": "error", "error": {"type": kind, "message": e.message}}, e.status)


async def answer(ep: EndpointEpisode, body: Any, served: str) -> Response:
    """One Messages API call on episode `ep` (the route's `answer`)."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    _check_fields(body)
    model = check_model(body["model"], served)
    tools = _tools(body.get("tools"))
    stops = body.get("stop_sequences") or []
    chat = {
        "model": model,
        "messages": _system(body.get("system")) + _messages(body["messages"]),
        "tools": tools,
        "tool_choice": _tool_choice(body.get("tool_choice")),
        "stop": stops or None,
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "max_tokens": body["max_tokens"],
    }
    reply = await ep.complete({k: v for k, v in chat.items() if v is not None})
    message = _message(reply, model, stops)
    if body.get("stream") is True:
        return sse_response(stream_events(message))
    return JSONResponse(message)


def _check_fields(body: dict[str, Any]) -> None:
    for key, value in body.items():
        if key in HONOURED or key in IGNORED:
            continue
        if key in DEFAULT_ONLY and value in DEFAULT_ONLY[key]:
            continue
        what = (
            "is not supported by this endpoint"
            if key in DEFAULT_ONLY
            else "Extra inputs are not permitted"
        )
        raise APIError(400, f"{key}: {what}")
    for key in ("model", "messages", "max_tokens"):
        if key not in body:
            raise APIError(400, f"{key}: Field required")
    if body.get("stream") not in (None, True, False):
        raise APIError(400, "stream: must be a boolean")
    stops = body.get("stop_sequences")
    if stops is not None and not (
        isinstance(stops, list) and all(isinstance(s, str) and s for s in stops)
    ):
        raise APIError(400, "stop_sequences: must be a list of non-empty strings")


def _system(raw: Any) -> list[dict[str, Any]]:
    if raw is None or raw == "" or raw == []:
        return []
    return [{"role": "system", "content": _texts(raw, "system")}]


def _texts(raw: Any, where: str) -> str:
    """Text, or the text of text blocks (any other block is a 400), joined with newlines."""
    if isinstance(raw, str):
        return raw
    if not isinstance(raw, list):
        raise APIError(400, f"{where}: must be a string or a list of content blocks")
    texts = []
    for block in raw:
        if not (isinstance(block, dict) and block.get("type") == "text"):
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise APIError(400, f"{where}: blocks of type {kind!r:.50} are not supported here")
        texts.append(str(block.get("text", "")))
    return "\n".join(texts)


def _messages(raw: Any) -> list[dict[str, Any]]:
    if not isinstance(raw, list) or not raw:
        raise APIError(400, "messages: must be a non-empty list")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(raw):
        where = f"messages.{i}"
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise APIError(400, f"{where}: a message is {{role: user | assistant, content}}")
        content = m.get("content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise APIError(400, f"{where}.content: must be a string or a list of blocks")
        if m["role"] == "assistant":
            out.append(_assistant(blocks, where))
        else:
            out += _user(blocks, where)
    return out


def _user(blocks: list[Any], where: str) -> list[dict[str, Any]]:
    """A user turn: a tool message per tool_result, then its text (if any) as a user message."""
    results, texts = [], []
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_result" and isinstance(block.get("tool_use_id"), str):
            content = block.get("content")
            text = "" if content is None else _texts(content, f"{where}.content.{j}.content")
            results.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": text})
        elif kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        else:
            raise APIError(
                400,
                f"{where}.content.{j}: blocks of type {kind!r:.50} are not supported in a user "
                "turn (text and tool_result are)",
            )
    return results + ([{"role": "user", "content": "\n".join(texts)}] if texts else [])


def _assistant(blocks: list[Any], where: str) -> dict[str, Any]:
    """An assistant turn as one chat message: thinking and text as its content, tool uses as
    its calls."""
    thought, texts, calls = None, [], []
    for j, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "thinking" and isinstance(block.get("thinking"), str):
            thought = Thought.signed(block["thinking"], block.get("signature"))
        elif kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and isinstance(block.get("id"), str):
            fn = {"name": block.get("name"), "arguments": json.dumps(block.get("input") or {})}
            calls.append({"id": block["id"], "type": "function", "function": fn})
        else:
            raise APIError(
                400,
                f"{where}.content.{j}: blocks of type {kind!r:.50} are not supported in an "
                "assistant turn (thinking, text and tool_use are)",
            )
    message: dict[str, Any] = {
        "role": "assistant",
        "content": join_thinking(thought, "".join(texts)),
    }
    if calls:
        message["tool_calls"] = calls
    return message


def _tools(raw: Any) -> list[dict[str, Any]] | None:
    if not raw:
        return None
    if not isinstance(raw, list):
        raise APIError(400, "tools: must be a list")
    tools = []
    for i, t in enumerate(raw):
        if not (
            isinstance(t, dict)
            and t.get("type", "custom") == "custom"
            and isinstance(t.get("name"), str)
            and isinstance(t.get("input_schema"), dict)
        ):
            raise APIError(
                400,
                f"tools.{i}: only custom tools ({{name, description, input_schema}}) are supported",
            )
        fn = {"name": t["name"], "parameters": t["input_schema"]}
        if t.get("description"):
            fn["description"] = t["description"]
        tools.append({"type": "function", "function": fn})
    return tools


def _tool_choice(raw: Any) -> Any:
    if raw is None:
        return None
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind == "tool" and isinstance(raw.get("name"), str):
        return {"type": "function", "function": {"name": raw["name"]}}
    if kind in ("auto", "any", "none"):
        return {"auto": "auto", "any": "required", "none": "none"}[kind]
    raise APIError(
        400, f"tool_choice: expected {{type: auto | any | tool | none}}, got {raw!r:.100}"
    )


def _message(reply: dict[str, Any], model: str, stops: list[str]) -> dict[str, Any]:
    """The chat reply as Anthropic's `message` object."""
    choice = reply["choices"][0]
    message = choice["message"]
    thought, text = split_thinking(message.get("content") or "")
    blocks: list[dict[str, Any]] = []
    if thought is not None:
        blocks.append(
            {"type": "thinking", "thinking": thought.text, "signature": thought.signature}
        )
    if text or not (thought or message.get("tool_calls")):
        blocks.append({"type": "text", "text": text})
    for call in message.get("tool_calls") or []:
        blocks.append(
            {
                "type": "tool_use",
                "id": call["id"],
                "name": call["function"]["name"],
                "input": json.loads(call["function"]["arguments"]),
            }
        )
    reason = STOP_REASONS[choice["finish_reason"]]
    stop = next((s for s in stops if reason == "end_turn" and text.endswith(s)), None)
    return {
        "id": f"msg_{secrets.token_hex(12)}",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": blocks,
        "stop_reason": "stop_sequence" if stop else reason,
        "stop_sequence": stop,
        "usage": {
            "input_tokens": reply["usage"]["prompt_tokens"],
            "output_tokens": reply["usage"]["completion_tokens"],
        },
    }


def stream_events(message: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The events Anthropic streams for `message`: message_start, each block's start, one delta
    (text, thinking then its signature, or the tool input as JSON) and stop, message_delta with
    the stop reason and usage, message_stop."""
    start = {**message, "content": [], "stop_reason": None, "stop_sequence": None}
    start["usage"] = {**message["usage"], "output_tokens": 0}
    events: list[tuple[str, dict[str, Any]]] = [
        ("message_start", {"type": "message_start", "message": start})
    ]
    for i, block in enumerate(message["content"]):
        kind = block["type"]
        if kind == "text":
            opening, deltas = {**block, "text": ""}, [{"type": "text_delta", "text": block["text"]}]
        elif kind == "thinking":
            opening = {**block, "thinking": "", "signature": ""}
            deltas = [
                {"type": "thinking_delta", "thinking": block["thinking"]},
                {"type": "signature_delta", "signature": block["signature"]},
            ]
        else:
            opening = {**block, "input": {}}
            deltas = [{"type": "input_json_delta", "partial_json": json.dumps(block["input"])}]
        events.append(
            (
                "content_block_start",
                {"type": "content_block_start", "index": i, "content_block": opening},
            )
        )
        for delta in deltas:
            events.append(
                ("content_block_delta", {"type": "content_block_delta", "index": i, "delta": delta})
            )
        events.append(("content_block_stop", {"type": "content_block_stop", "index": i}))
    final = {"stop_reason": message["stop_reason"], "stop_sequence": message["stop_sequence"]}
    usage = {"output_tokens": message["usage"]["output_tokens"]}
    events.append(("message_delta", {"type": "message_delta", "delta": final, "usage": usage}))
    events.append(("message_stop", {"type": "message_stop"}))
    return events
