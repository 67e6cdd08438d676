"""GPT-OSS harmony messages: `<|channel|>commentary to=functions.NAME ...<|message|>{json}`."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence

from agentgrpo.chat.calls import (
    TOOL_NAME,
    ParsedTurn,
    ParseError,
    call_from_object,
    loads_call_json,
    not_json,
    turn,
)
from agentgrpo.types import ToolCall, ToolErrorKind

HARMONY_START, HARMONY_MESSAGE = "<|start|>", "<|message|>"
_HARMONY_ENDS = re.compile(r"<\|(?:end|call|return)\|>")
_HARMONY_TO = re.compile(r"\bto=([^\s<]+)")
_HARMONY_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")
_HARMONY_ROLE = re.compile(r"\s*assistant\b")


def _harmony_call(recipient: str, body: str, terminated: bool) -> ToolCall | ParseError:
    raw = body.strip()
    if not recipient.startswith("functions."):
        return ParseError(
            raw,
            f"the recipient {recipient!r} is not a function: call "
            "functions.NAME (built-in tools such as browser or python are not "
            "supported)",
        )
    name = recipient[len("functions.") :]
    if not TOOL_NAME.fullmatch(name):
        return ParseError(raw, f"{name!r} is not a tool name")
    if not raw and terminated:  # an empty message: a call without arguments
        return call_from_object({"name": name, "arguments": {}}, raw)
    try:
        obj = loads_call_json(raw)
    except (ValueError, RecursionError) as e:
        if (
            not terminated
            and isinstance(e, json.JSONDecodeError)
            and (e.pos >= len(raw) or e.msg.startswith("Unterminated string"))
        ):  # ran out of text
            return ParseError(raw, "the tool call's JSON was cut off", ToolErrorKind.UNCLOSED)
        return not_json(raw, e)
    return call_from_object({"name": name, "arguments": obj}, raw)


def parse_harmony(text: str, tools: Sequence[Mapping] | None = None) -> ParsedTurn:
    """GPT-OSS harmony messages, continuing the generation prompt `<|start|>assistant`.

    The text is split into messages at `<|start|>` (each then opens with the role `assistant`); a
    message is a header, `<|message|>`, a body, and `<|end|>`, `<|call|>` or `<|return|>`. The last
    message may lack its terminator: that is the stop token, which `parse_assistant` removes. A
    header addressed `to=functions.NAME` (before or after `<|channel|>`) makes the body a JSON call;
    a cut-off call (unterminated, its JSON incomplete) is UNCLOSED. The content is the final
    channel's text, or where there is none the other channels' (the analysis before a call is what
    the template renders from an assistant message's content); text outside any message is content
    too. The arguments are JSON, so `tools` is not used.
    """
    calls: list[ToolCall] = []
    errors: list[ParseError] = []
    final: list[str] = []
    other: list[str] = []
    pieces = text.split(HARMONY_START)
    for i, piece in enumerate(pieces):
        if i > 0 and (role := _HARMONY_ROLE.match(piece)):
            piece = piece[role.end() :]
        header, has_body, rest = piece.partition(HARMONY_MESSAGE)
        recipient = _HARMONY_TO.search(header)
        if not has_body:
            if recipient:
                kind = ToolErrorKind.UNCLOSED if i == len(pieces) - 1 else ToolErrorKind.BAD_CALL
                errors.append(ParseError(header.strip(), "the tool call has no <|message|>", kind))
            elif piece.strip():
                other.append(piece.strip())
            continue
        end = _HARMONY_ENDS.search(rest)
        body, after = (rest[: end.start()], rest[end.end() :]) if end else (rest, "")
        if recipient:
            call = _harmony_call(recipient.group(1), body, end is not None)
            (errors if isinstance(call, ParseError) else calls).append(call)
        else:
            channel = _HARMONY_CHANNEL.search(header)
            (final if channel and channel.group(1) == "final" else other).append(body.strip())
        if after.strip():
            other.append(after.strip())
    content = "\n".join(t for t in (final or other) if t)
    return turn(content, calls, errors)
