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


_CALL_KEYS = frozenset({"name", "arguments", "parameters", "type", "id"})


def _not_json(raw: str, e: ValueError | RecursionError) -> ParseError:
    if isinstance(e, json.JSONDecodeError):
        why = f"{e.msg} at position {e.pos}"
    elif isinstance(e, RecursionError):
        why = "nested too deeply"
    else:  # an integer past Python's 4300-digit limit, a NaN/Infinity constant
        why = str(e).split(";")[0]
    return ParseError(raw, f"the tool call is not valid JSON ({why})", ToolErrorKind.BAD_JSON)


def _no_constants(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def loads_call_json(raw: str) -> object:
    """`json.loads` as a tool call needs it: NaN and Infinity (not JSON) are refused. Raises
    ValueError (JSONDecodeError included) or RecursionError, which `_not_json` turns into an
    event: the policy's text must never raise out of a parser."""
    return json.loads(raw, parse_constant=_no_constants)


def _bad_text(value: object) -> bool:
    """True where a string inside `value` holds a lone UTF-16 surrogate ("\\ud83d" in JSON):
    not text, and the tokenizer cannot encode it when a tool echoes it back."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def call_from_object(obj: object, raw: str) -> ToolCall | ParseError:
    """A decoded JSON value -> ToolCall, accepting "arguments" or "parameters" (Llama) and
    arguments double-encoded as a JSON string (some models do that).

    Keys other than name, arguments/parameters, type and id (a model writing "args") are a
    BAD_CALL, not silently dropped: the call would otherwise run with no arguments.
    """
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ParseError(raw, 'a tool call must be a JSON object with a string "name"')
    unknown = sorted(set(obj) - _CALL_KEYS)
    if unknown:
        return ParseError(raw, f"unknown key(s) {unknown} in the tool call; the arguments go in "
                          '"arguments"')
    if "arguments" in obj and "parameters" in obj:
        return ParseError(raw, 'the tool call has both "arguments" and "parameters"; give one')
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = loads_call_json(args)
        except (ValueError, RecursionError):
            return ParseError(raw, '"arguments" must be a JSON object')
    if not isinstance(args, dict):
        return ParseError(raw, '"arguments" must be a JSON object')
    if _bad_text(obj["name"]) or _bad_text(args):
        return ParseError(raw, "the tool call holds a lone UTF-16 surrogate (an unpaired \\ud800-"
                          "\\udfff escape), which is not text", ToolErrorKind.BAD_JSON)
    return ToolCall(id=_call_id(), name=obj["name"], arguments=args)


def decode_call(raw: str) -> ToolCall | ParseError:
    """One call's JSON text -> ToolCall, or a ParseError saying what is wrong with it."""
    try:
        obj = loads_call_json(raw)
    except (ValueError, RecursionError) as e:
        return _not_json(raw, e)
    return call_from_object(obj, raw)


def _turn(content: str, calls: list[ToolCall], errors: list[ParseError]) -> ParsedTurn:
    return ParsedTurn(Message(role="assistant", content=content, tool_calls=calls or None), errors)


_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_DECODER = json.JSONDecoder(parse_constant=_no_constants)


def parse_hermes(text: str) -> ParsedTurn:
    """Hermes/Qwen format: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number.

    Text outside the tags is the message content. An unclosed `<tool_call>` at the end (the turn
    hit its token limit) is a malformed call, not silently dropped. A call is read as a JSON value
    first, so a `</tool_call>` inside one of its strings does not end it; where the JSON does not
    parse, the call runs to the next `</tool_call>`.
    """
    calls: list[ToolCall] = []
    errors: list[ParseError] = []
    content: list[str] = []
    pos = 0
    while (start := text.find(_OPEN, pos)) >= 0:
        content.append(text[pos:start])
        body = start + len(_OPEN)
        j = len(text) - len(text[body:].lstrip())
        call: ToolCall | ParseError | None = None
        try:
            obj, end = _DECODER.raw_decode(text, j)
            tail = len(text) - len(text[end:].lstrip())
            if text.startswith(_CLOSE, tail):
                call, pos = call_from_object(obj, text[j:end]), tail + len(_CLOSE)
        except (ValueError, RecursionError):
            pass
        if call is None:
            close = text.find(_CLOSE, body)
            if close < 0:
                errors.append(ParseError(text[body:].strip(), "the tool call was not closed with "
                                         "</tool_call>", ToolErrorKind.UNCLOSED))
                pos = len(text)
                break
            call, pos = decode_call(text[body:close].strip()), close + len(_CLOSE)
        (errors if isinstance(call, ParseError) else calls).append(call)
    content.append(text[pos:])
    return _turn("".join(content).strip(), calls, errors)


LLAMA_PYTHON_TAG = "<|python_tag|>"


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
        if tagged:  # Llama's built-in tool syntax (`brave_search.call(...)`, ipython code)
            return _turn("", [], [ParseError(body, f"after {LLAMA_PYTHON_TAG} a tool call must be "
                                             'a JSON object {"name": ..., "parameters": {...}}; '
                                             "built-in tool syntax is not supported")])
        return _turn(stripped, [], [])
    calls: list[ToolCall] = []
    pos = 0
    while pos < len(body):
        try:
            obj, end = _DECODER.raw_decode(body, pos)
        except (ValueError, RecursionError) as e:
            if not calls and not tagged and not re.match(r'\{\s*"name"', body):
                return _turn(stripped, [], [])  # not a call: text that happens to start with "{"
            if isinstance(e, json.JSONDecodeError):
                e = json.JSONDecodeError(e.msg, e.doc, e.pos - pos)
            return _turn("", calls, [_not_json(body[pos:], e)])
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
