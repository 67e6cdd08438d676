"""Hermes / Qwen2.5 / Qwen3 tool calls: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
blocks."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from agentgrpo.chat.calls import (
    JSON_DECODER,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    ParsedTurn,
    ParseError,
    call_from_object,
    loads_call_json,
    not_json,
    turn,
)
from agentgrpo.types import ToolCall, ToolErrorKind


def _calls_in(obj: object, raw: str) -> list[ToolCall | ParseError]:
    """A block's JSON value as calls: one object, or a list of them (SGLang reads a list so; an
    entry that is not a call is a malformed call beside the others)."""
    if not isinstance(obj, list):
        return [call_from_object(obj, raw)]
    return [call_from_object(o, raw) for o in obj] or [ParseError(raw, "an empty list of calls")]


def parse_hermes(text: str, tools: Sequence[Mapping] | None = None) -> ParsedTurn:
    """Hermes/Qwen format: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number.

    Text outside the tags is the message content; a block may hold one call or a JSON list of
    them. A call is read as a JSON value first, so a `</tool_call>` inside one of its strings does
    not end it; a complete call missing its `</tool_call>` before the next `<tool_call>` or the end
    of the turn is still a call (vLLM runs it). Where the JSON does not parse, the call runs to the
    next `</tool_call>`; an unclosed `<tool_call>` whose JSON is incomplete (the turn hit its token
    limit) is a malformed call, not silently dropped.
    """
    calls: list[ToolCall] = []
    errors: list[ParseError] = []
    content: list[str] = []
    pos = 0
    while (start := text.find(TOOL_CALL_OPEN, pos)) >= 0:
        content.append(text[pos:start])
        body = start + len(TOOL_CALL_OPEN)
        j = len(text) - len(text[body:].lstrip())
        found: list[ToolCall | ParseError] | None = None
        try:
            obj, end = JSON_DECODER.raw_decode(text, j)
            tail = len(text) - len(text[end:].lstrip())
            if text.startswith(TOOL_CALL_CLOSE, tail):
                found, pos = _calls_in(obj, text[j:end]), tail + len(TOOL_CALL_CLOSE)
            elif tail == len(text) or text.startswith(TOOL_CALL_OPEN, tail):
                found, pos = _calls_in(obj, text[j:end]), tail
        except (ValueError, RecursionError):
            pass
        if found is None:
            close = text.find(TOOL_CALL_CLOSE, body)
            if close < 0:
                errors.append(
                    ParseError(
                        text[body:].strip(),
                        "the tool call was not closed with </tool_call>",
                        ToolErrorKind.UNCLOSED,
                    )
                )
                pos = len(text)
                break
            raw, pos = text[body:close].strip(), close + len(TOOL_CALL_CLOSE)
            try:
                found = _calls_in(loads_call_json(raw), raw)
            except (ValueError, RecursionError) as e:
                found = [not_json(raw, e)]
        for call in found:
            (errors if isinstance(call, ParseError) else calls).append(call)
    content.append(text[pos:])
    return turn("".join(content).strip(), calls, errors)
