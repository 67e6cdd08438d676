r"""Tool-call parsers: the model's decoded text -> an assistant Message plus malformed calls.

A parser is a function `(text) -> ParsedTurn`, registered by name in `PARSERS` and chosen with
`ChatFormat(parser=...)` (config: `model.tool_parser`). It never raises on model output: a call it
cannot use comes back as a `ParseError` with a `ToolErrorKind`, which the rollout answers with an
error tool message so the model can try again.

Formats:
- `hermes` (default; Hermes, Qwen2.5/Qwen3, SmolLM2 with agentgrpo's template): any number of
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks; text outside them is content.
- `llama3_json` (Llama 3.1/3.2/3.3 custom tools): the whole turn is a JSON object
  `{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`; several calls may be
  separated by `;` (Llama's template renders one call per turn; a model may still emit several).

Example (a parser for `<function=NAME>{json arguments}</function>`):
    >>> def parse_function_tags(text: str) -> ParsedTurn:
    ...     calls, errors = [], []
    ...     for name, args in re.findall(r"<function=([\w-]+)>(.*?)</function>", text, re.DOTALL):
    ...         try:
    ...             call = call_from_object({"name": name, "arguments": json.loads(args)}, args)
    ...         except json.JSONDecodeError as e:
    ...             call = ParseError(args, f"arguments are not valid JSON ({e.msg})", ToolErrorKind.BAD_JSON)
    ...         (errors if isinstance(call, ParseError) else calls).append(call)
    ...     content = re.sub(r"<function=.*?</function>", "", text, flags=re.DOTALL).strip()
    ...     return ParsedTurn(Message(role="assistant", content=content, tool_calls=calls or None), errors)
    >>> PARSERS["function_tags"] = parse_function_tags
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from agentgrpo.types import Message, ToolCall, ToolErrorKind


@dataclass
class ParseError:
    """One malformed tool call: what the model wrote, why it could not be used, and its kind."""

    raw: str
    reason: str
    kind: ToolErrorKind = ToolErrorKind.BAD_CALL


@dataclass
class ParsedTurn:
    message: Message  # the assistant message (content + well-formed tool calls)
    errors: list[ParseError] = field(default_factory=list)


def _call_id() -> str:
    return "call_" + uuid.uuid4().hex[:12]


def call_from_object(obj: object, raw: str) -> ToolCall | ParseError:
    """A decoded JSON value -> ToolCall, accepting "arguments" or "parameters" (Llama) and
    arguments double-encoded as a JSON string (some models do that)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ParseError(raw, 'a tool call must be a JSON object with a string "name"')
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return ParseError(raw, '"arguments" must be a JSON object')
    if not isinstance(args, dict):
        return ParseError(raw, '"arguments" must be a JSON object')
    return ToolCall(id=_call_id(), name=obj["name"], arguments=args)


def decode_call(raw: str) -> ToolCall | ParseError:
    """One call's JSON text -> ToolCall, or a ParseError saying what is wrong with it."""
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        return ParseError(raw, f"the tool call is not valid JSON ({e.msg} at position {e.pos})",
                          ToolErrorKind.BAD_JSON)
    return call_from_object(obj, raw)


def _turn(content: str, calls: list[ToolCall], errors: list[ParseError]) -> ParsedTurn:
    return ParsedTurn(Message(role="assistant", content=content, tool_calls=calls or None), errors)


_HERMES_CALL = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


def parse_hermes(text: str) -> ParsedTurn:
    """Hermes/Qwen format: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number.

    Text outside the tags is the message content. An unclosed `<tool_call>` at the end (the turn
    hit its token limit) is a malformed call, not silently dropped.
    """
    calls: list[ToolCall] = []
    errors: list[ParseError] = []
    for m in _HERMES_CALL.finditer(text):
        raw = m.group(1).strip()
        if not m.group(2):
            errors.append(ParseError(raw, "the tool call was not closed with </tool_call>",
                                     ToolErrorKind.UNCLOSED))
            continue
        call = decode_call(raw)
        (errors if isinstance(call, ParseError) else calls).append(call)
    return _turn(_HERMES_CALL.sub("", text).strip(), calls, errors)


LLAMA_PYTHON_TAG = "<|python_tag|>"
_DECODER = json.JSONDecoder()


def parse_llama3_json(text: str) -> ParsedTurn:
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
    body = stripped[len(LLAMA_PYTHON_TAG):].lstrip() if tagged else stripped
    if not body.startswith("{"):
        return _turn(stripped, [], [])
    calls: list[ToolCall] = []
    pos = 0
    while pos < len(body):
        try:
            obj, end = _DECODER.raw_decode(body, pos)
        except json.JSONDecodeError as e:
            if not calls and not tagged and not re.match(r'\{\s*"name"', body):
                return _turn(stripped, [], [])  # not a call: text that happens to start with "{"
            return _turn("", calls, [ParseError(body[pos:], f"the tool call is not valid JSON "
                                                f"({e.msg} at position {e.pos - pos})", ToolErrorKind.BAD_JSON)])
        raw = body[pos:end]
        if not calls and not tagged and not (isinstance(obj, dict) and "name" in obj):
            return _turn(stripped, [], [])  # a JSON answer, not a call
        call = call_from_object(obj, raw)
        if isinstance(call, ParseError):
            return _turn("", calls, [call])
        calls.append(call)
        pos = end
        while pos < len(body) and body[pos] in " \t\r\n;":
            pos += 1
        if pos < len(body) and body[pos] != "{":
            return _turn("", calls, [ParseError(body[pos:], "text after a tool call; in this format "
                                                "a turn is either tool calls or an answer")])
    return _turn("", calls, [])


PARSERS: dict[str, Callable[[str], ParsedTurn]] = {
    "hermes": parse_hermes,
    "llama3_json": parse_llama3_json,
}


def get_parser(name: str) -> Callable[[str], ParsedTurn]:
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; valid: {sorted(PARSERS)}")
    return PARSERS[name]
