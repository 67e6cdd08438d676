"""Qwen3-Coder XML tool calls (Qwen3.5, Qwen3.6, Qwen3-Coder, Nemotron 3):
`<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>...</function>\\n</tool_call>`.

The format has no escaping, so a value may hold the format's own tags (a model writing a parser
test, a template). A call is read from left to right, and a `</parameter>` ends a value only where
the format goes on after it: another of the tool's parameters, `</function>`, or the end of the
text, counting the `<parameter=...>`/`</parameter>` pairs inside the value (vLLM's rule). What
SGLang's and vLLM's parsers also accept is accepted (tests/test_parsers_reference.py): a
`<function=...>` without `<tool_call>`, a missing `</tool_call>` after `</function>`, a value
left unclosed before the next parameter or `</function>`, and a misspelt closing tag
(`</parameter1>`) at its end.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from agentgrpo.chat.calls import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    ParsedTurn,
    ParseError,
    param_schemas,
    turn,
    typed_call,
)
from agentgrpo.types import ToolCall, ToolErrorKind

_FUNCTION_OPEN = re.compile(r"<function=([^>\n]*)>")
_PARAMETER_OPEN = re.compile(r"<parameter=([^>\n]*)>")
_PARAMETER_CLOSE, _FUNCTION_CLOSE = "</parameter>", "</function>"
_PARAMETER_TAG = re.compile(r"<parameter=([^>\n]*)>|</parameter>")
_CALL_START = re.compile(re.escape(TOOL_CALL_OPEN) + r"|<function=")
_DRIFTED_CLOSE = re.compile(r"</parameter[^\s>]*>?$")  # `</parameter1>`, `</parameter`
_SPACE = re.compile(r"\s*")
_MAX_NESTED = 32  # `<parameter=...>` tags a value may hold open at once


def _one_newline_off(value: str) -> str:
    """The templates print `<parameter=K>\\n` VALUE `\\n</parameter>`: those two newlines only."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def _skip_space(text: str, pos: int) -> int:
    return _SPACE.match(text, pos).end()


def _goes_on(text: str, pos: int, known: set[str] | None) -> bool:
    """Whether the format goes on at `pos`: the end, `</function>`, or a parameter of the tool
    (any parameter where the tool's schema is not known)."""
    pos = _skip_space(text, pos)
    if pos == len(text) or text.startswith(_FUNCTION_CLOSE, pos):
        return True
    m = _PARAMETER_OPEN.match(text, pos)
    return m is not None and (known is None or m.group(1).strip() in known)


def _value_end(text: str, start: int, known: set[str] | None) -> tuple[int, int]:
    """(end of the value that starts at `start`, where reading goes on). The value ends at the
    first `</parameter>` after which the format goes on, not counting those that close a
    `<parameter=...>` inside the value. Without one it was left unclosed: it ends at the next of
    the tool's parameters or `</function>`, less a misspelt closing tag."""
    depth = 0
    for m in _PARAMETER_TAG.finditer(text, start):
        if m.group(1) is not None:
            depth += 1
            if depth > _MAX_NESTED:  # not a value that holds tags: stop looking (linear time)
                break
        elif depth:
            depth -= 1
        elif _goes_on(text, m.end(), known):
            return m.start(), m.end()
    opens = (m.start() for m in _PARAMETER_OPEN.finditer(text, start))
    end = next((e for e in opens if _goes_on(text, e, known)), len(text))
    close = text.find(_FUNCTION_CLOSE, start, end)
    end = close if close >= 0 else end
    value = text[start:end].rstrip()
    drift = _DRIFTED_CLOSE.search(value, max(0, len(value) - 64))  # a tag's length: linear time
    return (start + drift.start() if drift else end), end


def _read_function(
    text: str, pos: int, schemas: dict[str, dict]
) -> tuple[ToolCall | ParseError, int]:
    """The call whose `<function=` starts at `pos`, and where reading goes on after it."""
    m = _FUNCTION_OPEN.match(text, pos)
    if m is None:  # `<function=NAME` without its `>`
        close = text.find(_FUNCTION_CLOSE, pos)
        end = len(text) if close < 0 else close + len(_FUNCTION_CLOSE)
        return ParseError(text[pos:end].strip(), "a tool call must open with <function=NAME>"), end
    name = m.group(1).strip()
    known = set(schemas[name]) if name in schemas else None
    pairs: list[tuple[str, str]] = []
    at = m.end()
    while True:
        at = _skip_space(text, at)
        if text.startswith(_FUNCTION_CLOSE, at):
            end = at + len(_FUNCTION_CLOSE)
            return typed_call(name, pairs, schemas, text[pos:end].strip()), end
        p = _PARAMETER_OPEN.match(text, at)
        if at == len(text) or (p is None and _FUNCTION_CLOSE not in text[at:]):
            why = "the tool call was not closed with </function>"
            return ParseError(text[pos:].strip(), why, ToolErrorKind.UNCLOSED), len(text)
        if p is None:
            close = text.find(_FUNCTION_CLOSE, at)
            why = f"text that is not a <parameter=KEY> value: {text[at:close].strip()[:80]!r}"
            end = close + len(_FUNCTION_CLOSE)
            return ParseError(text[pos:end].strip(), why), end
        value_end, at = _value_end(text, p.end(), known)
        pairs.append((p.group(1).strip(), _one_newline_off(text[p.end() : value_end])))


def _read_block(text: str, pos: int, schemas: dict[str, dict]) -> tuple[ToolCall | ParseError, int]:
    """The call at `pos` (`<tool_call>` or a bare `<function=`) and where the text goes on."""
    at = pos
    if text.startswith(TOOL_CALL_OPEN, pos):
        at = _skip_space(text, pos + len(TOOL_CALL_OPEN))
        if not text.startswith("<function=", at):
            close = text.find(TOOL_CALL_CLOSE, at)
            if close < 0:
                why = "the tool call was not closed with </tool_call>"
                return ParseError(text[at:].strip(), why, ToolErrorKind.UNCLOSED), len(text)
            why = "a tool call must be <function=NAME> with its <parameter=KEY> values"
            return ParseError(text[at:close].strip(), why), close + len(TOOL_CALL_CLOSE)
    call, end = _read_function(text, at, schemas)
    after = _skip_space(text, end)
    return call, after + len(TOOL_CALL_CLOSE) if text.startswith(TOOL_CALL_CLOSE, after) else end


def parse_qwen3_xml(text: str, tools: Sequence[Mapping] | None = None) -> ParsedTurn:
    """Qwen3-Coder XML calls: `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n`
    `</parameter>...</function>\\n</tool_call>`, any number; text outside them is content.

    A value is the text between its tags less the newline the template puts on each side, typed by
    the tool's schema (`typed_value`); without `tools` every value stays a string, and any
    parameter name counts where a value's end is decided. A `<tool_call>` that does not hold a
    `<function=NAME>` (Hermes JSON, an example in prose) is a BAD_CALL, as is a function whose
    body is not parameters; a call cut off before `</function>` is UNCLOSED.
    """
    schemas = param_schemas(tools)
    calls: list[ToolCall] = []
    errors: list[ParseError] = []
    content: list[str] = []
    pos = 0
    while m := _CALL_START.search(text, pos):
        content.append(text[pos : m.start()])
        call, pos = _read_block(text, m.start(), schemas)
        (errors if isinstance(call, ParseError) else calls).append(call)
    content.append(text[pos:])
    return turn("".join(content).strip(), calls, errors)
