"""DeepSeek-V3 / R1 tool calls between `<｜tool▁call▁begin｜>` and `<｜tool▁call▁end｜>`."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from agentgrpo.chat.calls import (
    TOOL_NAME,
    ParsedTurn,
    ParseError,
    call_from_object,
    loads_call_json,
    not_json,
    scan_blocks,
    turn,
)
from agentgrpo.types import ToolCall

DS_CALLS_BEGIN, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN, DS_CALL_END, DS_SEP = (
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁sep｜>",
)
_DS_BODY = re.compile(r"([^\n]*)\n```(?:json)?[ \t]*\n(.*?)\n?```\s*", re.DOTALL)


def _read_deepseek(body: str) -> list[ToolCall | ParseError]:
    raw = body.strip()
    kind, sep, rest = body.partition(DS_SEP)
    m = _DS_BODY.fullmatch(rest)
    if not sep or kind.strip() != "function" or m is None:
        return [
            ParseError(
                raw,
                f"a tool call must be function{DS_SEP}NAME followed by its "
                "arguments in a ```json block",
            )
        ]
    name, args = m.group(1).strip(), m.group(2)
    if not TOOL_NAME.fullmatch(name):
        return [ParseError(raw, f"{name!r} is not a tool name")]
    try:
        obj = loads_call_json(args)
    except (ValueError, RecursionError) as e:
        return [not_json(args, e)]
    return [call_from_object({"name": name, "arguments": obj}, raw)]


def parse_deepseek_v3(text: str, tools: Sequence[Mapping] | None = None) -> ParsedTurn:
    """DeepSeek-V3 calls: `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```
    <｜tool▁call▁end｜>`, any number, normally inside
    `<｜tool▁calls▁begin｜>...<｜tool▁calls▁end｜>` (the section markers are optional: V3's template
    drops the opening one from later turns).
    Text outside the calls and markers is content; the arguments are JSON, so `tools` is not used.
    """
    content, calls, errors = scan_blocks(text, DS_CALL_BEGIN, DS_CALL_END, _read_deepseek)
    content = content.replace(DS_CALLS_BEGIN, "").replace(DS_CALLS_END, "")
    return turn(content.strip(), calls, errors)
