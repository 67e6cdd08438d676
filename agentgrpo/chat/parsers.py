r"""Tool-call parsers: the model's decoded text -> an assistant Message plus malformed calls.

A parser is a function `(text, tools) -> ParsedTurn`, registered by name in `PARSERS` and chosen
with `ChatFormat(parser=...)` (config: `model.tool_parser`; `auto` picks it from the chat template
with `detect_parser`). `tools` are the env's tool schemas or None; the XML formats need them to
type argument values. A parser never raises on model output: a call it cannot use comes back as a
`ParseError` with a `ToolErrorKind`, which the rollout answers with an error tool message.

One module per format family, each the parser's rules in its docstring: `hermes`, `llama3_json`
(`llama3`), `qwen3_xml`, `glm4`, `deepseek_v3`, `harmony` (GPT-OSS), `pythonic`; `calls` holds
what they share. Each accepts what SGLang's and vLLM's parsers of its format accept, checked in
tests/test_parsers_reference.py. docs/chat.md has an example parser; docs/environments.md the
formats, the error kinds and the deliberate differences.
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
