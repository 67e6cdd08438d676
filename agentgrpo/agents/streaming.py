"""Server-sent events for the endpoint's APIs, and Chat Completions replies as OpenAI's chunks.

Each call is sampled whole, recorded, and only then sent as events: the engine returns a whole
turn (token-in/token-out), so a streamed call and a plain one run the same code up to the reply
and leave the same record. The first event therefore arrives when the turn is sampled, not after
its first token. What a streaming client needs from the events is all there: the text, each tool
call's id, name and arguments (OpenAI's `tool_calls` deltas), the finish reason, and the usage
when `stream_options.include_usage` asks for it. An error found before the reply (bad input, an
engine failure, a limit) is answered as a plain error response with its status code, as OpenAI
does for errors found before a stream starts.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterable
from typing import Any

from starlette.responses import StreamingResponse

from agentgrpo.agents.api_error import APIError


def sse_response(events: Iterable[tuple[str | None, Any]]) -> StreamingResponse:
    """A `text/event-stream` response of `(event name or None, data)` pairs; data that is not a
    string is sent as JSON."""
    lines = []
    for name, data in events:
        text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
        lines.append((f"event: {name}\n" if name else "") + f"data: {text}\n\n")

    async def body() -> AsyncIterator[str]:
        # every event exists already: one write (a sync iterator would cost starlette a thread
        # hop per event; bench/endpoint.py)
        yield "".join(lines)

    return StreamingResponse(
        body(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


def stream_options(body: dict[str, Any]) -> bool:
    """Whether the streamed reply ends with a usage chunk (`stream_options.include_usage`);
    APIError for options that are not OpenAI's."""
    options = body.get("stream_options")
    if options is None:
        return False
    if body.get("stream") is not True:
        raise APIError(
            400,
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
            param="stream_options",
        )
    if not isinstance(options, dict) or set(options) - {"include_usage", "include_obfuscation"}:
        raise APIError(
            400,
            "stream_options must be {include_usage?: bool, include_obfuscation?: bool}",
            param="stream_options",
        )
    usage = options.get("include_usage", False)
    if not isinstance(usage, bool):
        raise APIError(
            400, "stream_options.include_usage must be a boolean", param="stream_options"
        )
    return usage


def chat_chunks(reply: dict[str, Any], include_usage: bool) -> list[dict[str, Any]]:
    """A `chat.completion` reply as the `chat.completion.chunk` objects OpenAI streams for it:
    the role, the text, each tool call (id, name, then its arguments), the finish reason, and
    with `include_usage` a last chunk without choices that carries the usage (every chunk before
    it then has `usage: null`)."""
    head = {k: reply[k] for k in ("id", "created", "model", "system_fingerprint")}
    head["object"] = "chat.completion.chunk"
    choice = reply["choices"][0]
    message = choice["message"]

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        out = {**head, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
        out["choices"][0]["logprobs"] = None
        if include_usage:
            out["usage"] = None
        return out

    chunks = [chunk({"role": "assistant", "content": ""})]
    if message.get("content"):
        chunks.append(chunk({"content": message["content"]}))
    for i, call in enumerate(message.get("tool_calls") or []):
        fn = call["function"]
        opening = {"index": i, "id": call["id"], "type": "function"}
        chunks.append(chunk({"tool_calls": [{**opening, "function": {"name": fn["name"]}}]}))
        chunks.append(
            chunk({"tool_calls": [{"index": i, "function": {"arguments": fn["arguments"]}}]})
        )
    chunks.append(chunk({}, choice["finish_reason"]))
    if include_usage:
        chunks.append({**head, "choices": [], "usage": reply["usage"]})
    return chunks


def chat_stream(reply: dict[str, Any], include_usage: bool) -> StreamingResponse:
    """The reply as OpenAI's Chat Completions stream, closed by `data: [DONE]`."""
    return sse_response([*((None, c) for c in chat_chunks(reply, include_usage)), (None, "[DONE]")])
