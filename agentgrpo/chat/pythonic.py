"""Python-style tool calls `[name(key=value, ...)]` (LFM2 / LFM2.5, Llama 3.2 pythonic)."""

from __future__ import annotations

import ast
import math
import re
import warnings
from collections.abc import Mapping, Sequence

from agentgrpo.chat.calls import (
    ParsedTurn,
    ParseError,
    call_from_object,
    scan_blocks,
    turn,
)
from agentgrpo.types import ToolCall, ToolErrorKind

PY_CALL_START, PY_CALL_END = "<|tool_call_start|>", "<|tool_call_end|>"
_PY_LOOKS_LIKE_CALLS = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(")
_JSON_NAMES = {"true": True, "false": False, "null": None}  # LFM's template prints dicts as JSON


class _NotLiteral(ValueError):
    pass


def _literal(node: ast.AST) -> object:
    """A Python literal (or a JSON constant) as its value; anything that would need evaluating
    (a name, an operation, a call) raises _NotLiteral."""
    if isinstance(node, ast.Constant) and type(node.value) in (str, bool, int, float, type(None)):
        if isinstance(node.value, float) and not math.isfinite(node.value):
            raise _NotLiteral("a non-finite number is not JSON")
        return node.value
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if (
        isinstance(node, ast.UnaryOp)
        and isinstance(node.op, (ast.USub, ast.UAdd))
        and isinstance(node.operand, ast.Constant)
        and type(node.operand.value) in (int, float)
    ):
        return _literal(node.operand) * (-1 if isinstance(node.op, ast.USub) else 1)
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        out = {}
        for k, v in zip(node.keys, node.values, strict=True):
            if k is None or not isinstance(key := _literal(k), str):
                raise _NotLiteral("a dict key that is not a string")
            out[key] = _literal(v)
        return out
    raise _NotLiteral(f"{type(node).__name__.lower()} is not a literal")


def _call_from_ast(node: ast.AST, source: str) -> ToolCall | ParseError:
    raw = ast.get_source_segment(source, node) or source
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
        return ParseError(raw, "each tool call must be name(key=value, ...) with a plain name")
    if node.args or any(k.arg is None for k in node.keywords):
        return ParseError(raw, "a tool call's arguments must be given as key=value")
    try:
        args = {k.arg: _literal(k.value) for k in node.keywords}
    except _NotLiteral as e:
        return ParseError(raw, f"the arguments must be literals ({e})")
    return call_from_object({"name": node.func.id, "arguments": args}, raw)


def _escape_raw_newlines(source: str) -> str:
    """`source` with line breaks inside quoted strings escaped: LFM's template prints a string
    argument between single quotes as it is, so a multi-line value spans lines."""
    out, quote, i = [], "", 0
    while i < len(source):
        ch = source[i]
        if quote and ch == "\\":
            out.append(source[i : i + 2])
            i += 2
            continue
        if quote and ch in "\r\n":
            ch = "\\n" if ch == "\n" else "\\r"
        elif quote and ch == quote:
            quote = ""
        elif not quote and ch in "'\"":
            quote = ch
        out.append(ch)
        i += 1
    return "".join(out)


def _read_pythonic(block: str) -> list[ToolCall | ParseError]:
    source = block.strip()
    tree = None
    for attempt in (source, _escape_raw_newlines(source)):
        try:
            with warnings.catch_warnings():  # "invalid escape sequence" warnings for model text
                warnings.simplefilter("ignore")
                tree = ast.parse(attempt, mode="eval")
            source = attempt
            break
        except SyntaxError as e:
            why = e.msg
        except (ValueError, RecursionError, MemoryError) as e:  # null bytes, huge ints, nesting
            why = str(e).split(";")[0] or type(e).__name__
    if tree is None:
        return [
            ParseError(
                source,
                f"the tool call is not valid Python call syntax ({why})",
                ToolErrorKind.BAD_JSON,
            )
        ]
    nodes = tree.body.elts if isinstance(tree.body, ast.List) else [tree.body]
    return [_call_from_ast(node, source) for node in nodes]


def parse_pythonic(text: str, tools: Sequence[Mapping] | None = None) -> ParsedTurn:
    """Python-style calls `[name(key=value, ...), ...]`: LFM2.5 between `<|tool_call_start|>` and
    `<|tool_call_end|>` (text outside is content), Llama 3.2's pythonic format as the whole turn.

    Parsed with `ast` and read as literals only (strings, numbers, booleans, None, lists, dicts,
    and JSON's true/false/null, which LFM's template prints inside dicts); nothing is evaluated.
    Without the markers the turn is calls only when it starts like `[name(`; otherwise it is an
    answer. Python syntax errors are BAD_JSON, a non-literal or positional argument a BAD_CALL.
    LFM's template quotes strings without escaping: a line break inside one is read as "\\n", but
    a string holding `'` (or a backslash) does not come back as it was.
    """
    if PY_CALL_START in text:
        content, calls, errors = scan_blocks(text, PY_CALL_START, PY_CALL_END, _read_pythonic)
        return turn(content.strip(), calls, errors)
    stripped = text.strip()
    if not _PY_LOOKS_LIKE_CALLS.match(stripped):
        return turn(stripped, [], [])
    calls, errors = [], []
    for call in _read_pythonic(stripped):
        (errors if isinstance(call, ParseError) else calls).append(call)
    return turn("", calls, errors)
