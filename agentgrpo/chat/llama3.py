"""Llama 3.x JSON tool calls: `{"name": ..., "parameters": {...}}` as the turn."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence

from agentgrpo.chat.calls import (
    JSON_DECODER,
    ParsedTurn,
    ParseError,
    call_from_object,
    not_json,
    turn,
)
from agentgrpo.types import ToolCall

LLAMA_PYTHON_TAG = "<|python_tag|>"


def parse_llama3_json(text: str, tools: Sequence[Mapping] | None = None) -> ParsedTurn:
    """Llama 3.x JSON tool calls: `{"name": ..., "parameters": {...}}` as the whole turn.

    Decisions (Llama has no delimiters, so a rule has to say what is a call):
    - The turn is a call when, after an optional `<|python_tag|>`, it starts with `{`. A JSON object
      without a "name" (the model answering in JSON) is content, not a call; text that starts like
      `{"name"` but does not parse is a malformed call (BAD_JSON), so a broken call is never
      mistaken for an answer.
    - Several objects separated by `;` (or whitespace) are several calls. Text after the last
      object is a malformed call: the model cannot mix a call with prose in this format.
    """
    stripped = text.strip()
    tagged = stripped.startswith(LLAMA_PYTHON_TAG)
    body = stripped[len(LLAMA_PYTHON_TAG) :].lstrip() if tagged else stripped
    if not body.startswith("{"):
        if tagged:  # Llama's built-in tool syntax (`brave_search.call(...)`, ipython code)
            return turn(
                "",
                [],
                [
                    ParseError(
                        body,
                        f"after {LLAMA_PYTHON_TAG} a tool call must be "
                        'a JSON object {"name": ..., "parameters": {...}}; '
                        "built-in tool syntax is not supported",
                    )
                ],
            )
        return turn(stripped, [], [])
    calls: list[ToolCall] = []
    pos = 0
    while pos < len(body):
        try:
            obj, end = JSON_DECODER.raw_decode(body, pos)
        except (ValueError, RecursionError) as e:
            if not calls and not tagged and not re.match(r'\{\s*"name"', body):
                return turn(stripped, [], [])  # not a call: text that happens to start with "{"
            if isinstance(e, json.JSONDecodeError):
                e = json.JSONDecodeError(e.msg, e.doc, e.pos - pos)
            return turn("", calls, [not_json(body[pos:], e)])
        raw = body[pos:end]
        if not calls and not tagged and not (isinstance(obj, dict) and "name" in obj):
            return turn(stripped, [], [])  # a JSON answer, not a call
        call = call_from_object(obj, raw)
        if isinstance(call, ParseError):
            return turn("", calls, [call])
        calls.append(call)
        pos = end
        while pos < len(body) and body[pos] in " \t\r\n;":
            pos += 1
        if pos < len(body) and body[pos] != "{":
            return turn(
                "",
                calls,
                [
                    ParseError(
                        body[pos:],
                        "text after a tool call; in this format "
                        "a turn is either tool calls or an answer",
                    )
                ],
            )
    return turn("", calls, [])
