"""What every tool-call format shares: the parse records (`ParseError`, `ParsedTurn`), reading a
call from JSON (`call_from_object`, `decode_call`), scanning delimited blocks (`scan_blocks`), and
typing an XML parameter's text by the tool's JSON schema (`typed_value`, `typed_call`).

The per-format parsers (`hermes`, `llama3`, `qwen3_xml`, `glm4`, `deepseek_v3`, `harmony`,
`pythonic`) build on these; `agentgrpo.chat.parsers` registers them. Kept apart from the registry so
that a format module can import it without a cycle.
"""

from __future__ import annotations

import ast
import json
import math
import re
import uuid
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

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


def not_json(raw: str, e: ValueError | RecursionError) -> ParseError:
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
    ValueError (JSONDecodeError included) or RecursionError, which `not_json` turns into an
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
        return ParseError(
            raw, f'unknown key(s) {unknown} in the tool call; the arguments go in "arguments"'
        )
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
        return ParseError(
            raw,
            "the tool call holds a lone UTF-16 surrogate (an unpaired \\ud800-"
            "\\udfff escape), which is not text",
            ToolErrorKind.BAD_JSON,
        )
    return ToolCall(id=_call_id(), name=obj["name"], arguments=args)


def decode_call(raw: str) -> ToolCall | ParseError:
    """One call's JSON text -> ToolCall, or a ParseError saying what is wrong with it."""
    try:
        obj = loads_call_json(raw)
    except (ValueError, RecursionError) as e:
        return not_json(raw, e)
    return call_from_object(obj, raw)


def turn(content: str, calls: list[ToolCall], errors: list[ParseError]) -> ParsedTurn:
    return ParsedTurn(Message(role="assistant", content=content, tool_calls=calls or None), errors)


TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
JSON_DECODER = json.JSONDecoder(parse_constant=_no_constants)


def scan_blocks(
    text: str, open_: str, close: str, read: Callable[[str], list[ToolCall | ParseError]]
) -> tuple[str, list[ToolCall], list[ParseError]]:
    """Every `open_ ... close` block of `text` read by `read`; the text outside the blocks is the
    content. A block still open at the end of the text (the turn hit its token limit) is
    UNCLOSED."""
    calls: list[ToolCall] = []
    errors: list[ParseError] = []
    content: list[str] = []
    pos = 0
    while (start := text.find(open_, pos)) >= 0:
        content.append(text[pos:start])
        body = start + len(open_)
        end = text.find(close, body)
        if end < 0:
            errors.append(
                ParseError(
                    text[body:].strip(),
                    f"the tool call was not closed with {close}",
                    ToolErrorKind.UNCLOSED,
                )
            )
            pos = len(text)
            break
        for call in read(text[body:end]):
            (errors if isinstance(call, ParseError) else calls).append(call)
        pos = end + len(close)
    content.append(text[pos:])
    return "".join(content), calls, errors


TOOL_NAME = re.compile(r"[^\s<>()\[\]{}]+")  # a tool name: no whitespace, tags or brackets


def param_schemas(tools: Sequence[Mapping] | None) -> dict[str, dict[str, Any]]:
    """Tool name -> the JSON schemas of its parameters (`parameters.properties`), from OpenAI-style
    tool schemas (`{"type": "function", "function": {...}}`) or bare function schemas."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools or []:
        fn = tool.get("function", tool) if isinstance(tool, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str):
            continue
        params = fn.get("parameters")
        props = params.get("properties") if isinstance(params, Mapping) else None
        out[fn["name"]] = dict(props) if isinstance(props, Mapping) else {}
    return out


# Type names some tool schemas use instead of JSON Schema's, read as the JSON type they name (as
# vLLM's Qwen3 parsers read them); a type name that is neither says nothing about the value.
_TYPE_ALIASES = {
    **dict.fromkeys(("int", "uint", "long", "short", "unsigned"), "integer"),
    **dict.fromkeys(("float", "double", "num"), "number"),
    **dict.fromkeys(("bool", "binary"), "boolean"),
    **dict.fromkeys(("dict",), "object"),
    **dict.fromkeys(("list", "arr"), "array"),
    **dict.fromkeys(("str", "text", "varchar", "char", "enum"), "string"),
}
_JSON_TYPES = frozenset({"string", "integer", "number", "boolean", "object", "array", "null"})


def _schema_types(schema: object) -> set[str]:
    """The JSON types a schema allows (`type`, a list of types, or the branches of anyOf/oneOf),
    with the aliases above read as the JSON type they name and other names left out."""
    if not isinstance(schema, Mapping):
        return set()
    kind = schema.get("type")
    types = (
        {kind}
        if isinstance(kind, str)
        else {t for t in kind if isinstance(t, str)}
        if isinstance(kind, list)
        else set()
    )
    for key in ("anyOf", "oneOf"):
        branches = schema.get(key)
        for branch in branches if isinstance(branches, list) else []:
            types |= _schema_types(branch)
    return {_TYPE_ALIASES.get(t, t) for t in types} & _JSON_TYPES


_BOOLS = {"true": True, "True": True, "false": False, "False": False}  # JSON, and Jinja's `string`
_NULLS = ("null", "None")
_INTEGER = re.compile(r"-?\d+")


def typed_value(text: str, schema: object) -> object:
    """An XML parameter's text as the value its JSON schema asks for.

    The XML templates print a string as it is and other values with `tojson` (Qwen3.6, GLM) or
    Jinja's `string` (Qwen3.5, Nemotron 3: `True`, `None`), so the text alone cannot say whether
    "5" is a number: the schema decides. A schema that allows a string (or says nothing: no
    `type`, an unknown tool or parameter) keeps the text, except the null literal where null is
    allowed; otherwise the first of null, boolean, integer, number, object, array that the text
    reads as wins. The text is also read as the content of a JSON string ("42" in quotes) and, where
    it holds escaped quotes, with one level of JSON escaping undone (GLM-4.6 writes objects so);
    an object or array may be a Python literal (single quotes, `True`). Raises ValueError naming
    the expected types when no reading fits.
    """
    types = _schema_types(schema)
    value = text.strip()
    if "null" in types and value in _NULLS:
        return None
    if not types or "string" in types:
        return text
    for reading in _readings(value):
        got = _read_as(reading, types)
        if got is not _NO_READING:
            return got
    raise ValueError(f"expected {' or '.join(sorted(types))}")


_NO_READING = object()


def _readings(value: str) -> Iterator[str]:
    """`value`, then the string a JSON string literal holds, then `value` less one level of JSON
    escaping where it holds an escaped quote."""
    yield value
    wrapped = [value] if len(value) > 1 and value[0] == value[-1] == '"' else []
    if '\\"' in value:
        wrapped.append(f'"{value}"')
    for literal in wrapped:
        try:
            inner = json.loads(literal)
        except ValueError:
            continue
        if isinstance(inner, str):
            yield inner.strip()


def _read_as(value: str, types: set[str]) -> object:
    """`value` as the first of boolean, integer, number, object, array in `types` it reads as;
    `_NO_READING` where none does."""
    if "boolean" in types and value in _BOOLS:
        return _BOOLS[value]
    if "integer" in types and _INTEGER.fullmatch(value) and len(value) <= 4300:
        return int(value)
    try:
        decoded = loads_call_json(value)
    except (ValueError, RecursionError):
        decoded = _NO_READING
        if types & {"object", "array"}:
            try:
                decoded = python_literal(value)
            except ValueError:
                pass
    finite = type(decoded) is int or (type(decoded) is float and math.isfinite(decoded))
    if (
        ("number" in types and finite)
        or ("object" in types and isinstance(decoded, dict))
        or ("array" in types and isinstance(decoded, list))
    ):
        return decoded
    return _NO_READING


def typed_call(
    name: str, pairs: list[tuple[str, str]], schemas: dict[str, dict[str, Any]], raw: str
) -> ToolCall | ParseError:
    """A call from its name and (parameter, text) pairs, each value typed by the tool's schema."""
    if not TOOL_NAME.fullmatch(name):
        return ParseError(raw, f"{name!r} is not a tool name")
    props = schemas.get(name, {})
    args: dict[str, object] = {}
    for key, text in pairs:
        if key in args:
            return ParseError(raw, f"parameter {key!r} is given twice")
        try:
            args[key] = typed_value(text, props.get(key))
        except ValueError as e:
            return ParseError(
                raw,
                f"parameter {key!r} of {name}: {e}, got {text.strip()[:80]!r}",
                ToolErrorKind.INVALID_ARGUMENTS,
            )
    return call_from_object({"name": name, "arguments": args}, raw)


def key_value_pairs(
    inner: str, pattern: re.Pattern[str], what: str, raw: str
) -> list[tuple[str, str]] | ParseError:
    """The (key, value) matches of `pattern` in `inner`, which must hold nothing else but space."""
    pairs, pos = [], 0
    for m in pattern.finditer(inner):
        if inner[pos : m.start()].strip():
            break
        pairs.append((m.group(1).strip(), m.group(2)))
        pos = m.end()
    if inner[pos:].strip():
        return ParseError(raw, f"text that is not a closed {what}: {inner[pos:].strip()[:80]!r}")
    return pairs


# ---------------------------------------------------------------------------------------------
# Python literals: the pythonic format's arguments, and a value some models write in Python syntax

_JSON_NAMES = {"true": True, "false": False, "null": None}  # LFM's template prints dicts as JSON


class NotLiteral(ValueError):
    """Python source that is not a literal (a name, an operation, a call): never evaluated."""


def literal_value(node: ast.AST) -> object:
    """A Python literal (or a JSON constant) as its JSON value: a set or tuple becomes a list.
    Anything that would need evaluating (a name, an operation, a call) raises NotLiteral."""
    if isinstance(node, ast.Constant) and type(node.value) in (str, bool, int, float, type(None)):
        if isinstance(node.value, float) and not math.isfinite(node.value):
            raise NotLiteral("a non-finite number is not JSON")
        return node.value
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if (
        isinstance(node, ast.UnaryOp)
        and isinstance(node.op, (ast.USub, ast.UAdd))
        and isinstance(node.operand, ast.Constant)
        and type(node.operand.value) in (int, float)
    ):
        return literal_value(node.operand) * (-1 if isinstance(node.op, ast.USub) else 1)
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return [literal_value(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        out = {}
        for k, v in zip(node.keys, node.values, strict=True):
            if k is None or not isinstance(key := literal_value(k), str):
                raise NotLiteral("a dict key that is not a string")
            out[key] = literal_value(v)
        return out
    raise NotLiteral(f"{type(node).__name__.lower()} is not a literal")


def parse_python(source: str) -> ast.expression:
    """`source` parsed as one Python expression. Raises ValueError (SyntaxError included) with the
    reason, never anything else: null bytes, huge ints and deep nesting are model text too."""
    try:
        with warnings.catch_warnings():  # "invalid escape sequence" warnings for model text
            warnings.simplefilter("ignore")
            return ast.parse(source, mode="eval")
    except SyntaxError as e:
        raise ValueError(e.msg) from e
    except (ValueError, RecursionError, MemoryError) as e:
        raise ValueError(str(e).split(";")[0] or type(e).__name__) from e


def python_literal(source: str) -> object:
    """`source` read as one Python literal (JSON's true/false/null too); nothing is evaluated.
    Raises ValueError when it is not one."""
    return literal_value(parse_python(source.strip()).body)
