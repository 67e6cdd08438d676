r"""Tool-call parsers: the model's decoded text -> an assistant Message plus malformed calls.

A parser is a function `(text, tools) -> ParsedTurn`, registered by name in `PARSERS` and chosen
with `ChatFormat(parser=...)` (config: `model.tool_parser`; `auto`, the default, picks the parser
from the chat template with `detect_parser`). `tools` are the env's tool schemas (OpenAI style,
`{"type": "function", "function": {"name", "parameters"}}`) or None; the XML formats need them,
since their argument values are text that only the tool's JSON schema can type. A parser never
raises on model output: a call it cannot use comes back as a `ParseError` with a `ToolErrorKind`,
which the rollout answers with an error tool message so the model can try again. The kinds:
BAD_JSON (the call's payload does not parse: JSON, or Python syntax for `pythonic`), BAD_CALL (it
parses but is not a call: no name, stray text, arguments that are not an object or not literals),
UNCLOSED (the call was cut off), INVALID_ARGUMENTS (an XML parameter's text is not of the type its
schema asks for).

Formats (one per family; see docs/rollouts.md, "Tool-call parsers"):
- `hermes` (Hermes, Qwen2.5/Qwen3/Qwen3-2507, SmolLM2 with agentgrpo's template): any number of
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks; text outside them is content.
- `llama3_json` (Llama 3.1/3.2/3.3 custom tools): the whole turn is a JSON object
  `{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`; several calls may be
  separated by `;` (Llama's template renders one call per turn; a model may still emit several).
- `qwen3_xml` (Qwen3.5, Qwen3.6, Qwen3-Coder, Nemotron 3): `<tool_call><function=NAME>` then
  `<parameter=KEY>VALUE</parameter>` per argument, `</function></tool_call>`; values typed by
  schema.
- `glm4` (GLM-4.5/4.6): `<tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>...
  </tool_call>`; values typed by schema.
- `deepseek_v3` (DeepSeek-V3/R1): `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` then the
  arguments as a ```json block, `<｜tool▁call▁end｜>`, inside `<｜tool▁calls▁begin｜>...end`.
- `harmony` (GPT-OSS): messages `<|channel|>commentary to=functions.NAME ...<|message|>{json}`
  `<|call|>` (the recipient may also stand before the channel); the final channel is the content.
- `pythonic` (LFM2/LFM2.5, Llama 3.2 pythonic): a Python list of calls `[name(key=value, ...)]`
  between `<|tool_call_start|>` and `<|tool_call_end|>`, or as the whole turn; read with `ast`
  (literals only, nothing is evaluated).

Example (a parser for `<function=NAME>{json arguments}</function>`):
    >>> def parse_function_tags(text: str, tools: Sequence[Mapping] | None = None) -> ParsedTurn:
    ...     calls, errors = [], []
    ...     for name, args in re.findall(r"<function=([\w-]+)>(.*?)</function>", text, re.DOTALL):
    ...         try:
    ...             call = call_from_object({"name": name, "arguments": json.loads(args)}, args)
    ...         except json.JSONDecodeError as e:
    ...             msg = f"arguments are not valid JSON ({e.msg})"
    ...             call = ParseError(args, msg, ToolErrorKind.BAD_JSON)
    ...         (errors if isinstance(call, ParseError) else calls).append(call)
    ...     content = re.sub(r"<function=.*?</function>", "", text, flags=re.DOTALL).strip()
    ...     message = Message(role="assistant", content=content, tool_calls=calls or None)
    ...     return ParsedTurn(message, errors)
    >>> PARSERS["function_tags"] = parse_function_tags
"""

from __future__ import annotations

import ast
import json
import math
import re
import uuid
import warnings
from collections.abc import Callable, Mapping, Sequence
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
        return _not_json(raw, e)
    return call_from_object(obj, raw)


def _turn(content: str, calls: list[ToolCall], errors: list[ParseError]) -> ParsedTurn:
    return ParsedTurn(Message(role="assistant", content=content, tool_calls=calls or None), errors)


_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_DECODER = json.JSONDecoder(parse_constant=_no_constants)


def parse_hermes(text: str, tools: Sequence[Mapping] | None = None) -> ParsedTurn:
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
                errors.append(
                    ParseError(
                        text[body:].strip(),
                        "the tool call was not closed with </tool_call>",
                        ToolErrorKind.UNCLOSED,
                    )
                )
                pos = len(text)
                break
            call, pos = decode_call(text[body:close].strip()), close + len(_CLOSE)
        (errors if isinstance(call, ParseError) else calls).append(call)
    content.append(text[pos:])
    return _turn("".join(content).strip(), calls, errors)


LLAMA_PYTHON_TAG = "<|python_tag|>"


def parse_llama3_json(text: str, tools: Sequence[Mapping] | None = None) -> ParsedTurn:
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
    body = stripped[len(LLAMA_PYTHON_TAG) :].lstrip() if tagged else stripped
    if not body.startswith("{"):
        if tagged:  # Llama's built-in tool syntax (`brave_search.call(...)`, ipython code)
            return _turn(
                "",
                [],
                [
                    ParseError(
                        body,
                        f"after {LLAMA_PYTHON_TAG} a tool call must be "
                        'a JSON object {"name": ..., "parameters": {...}}; '
                        "built-in tool syntax is not supported",
                    )
                ],
            )
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
            return _turn(
                "",
                calls,
                [
                    ParseError(
                        body[pos:],
                        "text after a tool call; in this format "
                        "a turn is either tool calls or an answer",
                    )
                ],
            )
    return _turn("", calls, [])


# ---------------------------------------------------------------------------------------------
# Shared by the formats with their own delimiters


def _scan(
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


_NAME = re.compile(r"[^\s<>()\[\]{}]+")  # a tool name: no whitespace, tags or brackets


def _param_schemas(tools: Sequence[Mapping] | None) -> dict[str, dict[str, Any]]:
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


def _schema_types(schema: object) -> set[str]:
    """The JSON types a schema allows (`type`, a list of types, or the branches of anyOf/oneOf)."""
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
    return types


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
    reads as wins. Raises ValueError naming the expected types when none does.
    """
    types = _schema_types(schema)
    value = text.strip()
    if "null" in types and value in _NULLS:
        return None
    if not types or "string" in types:
        return text
    if "boolean" in types and value in _BOOLS:
        return _BOOLS[value]
    if "integer" in types and _INTEGER.fullmatch(value) and len(value) <= 4300:
        return int(value)
    try:
        decoded = loads_call_json(value)
    except (ValueError, RecursionError):
        decoded = None
    finite = type(decoded) is int or (type(decoded) is float and math.isfinite(decoded))
    if (
        ("number" in types and finite)
        or ("object" in types and isinstance(decoded, dict))
        or ("array" in types and isinstance(decoded, list))
    ):
        return decoded
    raise ValueError(f"expected {' or '.join(sorted(types))}")


def _typed_call(
    name: str, pairs: list[tuple[str, str]], schemas: dict[str, dict[str, Any]], raw: str
) -> ToolCall | ParseError:
    """A call from its name and (parameter, text) pairs, each value typed by the tool's schema."""
    if not _NAME.fullmatch(name):
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


def _pairs(
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
# qwen3_xml: Qwen3.5 / Qwen3.6 / Qwen3-Coder / Nemotron 3

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
    schemas = _param_schemas(tools)

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
        pairs = _pairs(m.group(2), _PARAMETER, "<parameter=KEY>...</parameter>", raw)
        if isinstance(pairs, ParseError):
            return [pairs]
        pairs = [(key, _one_newline_off(value)) for key, value in pairs]
        return [_typed_call(m.group(1).strip(), pairs, schemas, raw)]

    content, calls, errors = _scan(text, _OPEN, _CLOSE, read)
    return _turn(content.strip(), calls, errors)


# ---------------------------------------------------------------------------------------------
# glm4: GLM-4.5 / GLM-4.6

_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def parse_glm4(text: str, tools: Sequence[Mapping] | None = None) -> ParsedTurn:
    """GLM-4.5 calls: `<tool_call>NAME\\n<arg_key>KEY</arg_key>\\n<arg_value>VALUE</arg_value>...
    </tool_call>`, any number; text outside them is content.

    The name runs to the first `<arg_key>`; a value is the exact text between its tags, typed by
    the tool's schema (`typed_value`; without `tools` every value stays a string).
    """
    schemas = _param_schemas(tools)

    def read(body: str) -> list[ToolCall | ParseError]:
        raw = body.strip()
        cut = body.find("<arg_key>")
        name, inner = (body, "") if cut < 0 else (body[:cut], body[cut:])
        pairs = _pairs(inner, _GLM_ARG, "<arg_key>K</arg_key><arg_value>V</arg_value> pair", raw)
        if isinstance(pairs, ParseError):
            return [pairs]
        return [_typed_call(name.strip(), pairs, schemas, raw)]

    content, calls, errors = _scan(text, _OPEN, _CLOSE, read)
    return _turn(content.strip(), calls, errors)


# ---------------------------------------------------------------------------------------------
# deepseek_v3: DeepSeek-V3 / R1

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
    if not _NAME.fullmatch(name):
        return [ParseError(raw, f"{name!r} is not a tool name")]
    try:
        obj = loads_call_json(args)
    except (ValueError, RecursionError) as e:
        return [_not_json(args, e)]
    return [call_from_object({"name": name, "arguments": obj}, raw)]


def parse_deepseek_v3(text: str, tools: Sequence[Mapping] | None = None) -> ParsedTurn:
    """DeepSeek-V3 calls: `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```
    <｜tool▁call▁end｜>`, any number, normally inside
    `<｜tool▁calls▁begin｜>...<｜tool▁calls▁end｜>` (the section markers are optional: V3's template
    drops the opening one from later turns).
    Text outside the calls and markers is content; the arguments are JSON, so `tools` is not used.
    """
    content, calls, errors = _scan(text, DS_CALL_BEGIN, DS_CALL_END, _read_deepseek)
    content = content.replace(DS_CALLS_BEGIN, "").replace(DS_CALLS_END, "")
    return _turn(content.strip(), calls, errors)


# ---------------------------------------------------------------------------------------------
# harmony: GPT-OSS

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
    if not _NAME.fullmatch(name):
        return ParseError(raw, f"{name!r} is not a tool name")
    try:
        obj = loads_call_json(raw)
    except (ValueError, RecursionError) as e:
        if (
            not terminated
            and isinstance(e, json.JSONDecodeError)
            and (e.pos >= len(raw) or e.msg.startswith("Unterminated string"))
        ):  # ran out of text
            return ParseError(raw, "the tool call's JSON was cut off", ToolErrorKind.UNCLOSED)
        return _not_json(raw, e)
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
    return _turn(content, calls, errors)


# ---------------------------------------------------------------------------------------------
# pythonic: LFM2 / LFM2.5, Llama 3.2 pythonic

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
        content, calls, errors = _scan(text, PY_CALL_START, PY_CALL_END, _read_pythonic)
        return _turn(content.strip(), calls, errors)
    stripped = text.strip()
    if not _PY_LOOKS_LIKE_CALLS.match(stripped):
        return _turn(stripped, [], [])
    calls, errors = [], []
    for call in _read_pythonic(stripped):
        (errors if isinstance(call, ParseError) else calls).append(call)
    return _turn("", calls, errors)


# ---------------------------------------------------------------------------------------------
# The registry

Parser = Callable[[str, Sequence[Mapping] | None], ParsedTurn]

PARSERS: dict[str, Parser] = {
    "hermes": parse_hermes,
    "llama3_json": parse_llama3_json,
    "qwen3_xml": parse_qwen3_xml,
    "glm4": parse_glm4,
    "deepseek_v3": parse_deepseek_v3,
    "harmony": parse_harmony,
    "pythonic": parse_pythonic,
}

# What each format's template prints to show or render a call, most specific first (the XML
# templates also print `<tool_call>`, which alone means Hermes).
_TEMPLATE_MARKS = (
    ("pythonic", PY_CALL_START),
    ("glm4", "<arg_key>"),
    ("deepseek_v3", DS_CALL_BEGIN),
    ("harmony", "<|call|>"),
    ("qwen3_xml", "<function="),
    ("hermes", _OPEN),
    ("llama3_json", '"parameters": '),
)


def detect_parser(template: str | None) -> str | None:
    """The name of the parser for the tool-call format a chat template renders, or None when the
    template shows none of the known formats. A heuristic on the template's text (each format's
    own markers), for `model.tool_parser=auto`; the template audit checks the choice by parsing
    back the calls the template renders."""
    for name, mark in _TEMPLATE_MARKS:
        if template and mark in template:
            return name
    return None


def get_parser(name: str) -> Parser:
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; valid: {sorted(PARSERS)}")
    return PARSERS[name]
