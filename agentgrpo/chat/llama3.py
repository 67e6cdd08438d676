"""Llama 3.x JSON tool calls: `{"name": ..., "parameters": {...}}` objects in the turn.

Llama has no delimiters, so a rule says what is a call; it is the union of what SGLang's and vLLM's
parsers run (tests/test_parsers_reference.py): an object with a "name" that opens the turn (or
follows `<|python_tag|>`, `;` or another call) is a call, and so is one with a "name" and its
"parameters" or "arguments" anywhere in the text. Everything else is content.
"""

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
    python_literal,
    turn,
)
from agentgrpo.types import ToolCall

LLAMA_PYTHON_TAG = "<|python_tag|>"
_LOOKS_LIKE_CALL = re.compile(r"\{\s*[\"']name[\"']\s*:")
_SEPARATORS = re.compile(r"(?:\s|;|" + re.escape(LLAMA_PYTHON_TAG) + ")*")


def _is_call(obj: object, leading: bool) -> bool:
    """A decoded object is a call if it has a string "name" and either opens a run of calls or
    names its arguments (a bare {"name": ...} in prose is more likely an example than a call)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return False
    return leading or "parameters" in obj or "arguments" in obj


def _python_dict_call(body: str) -> ToolCall | ParseError | None:
    """A whole turn written as a Python dict (`{'name': ..., 'arguments': {...}}`), which SGLang
    converts to JSON; None where the turn is not one."""
    try:
        obj = python_literal(body)
    except ValueError:
        return None
    return call_from_object(obj, body) if _is_call(obj, True) else None


def _scan(body: str) -> tuple[list[str], list[ToolCall], list[ParseError]]:
    """The calls in `body` (the text after the first `<|python_tag|>`, or the whole turn), the
    text around them, and the calls that start like one but are not JSON (BAD_JSON)."""
    calls: list[ToolCall] = []
    errors: list[ParseError] = []
    content: list[str] = []
    pos, broken, i = 0, False, body.find("{")
    while i >= 0:
        leading = not body[pos:i].strip(" \t\r\n;")
        try:
            obj, end = JSON_DECODER.raw_decode(body, i)
        except (ValueError, RecursionError) as e:
            if leading and _LOOKS_LIKE_CALL.match(body, i):
                if isinstance(e, json.JSONDecodeError):
                    e = json.JSONDecodeError(e.msg, e.doc, e.pos - i)
                errors.append(not_json(body[i:], e))
                broken = True
            i = body.find("{", i + 1)
            continue
        if not _is_call(obj, leading):
            i = body.find("{", end)
            continue
        content.append("" if broken else body[pos:i])
        call = call_from_object(obj, body[i:end])
        (errors if isinstance(call, ParseError) else calls).append(call)
        pos, broken = _SEPARATORS.match(body, end).end(), False
        i = body.find("{", pos)
    content.append("" if broken else body[pos:])
    return content, calls, errors


def parse_llama3_json(text: str, tools: Sequence[Mapping] | None = None) -> ParsedTurn:
    """Llama 3.x JSON tool calls: `{"name": ..., "parameters": {...}}` (or "arguments").

    - Text before `<|python_tag|>` is content; after it the turn must be calls: other text there
      (Llama's built-in tool syntax, `brave_search.call(...)`) is a malformed call (BAD_CALL).
    - Calls may be separated by `;`, whitespace or another `<|python_tag|>`; text around them is
      content. An object that starts like `{"name"` where a call may stand but does not parse is
      BAD_JSON, so a broken call is never mistaken for an answer; a later complete call still
      runs (both engines skip to it). A JSON object that is not a call (no "name") is content.
    - A turn that is one Python dict (`{'name': ...}`) is read as a literal (SGLang does so).
    The arguments are JSON, so `tools` is not used.
    """
    head, tag, body = text.partition(LLAMA_PYTHON_TAG)
    if not tag:
        head, body = "", text
    elif not body.lstrip().startswith("{"):  # Llama's built-in tool syntax
        why = (
            f"after {LLAMA_PYTHON_TAG} a tool call must be a JSON object "
            '{"name": ..., "parameters": {...}}; built-in tool syntax is not supported'
        )
        return turn(head.strip(), [], [ParseError(body.strip(), why)])
    content, calls, errors = _scan(body)
    if not calls and errors and (call := _python_dict_call(body.strip())) is not None:
        content, calls, errors = [], [], []
        (errors if isinstance(call, ParseError) else calls).append(call)
    return turn((head + "".join(content)).strip(), calls, errors)
