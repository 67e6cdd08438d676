"""GLM-4.5 / 4.6 / 4.7 tool calls: `<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>`."""

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

_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
# GLM-4.6 sometimes escapes a whole call, writing a line break as the two characters \n
_ESCAPED_BREAK = re.compile(r"(?:\\n)+(?=<arg_(?:key|value)>|</tool_call>|$)")


def parse_glm4(text: str, tools: Sequence[Mapping] | None = None) -> ParsedTurn:
    """GLM-4.5/4.6 calls `<tool_call>NAME\\n<arg_key>KEY</arg_key>\\n<arg_value>VALUE</arg_value>
    ...</tool_call>`, any number, GLM-4.7's without the line breaks; text outside is content.

    The name runs to the first `<arg_key>` (a call without arguments is the name alone, with or
    without its line break); a value is the exact text between its tags, typed by the tool's
    schema (`typed_value`; without `tools` every value stays a string). GLM-4.6's escaped calls
    (`\\"` for a quote, the characters `\\n` between the tags) are read with one level of
    escaping undone.
    """
    schemas = param_schemas(tools)

    def read(body: str) -> list[ToolCall | ParseError]:
        raw = body.strip()
        body = _ESCAPED_BREAK.sub("", body)
        cut = body.find("<arg_key>")
        name, inner = (body, "") if cut < 0 else (body[:cut], body[cut:])
        what = "<arg_key>K</arg_key><arg_value>V</arg_value> pair"
        pairs = key_value_pairs(inner, _GLM_ARG, what, raw)
        if isinstance(pairs, ParseError):
            return [pairs]
        return [typed_call(name.strip(), pairs, schemas, raw)]

    content, calls, errors = scan_blocks(text, TOOL_CALL_OPEN, TOOL_CALL_CLOSE, read)
    return turn(content.strip(), calls, errors)
