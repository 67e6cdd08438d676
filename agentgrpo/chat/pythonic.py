"""Python-style tool calls `[name(key=value, ...)]` (LFM2 / LFM2.5, Llama 3.2 and Llama 4 pythonic).

The calls are read with `ast` as literals only; nothing is evaluated. What the serving engines'
parsers accept is accepted here too (tests/test_parsers_reference.py): LFM's JSON form inside the
markers, dotted names, sets, zero-padded integers, and the strings LFM's template prints without
escaping (a raw line break, a NUL, a quote of the same kind inside), which are repaired before the
call is read. Positional arguments stay an error: a call that silently loses one is not the call
the model wrote.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Mapping, Sequence

from agentgrpo.chat.calls import (
    ParsedTurn,
    ParseError,
    call_from_object,
    literal_value,
    loads_call_json,
    not_json,
    parse_python,
    python_literal,
    scan_blocks,
    turn,
)
from agentgrpo.types import ToolCall, ToolErrorKind

PY_CALL_START, PY_CALL_END = "<|tool_call_start|>", "<|tool_call_end|>"
LLAMA4_START, LLAMA4_END = "<|python_start|>", "<|python_end|>"  # Llama 4's markers
_CALL_LIST = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(")  # the start of `[name(`
_NEXT_CALL = re.compile(r"\)\s*,\s*(?=[A-Za-z_][\w.]*\s*\()")  # `), name(` between two calls
# What may follow the quote that ends a string argument: the end of a list, dict, key or call, or a
# comma then the next argument or element.
_STRING_END = re.compile(
    r"\s*(?:[\]}:]|$|\)\s*(?:[,\]]|$)"
    r"|,\s*(?:[A-Za-z_]\w*\s*=|[-'\"\d\[{]|(?:True|False|None|true|false|null)\b))"
)
_ZERO_PADDED = re.compile(r"(?<![\w.])0+(?=\d)")


def _call_name(func: ast.expr) -> str | None:
    """`name` or `a.b.name` (vLLM accepts dotted names), else None."""
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute) and (base := _call_name(func.value)):
        return f"{base}.{func.attr}"
    return None


def _call_from_ast(node: ast.AST, source: str) -> ToolCall | ParseError:
    raw = ast.get_source_segment(source, node) or source
    if isinstance(node, ast.Dict):  # a JSON-form call inside a Python list
        try:
            return call_from_object(literal_value(node), raw)
        except ValueError as e:
            return ParseError(raw, f"the tool call is not a literal ({e})")
    name = _call_name(node.func) if isinstance(node, ast.Call) else None
    if name is None:
        return ParseError(raw, "each tool call must be name(key=value, ...)")
    if node.args or any(k.arg is None for k in node.keywords):
        return ParseError(raw, "a tool call's arguments must be given as key=value")
    try:
        args = {k.arg: literal_value(k.value) for k in node.keywords}
    except ValueError as e:
        return ParseError(raw, f"the arguments must be literals ({e})")
    return call_from_object({"name": name, "arguments": args}, raw)


def _repair(source: str) -> str:
    """`source` as Python would read what LFM's template meant: inside a string, a line break or
    NUL is escaped, and a quote of the string's own kind closes it only where Python syntax goes
    on after it (`)` then `,` or `]`, `, key=`, a bracket); otherwise it is part of the text,
    unless a letter follows it (`'it's'` could end there): then the source is left as it is.
    Outside strings, zero-padded integers (`07`) lose their zeros."""
    out: list[str] = []
    quote, i = "", 0
    while i < len(source):
        ch = source[i]
        if not quote:
            if ch in "'\"":
                quote = ch
            elif ch.isdigit() and (m := _ZERO_PADDED.match(source, i)):
                i = m.end()
                continue
            out.append(ch)
        elif ch == "\\":
            out.append(source[i : i + 2])
            i += 1
        elif ch == quote:
            closes = _STRING_END.match(source, i + 1)
            if not closes and source[i + 1 : i + 2].isalpha():
                return source  # `'it's'`: the end of a string, or not? Left unread.
            quote = "" if closes else quote
            out.append(ch if closes else "\\" + ch)
        else:
            out.append({"\n": "\\n", "\r": "\\r", "\x00": "\\x00"}.get(ch, ch))
        i += 1
    return "".join(out)


def _nodes(source: str) -> list[ast.expr]:
    """The elements of a call list (a bare call or calls without brackets are one list). Raises
    ValueError naming why the source is not Python, after the repair."""
    why = ""
    for attempt in (source, _repair(source)):
        try:
            body = parse_python(attempt).body
        except ValueError as e:
            why = why or str(e)
            continue
        return body.elts if isinstance(body, (ast.List, ast.Tuple)) else [body]
    raise ValueError(why)


def _read_calls(source: str) -> list[ToolCall | ParseError]:
    """The calls of one list `[...]`; where it is not Python as a whole, each `name(...)` in it is
    read on its own (vLLM keeps the calls that parse), and the others are BAD_JSON."""
    try:
        return [_call_from_ast(node, source) for node in _nodes(source)]
    except ValueError as e:
        whole = e
    inner = source.strip()
    inner = inner[1:-1] if inner.startswith("[") and inner.endswith("]") else inner
    cuts = [m.start() + 1 for m in _NEXT_CALL.finditer(inner)]
    pieces = [
        inner[a:b].strip(" ,\n") for a, b in zip([0, *cuts], [*cuts, len(inner)], strict=True)
    ]
    out: list[ToolCall | ParseError] = []
    for piece in pieces if len(pieces) > 1 else []:
        try:
            out += [_call_from_ast(node, piece) for node in _nodes(piece)]
        except ValueError as e:
            out.append(_not_python(piece, e))
    return out or [_not_python(source, whole)]


def _not_python(source: str, e: ValueError) -> ParseError:
    why = f"the tool call is not valid Python call syntax ({e})"
    return ParseError(source, why, ToolErrorKind.BAD_JSON)


def _read_block(block: str) -> list[ToolCall | ParseError]:
    """One marked block: a Python call list, or LFM's JSON form (an object or a list of them)."""
    source = block.strip()
    if not source:
        return []
    if source.startswith("{") or re.match(r"\[\s*\{", source):
        try:
            obj = loads_call_json(source)
        except (ValueError, RecursionError) as e:
            try:
                obj = python_literal(source)
            except ValueError:
                return [not_json(source, e)]
        return [call_from_object(o, source) for o in (obj if isinstance(obj, list) else [obj])]
    if not source.startswith("["):
        source = f"[{source}]"
    return _read_calls(source)


def _drop_echoes(text: str) -> str:
    """`text` less what LFM sometimes writes after a call block: the block's body again, capped
    with a second end marker. Text before a stray end marker is such an echo."""
    pieces = text.split(PY_CALL_START)
    for i, piece in enumerate(pieces):
        first_end = piece.find(PY_CALL_END) if i else -1
        last_end = piece.rfind(PY_CALL_END)
        if last_end > first_end:
            start = first_end + len(PY_CALL_END) if first_end >= 0 else 0
            pieces[i] = piece[: max(start, 0)] + piece[last_end + len(PY_CALL_END) :]
    return PY_CALL_START.join(pieces)


def _list_end(text: str, start: int) -> int:
    """The index after the `]` that closes the list opening at `start` (quotes respected), or
    where that cannot be told (a quote left open) the end of the text if it ends with `]`; -1."""
    depth, quote, i = 0, "", start
    while i < len(text):
        ch = text[i]
        if quote:
            i += ch == "\\"
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                return i + 1 if ch == "]" else -1
        i += 1
    return len(text) if text.rstrip().endswith("]") else -1


def _inline_calls(text: str) -> ParsedTurn:
    """Call lists written without markers, anywhere in the turn (SGLang reads them so): the text
    around them is content. A list that does not parse is content, unless the turn is only it."""
    calls: list[ToolCall] = []
    errors: list[ParseError] = []
    content: list[str] = []
    pos = 0
    for m in _CALL_LIST.finditer(text):
        if m.start() < pos:
            continue
        if (end := _list_end(text, m.start())) < 0:
            if not text[pos : m.start()].strip() and not calls:  # the turn is a cut-off call
                why = "the tool call list was not closed with ]"
                errors.append(ParseError(text[m.start() :], why, ToolErrorKind.UNCLOSED))
                pos = len(text)
                break
            continue
        read = _read_calls(text[m.start() : end])
        if not any(isinstance(c, ToolCall) for c in read) and text[: m.start()].strip():
            continue
        content.append(text[pos : m.start()])
        for call in read:
            (errors if isinstance(call, ParseError) else calls).append(call)
        pos = end
    content.append(text[pos:])
    return turn("".join(content).strip(), calls, errors)


def parse_pythonic(text: str, tools: Sequence[Mapping] | None = None) -> ParsedTurn:
    """Python-style calls `[name(key=value, ...), ...]`: LFM2.5 between `<|tool_call_start|>` and
    `<|tool_call_end|>`, Llama 4 between `<|python_start|>` and `<|python_end|>`, Llama 3.2 as a
    list in the text; the text outside the calls is the content.

    Read as literals only (strings, numbers, booleans, None, lists, dicts, sets as lists, and JSON's
    true/false/null, which LFM's template prints inside dicts); nothing is evaluated. Inside the
    markers LFM may also write JSON calls (`[{"name": ..., "arguments": {...}}]`). Python syntax
    errors are BAD_JSON, a non-literal or positional argument a BAD_CALL, an unclosed block
    UNCLOSED. The arguments are typed by Python's syntax, so `tools` is not used.
    """
    text = text.replace(LLAMA4_START, PY_CALL_START).replace(LLAMA4_END, PY_CALL_END)
    if PY_CALL_START in text:
        content, calls, errors = scan_blocks(
            _drop_echoes(text), PY_CALL_START, PY_CALL_END, _read_block
        )
        return turn(content.strip(), calls, errors)
    return _inline_calls(text)
