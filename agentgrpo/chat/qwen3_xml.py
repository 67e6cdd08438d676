"""Qwen3-Coder XML tool calls (Qwen3.5, Qwen3.6, Qwen3-Coder, Nemotron 3)."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from agentgrpo.chat.calls import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    ParsedTurn,
    ParseError,
    key_value_pairs,
    param_schemas,
    scan_blocks,
    turn,
    typed_call,
)
from agentgrpo.types import ToolCall

_FUNCTION = re.compile(r"\s*<function=([^>]*)>(.*)</function>\s*", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>]*)>(.*?)</parameter>", re.DOTALL)


def _one_newline_off(value: str) -> str:
    """The templates print `<parameter=K>\\n` VALUE `\\n</parameter>`: those two newlines only."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def parse_qwen3_xml(text: str, tools: Sequence[Mapping] | None = None) -> ParsedTurn:
    """Qwen3-Coder XML calls: `<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n`
    `</parameter>...</function>\\n</tool_call>`, any number; text outside them is content.

    A value is the text between its tags less the newline the template puts on each side, typed by
    the tool's schema (`typed_value`); without `tools` every value stays a string. A block that is
    not exactly one function of closed parameters is a BAD_CALL (a `<tool_call>` holding Hermes
    JSON included); a `</parameter>` inside a string value ends it (the format has no escaping).
    """
    schemas = param_schemas(tools)

    def read(body: str) -> list[ToolCall | ParseError]:
        raw = body.strip()
        m = _FUNCTION.fullmatch(body)
        if m is None:
            return [
                ParseError(
                    raw,
                    "a tool call must be <function=NAME> with its <parameter=KEY> "
                    "values, closed by </function>",
                )
            ]
        pairs = key_value_pairs(m.group(2), _PARAMETER, "<parameter=KEY>...</parameter>", raw)
        if isinstance(pairs, ParseError):
            return [pairs]
        pairs = [(key, _one_newline_off(value)) for key, value in pairs]
        return [typed_call(m.group(1).strip(), pairs, schemas, raw)]

    content, calls, errors = scan_blocks(text, TOOL_CALL_OPEN, TOOL_CALL_CLOSE, read)
    return turn(content.strip(), calls, errors)
