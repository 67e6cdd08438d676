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

One module per format family, each the parser's rules in its docstring: `hermes` (Hermes, Qwen2.5,
Qwen3), `llama3_json` (`llama3`), `qwen3_xml` (Qwen3.5/3.6, Qwen3-Coder, Nemotron 3), `glm4`
(GLM-4.5 to 4.7), `deepseek_v3`, `harmony` (GPT-OSS), `pythonic` (LFM2/LFM2.5, Llama 3.2/4
pythonic); `calls` holds what they share. Each accepts what SGLang's and vLLM's parsers of its
format run, checked case by case against their own tests (tests/test_parsers_reference.py; the
deliberate differences are in docs/environments.md).

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

from collections.abc import Callable, Mapping, Sequence

from agentgrpo.chat.calls import (
    TOOL_CALL_OPEN,
    ParsedTurn,
    ParseError,
    call_from_object,
    decode_call,
    loads_call_json,
    typed_value,
)
from agentgrpo.chat.deepseek_v3 import DS_CALL_BEGIN, parse_deepseek_v3
from agentgrpo.chat.glm4 import parse_glm4
from agentgrpo.chat.harmony import parse_harmony
from agentgrpo.chat.hermes import parse_hermes
from agentgrpo.chat.llama3 import LLAMA_PYTHON_TAG, parse_llama3_json
from agentgrpo.chat.pythonic import PY_CALL_START, parse_pythonic
from agentgrpo.chat.qwen3_xml import parse_qwen3_xml

__all__ = [
    "PARSERS",
    "LLAMA_PYTHON_TAG",
    "ParseError",
    "ParsedTurn",
    "Parser",
    "call_from_object",
    "decode_call",
    "detect_parser",
    "get_parser",
    "loads_call_json",
    "parse_deepseek_v3",
    "parse_glm4",
    "parse_harmony",
    "parse_hermes",
    "parse_llama3_json",
    "parse_pythonic",
    "parse_qwen3_xml",
    "typed_value",
]

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
    ("hermes", TOOL_CALL_OPEN),
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
