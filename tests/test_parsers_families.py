"""Tool-call parsers of the model families' own templates (issue 30): each template in
agentgrpo/chat/templates/ that supports tools is attached to the embedded tokenizer, renders a
multi-turn tool conversation with typed arguments, and the parser detected from the template reads
back, from each assistant turn the template printed, the calls it rendered; malformed output of
each format maps to a ToolErrorKind."""

from __future__ import annotations

import json

import pytest

from agentgrpo.chat.format import HERMES_CHATML_TEMPLATE, ChatFormat
from agentgrpo.chat.parsers import PARSERS, detect_parser, get_parser, typed_value
from agentgrpo.types import ToolErrorKind
from tests.conftest import shipped_template

SCHEMA = {
    "type": "object",
    "properties": {
        "n": {"type": "integer"},
        "x": {"type": "number"},
        "ok": {"type": "boolean"},
        "opt": {"type": "object"},
        "note": {"type": "string"},
        "tags": {"type": "array"},
        "maybe": {"type": ["integer", "null"]},
    },
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "book", "description": "Book a slot.", "parameters": SCHEMA},
    },
    {
        "type": "function",
        "function": {
            "name": "cancel",
            "description": "Cancel.",
            "parameters": {"type": "object", "properties": {"id": {"type": "string"}}},
        },
    },
]
FIRST = {
    "n": 3,
    "x": 2.5,
    "ok": True,
    "opt": {"a": [1, {"b": None}], "c": "d"},
    "note": 'line one\nsay "hi" </b>',
    "tags": ["a", 2],
    "maybe": None,
}
SECOND = {"id": "42"}  # a string that reads as a number stays a string: the schema says string
THIRD = {"n": -7, "x": 0.125, "ok": False, "note": "  spaced  "}

# template -> (parser it gets, whether it renders several calls per turn, its end-of-turn text)
FAMILIES = {
    "qwen2_5.jinja": ("hermes", True, "<|im_end|>"),
    "qwen3.jinja": ("hermes", True, "<|im_end|>"),
    "qwen3_instruct_2507.jinja": ("hermes", True, "<|im_end|>"),
    "llama3_1.jinja": ("llama3_json", False, "<|eot_id|>"),
    "qwen3_5_think.jinja": ("qwen3_xml", True, "<|im_end|>"),
    "qwen3_6.jinja": ("qwen3_xml", True, "<|im_end|>"),
    "nemotron_3_nano.jinja": ("qwen3_xml", True, "<|im_end|>"),
    "glm4moe.jinja": ("glm4", True, ""),  # GLM's turn ends where the next role token starts
    "deepseekv3.jinja": ("deepseek_v3", True, "<｜end▁of▁sentence｜>"),
    "deepseekv3_tools.jinja": ("deepseek_v3", True, "<｜end▁of▁sentence｜>"),
    "gptoss.jinja": ("harmony", False, "<|call|>"),
    "lfm2_2_5.jinja": ("pythonic", True, "<|im_end|>"),
}


def _call(i: int, name: str, args: dict, as_string: bool) -> dict:
    return {
        "id": f"c{i}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(args) if as_string else args},
    }


def _conversation(parallel: bool, string_args: bool) -> list[dict]:
    """user, assistant (content + calls), tool result(s), assistant (a call), tool, final answer."""
    first = [_call(1, "book", FIRST, string_args)] + (
        [_call(2, "cancel", SECOND, string_args)] if parallel else []
    )
    msgs = [
        {"role": "system", "content": "You book slots."},
        {"role": "user", "content": "Book it."},
        {"role": "assistant", "content": "Booking now.", "tool_calls": first},
        {"role": "tool", "tool_call_id": "c1", "content": "booked"},
    ]
    if parallel:
        msgs.append({"role": "tool", "tool_call_id": "c2", "content": "cancelled"})
    msgs += [
        {"role": "assistant", "content": "", "tool_calls": [_call(3, "book", THIRD, string_args)]},
        {"role": "tool", "tool_call_id": "c3", "content": "booked again"},
        {"role": "assistant", "content": "Done."},
    ]
    return msgs


def _typed(calls) -> str:
    """Calls as JSON text: 3 and 3.0, True and 1 differ here, not under ==."""
    return json.dumps(calls, sort_keys=True)


def _turn_texts(tok, msgs: list[dict], eot: str) -> list[tuple[str, list]]:
    """(the text the template printed for assistant turn i, the calls it holds), for each
    tool-calling assistant turn: the render up to and with that turn, less the generation
    prompt's render (from where the two differ: some templates open a think block in the
    generation prompt only), less the end-of-turn text, the stop token `parse_assistant` removes."""
    out = []
    for i, m in enumerate(msgs):
        if m["role"] != "assistant" or not m.get("tool_calls"):
            continue
        gen = tok.apply_chat_template(
            msgs[:i], tools=TOOLS, tokenize=False, add_generation_prompt=True
        )
        full = tok.apply_chat_template(msgs[: i + 1], tools=TOOLS, tokenize=False)
        start = next((k for k, (a, b) in enumerate(zip(gen, full)) if a != b), len(gen))
        text = full[start:].rstrip("\n")
        if eot and text.endswith(eot):
            text = text[: -len(eot)]
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]]
        out.append((text, [(n, json.loads(a) if isinstance(a, str) else a) for n, a in calls]))
    return out


@pytest.fixture(scope="module")
def tok(smol_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smol_path)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_the_detected_parser_reads_back_the_calls_the_template_renders(tok, name):
    parser, parallel, eot = FAMILIES[name]
    template = shipped_template(name)
    assert detect_parser(template) == parser
    tok.chat_template = template
    # DeepSeek-V3's template concatenates the arguments as text: it takes them as a JSON string
    msgs = _conversation(parallel, string_args=name == "deepseekv3.jinja")
    turns = _turn_texts(tok, msgs, eot)
    assert len(turns) == 2
    chat = ChatFormat(tok, template=template)
    assert chat.parser_name == parser
    for text, want in turns:
        turn = get_parser(parser)(text, TOOLS)
        assert turn.errors == [], (text, turn.errors)
        assert _typed([(c.name, c.arguments) for c in turn.message.tool_calls]) == _typed(want), (
            text
        )
        # the same through the ids the model would have sampled
        ids = chat.encode(text) + [chat.end_of_turn_id]
        again = chat.parse_assistant(ids, tools=TOOLS)
        assert _typed([(c.name, c.arguments) for c in again.message.tool_calls]) == _typed(want)
    # the content around the first turn's calls comes back as content (Nemotron's begins with the
    # end of the think block the generation prompt opened; reasoning is left in content)
    first = get_parser(parser)(turns[0][0], TOOLS).message.content
    assert (
        first.endswith("Booking now.") or parser == "llama3_json"
    )  # Llama prints no content with a call


@pytest.mark.parametrize("name", ["gemma3.jinja", "phi3_5.jinja"])
def test_templates_without_tool_calls_get_no_parser(name):
    assert detect_parser(shipped_template(name)) is None


def test_auto_is_the_default_and_falls_back_to_hermes(tok):
    assert detect_parser(HERMES_CHATML_TEMPLATE) == "hermes"
    assert detect_parser(None) is None and detect_parser("{{ messages }}") is None
    assert ChatFormat(tok).parser_name == "hermes"  # SmolLM2 gets agentgrpo's Hermes ChatML
    assert ChatFormat(tok, template=shipped_template("phi3_5.jinja")).parser_name == "hermes"
    qwen = ChatFormat(tok, template=shipped_template("qwen3_6.jinja"), parser="hermes")
    assert qwen.parser_name == "hermes"  # a name given is a name kept
    with pytest.raises(ValueError, match="unknown tool-call parser 'qwen'; valid: .*pythonic"):
        ChatFormat(tok, parser="qwen")


def test_xml_values_are_typed_only_with_the_tools(tok):
    chat = ChatFormat(tok, template=shipped_template("qwen3_6.jinja"))
    text = (
        "<tool_call>\n<function=book>\n<parameter=n>\n3\n</parameter>\n<parameter=ok>\ntrue\n"
        "</parameter>\n</function>\n</tool_call>"
    )
    ids = chat.encode(text)
    assert chat.parse_assistant(ids, tools=TOOLS).message.tool_calls[0].arguments == {
        "n": 3,
        "ok": True,
    }
    assert chat.parse_assistant(ids).message.tool_calls[0].arguments == {"n": "3", "ok": "true"}


@pytest.mark.parametrize(
    "text, schema, value",
    [
        ("5", {"type": "integer"}, 5),
        (" -5\n", {"type": "integer"}, -5),
        ("5", {"type": "number"}, 5),
        ("1e-05", {"type": "number"}, 1e-05),  # Jinja's `string` of a small float
        ("True", {"type": "boolean"}, True),  # Jinja's `string` of a bool (Qwen3.5, Nemotron 3)
        ("false", {"type": "boolean"}, False),
        ("None", {"type": ["integer", "null"]}, None),
        ("null", {"anyOf": [{"type": "object"}, {"type": "null"}]}, None),
        ('{"a": [1]}', {"anyOf": [{"type": "object"}, {"type": "null"}]}, {"a": [1]}),
        ("5", {"type": "string"}, "5"),
        ("5", {"type": ["integer", "string"]}, "5"),  # the text cannot say which: a string is kept
        ("\n  x \n", {"type": "string"}, "\n  x \n"),  # a string keeps its spaces
        ("5", None, "5"),  # an unknown tool or parameter, or a schema without a type
        ("5", {"description": "anything"}, "5"),
    ],
)
def test_typed_value_follows_the_schema(text, schema, value):
    assert _typed(typed_value(text, schema)) == _typed(value)


@pytest.mark.parametrize(
    "text, schema",
    [
        ("three", {"type": "integer"}),
        ("3.0", {"type": "integer"}),
        ("1e999", {"type": "number"}),
        ("NaN", {"type": "number"}),
        ("yes", {"type": "boolean"}),
        ('{"a": ', {"type": "object"}),
        ("[1]", {"type": "object"}),
        ("None", {"type": "integer"}),
        ("1" * 5000, {"type": "integer"}),
    ],
)
def test_typed_value_refuses_text_of_another_type(text, schema):
    with pytest.raises(ValueError, match="expected"):
        typed_value(text, schema)


XML = "<tool_call>\n<function=book>\n{}</function>\n</tool_call>"
HARMONY = "<|channel|>commentary to=functions.book <|constrain|>json<|message|>"
DS = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
BAD_JSON, BAD_CALL, UNCLOSED, INVALID = (
    ToolErrorKind.BAD_JSON,
    ToolErrorKind.BAD_CALL,
    ToolErrorKind.UNCLOSED,
    ToolErrorKind.INVALID_ARGUMENTS,
)


@pytest.mark.parametrize(
    "parser, text, kind, why",
    [
        ("qwen3_xml", "ok <tool_call>\n<function=book>\n<parameter=n>\n3", UNCLOSED, "not closed"),
        (
            "qwen3_xml",
            '<tool_call>{"name": "book", "arguments": {}}</tool_call>',
            BAD_CALL,
            "<function=NAME>",
        ),
        (
            "qwen3_xml",
            "<tool_call>\n<function=book\n<parameter=n>\n3\n</parameter>\n</function>\n</tool_call>",
            BAD_CALL,
            "<function=NAME>",
        ),
        (
            "qwen3_xml",
            XML.format("<parameter=n>\nthree\n</parameter>\n"),
            INVALID,
            "'n' of book: expected integer",
        ),
        (
            "qwen3_xml",
            XML.format('<parameter=opt>\n{"a": \n</parameter>\n'),
            INVALID,
            "expected object",
        ),
        (
            "qwen3_xml",
            XML.format("<parameter=n>\n1\n</parameter>\n<parameter=n>\n2\n</parameter>\n"),
            BAD_CALL,
            "given twice",
        ),
        ("qwen3_xml", XML.format("and then\n"), BAD_CALL, "'and then'"),
        (
            "qwen3_xml",
            "<tool_call>\n<function=book now>\n</function>\n</tool_call>",
            BAD_CALL,
            "not a tool name",
        ),
        ("glm4", "<tool_call>book\n<arg_key>n</arg_key>\n<arg_value>3", UNCLOSED, "not closed"),
        (
            "glm4",
            "<tool_call>book\n<arg_key>n</arg_key>\n</tool_call>",
            BAD_CALL,
            "not a closed <arg_key>",
        ),
        (
            "glm4",
            "<tool_call>book\n<arg_key>ok</arg_key><arg_value>maybe</arg_value></tool_call>",
            INVALID,
            "expected boolean",
        ),
        (
            "glm4",
            "<tool_call>\n<arg_key>n</arg_key><arg_value>1</arg_value></tool_call>",
            BAD_CALL,
            "not a tool name",
        ),
        ("glm4", '<tool_call>{"name": "book"}</tool_call>', BAD_CALL, "not a tool name"),
        (
            "deepseek_v3",
            DS.format('function<｜tool▁sep｜>book\n```json\n{"n": 3,}\n```'),
            BAD_JSON,
            "not valid JSON",
        ),
        (
            "deepseek_v3",
            DS.format("function<｜tool▁sep｜>book\n```json\n[1]\n```"),
            BAD_CALL,
            "JSON object",
        ),
        ("deepseek_v3", DS.format('book<｜tool▁sep｜>{"n": 3}'), BAD_CALL, "```json block"),
        (
            "deepseek_v3",
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>book\n```json\n{",
            UNCLOSED,
            "not closed",
        ),
        (
            "harmony",
            HARMONY + '{"n": 3,}<|call|>',
            BAD_JSON,
            "not valid JSON",
        ),
        (
            "harmony",
            HARMONY + '{"n": 3, "note": "a',
            UNCLOSED,
            "cut off",
        ),
        ("harmony", " to=functions.book<|channel|>commentary json", UNCLOSED, "no <|message|>"),
        (
            "harmony",
            '<|channel|>analysis to=browser.search<|message|>{"q": "x"}<|call|>',
            BAD_CALL,
            "not a function",
        ),
        (
            "harmony",
            " to=functions.book<|channel|>commentary json<|message|>[3]<|call|>",
            BAD_CALL,
            "JSON object",
        ),
        (
            "pythonic",
            "<|tool_call_start|>[book(n=3,]<|tool_call_end|>",
            BAD_JSON,
            "not valid Python",
        ),
        ("pythonic", "<|tool_call_start|>[book(n=3)", UNCLOSED, "not closed"),
        (
            "pythonic",
            "<|tool_call_start|>[book(n=__import__('os').getpid())]<|tool_call_end|>",
            BAD_CALL,
            "literals",
        ),
        ("pythonic", "<|tool_call_start|>[book(3)]<|tool_call_end|>", BAD_CALL, "key=value"),
        (
            "pythonic",
            "<|tool_call_start|>[book()(n=1)]<|tool_call_end|>",
            BAD_CALL,
            "name(key=value",
        ),
        (
            "pythonic",
            "<|tool_call_start|>[book(**{'n': 1})]<|tool_call_end|>",
            BAD_CALL,
            "key=value",
        ),
        ("pythonic", "<|tool_call_start|>[book(x=1e999)]<|tool_call_end|>", BAD_CALL, "non-finite"),
        ("pythonic", "[book(n=3, note='a)]", BAD_JSON, "not valid Python"),
        # LFM's template prints a string holding ' as it is: that call cannot be read back
        (
            "pythonic",
            "<|tool_call_start|>[cancel(id='it's')]<|tool_call_end|>",
            BAD_JSON,
            "not valid Python",
        ),
    ],
)
def test_malformed_calls_map_to_error_kinds(parser, text, kind, why):
    turn = PARSERS[parser](text, TOOLS)
    assert turn.message.tool_calls is None
    assert [e.kind for e in turn.errors] == [kind] and why in turn.errors[0].reason, turn.errors


def test_harmony_reads_the_model_s_own_header_order_and_channels():
    """GPT-OSS writes the recipient after the channel and a <|constrain|> content type; the final
    channel is the answer; the analysis before a call is the message's content (the template
    renders an assistant tool-call message's content there)."""
    turn = PARSERS["harmony"](
        "<|channel|>analysis<|message|>Need a slot.<|end|><|start|>assistant"
        "<|channel|>commentary to=functions.cancel <|constrain|>json<|message|>"
        '{"id": "7"}',
        TOOLS,
    )
    assert turn.errors == [] and turn.message.content == "Need a slot."
    assert [(c.name, c.arguments) for c in turn.message.tool_calls] == [("cancel", {"id": "7"})]
    turn = PARSERS["harmony"](
        "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant"
        "<|channel|>final<|message|>It is 4.",
        TOOLS,
    )
    assert (
        turn.errors == [] and turn.message.tool_calls is None and turn.message.content == "It is 4."
    )
    assert PARSERS["harmony"]("plain words", TOOLS).message.content == "plain words"


def test_pythonic_without_markers_is_the_whole_turn_or_an_answer():
    turn = PARSERS["pythonic"]("[book(n=1, ok=true, opt={'a': None}), cancel(id='x')]", TOOLS)
    assert turn.errors == [] and turn.message.content == ""
    assert _typed([(c.name, c.arguments) for c in turn.message.tool_calls]) == _typed(
        [("book", {"n": 1, "ok": True, "opt": {"a": None}}), ("cancel", {"id": "x"})]
    )
    for answer in ("[1, 2] are the roots", "[not a call]", "Is [book(n=1) a call?"):
        turn = PARSERS["pythonic"](answer, TOOLS)
        assert (
            turn.message.content == answer and turn.errors == [] and turn.message.tool_calls is None
        )
    # a call list in the middle of the text is a call, as SGLang reads it; the text is content
    turn = PARSERS["pythonic"]("The answer needs [book(n=1)] first.", TOOLS)
    assert turn.message.content == "The answer needs  first."
    assert [(c.name, c.arguments) for c in turn.message.tool_calls] == [("book", {"n": 1})]


def test_hostile_python_is_a_typed_event_never_a_raise():
    deep = "[book(n=" + "[" * 3000 + "]" * 3000 + ")]"
    for text in (
        deep,
        "[book(n=" + "1" * 5000 + ")]",
        "[book(n=1) if x else 2]",
    ):
        turn = PARSERS["pythonic"](text, TOOLS)
        assert turn.message.tool_calls is None and len(turn.errors) == 1
        assert turn.errors[0].kind in (BAD_JSON, BAD_CALL)
    # a NUL inside a string is text (vLLM reads it back), escaped before the source is parsed
    turn = PARSERS["pythonic"]("[book(note='a\x00b')]", TOOLS)
    assert turn.errors == [] and turn.message.tool_calls[0].arguments == {"note": "a\x00b"}


def test_every_parser_takes_any_text_without_raising():
    junk = [
        "",
        "<tool_call>",
        "</tool_call><tool_call>",
        "<|start|><|message|><|call|>",
        "[(",
        "<｜tool▁call▁begin｜><｜tool▁sep｜>",
        "<|tool_call_start|><|tool_call_end|>",
        "<tool_call><function=><parameter=></parameter></function></tool_call>",
        "{" * 500,
    ]
    for parse in PARSERS.values():
        for text in junk:
            parse(text, TOOLS)
            parse(text, None)


def test_the_template_audit_reads_typed_calls_with_the_env_s_schemas(tok):
    """The audit's tool conversations call the env's first tool with example arguments of its
    schema's types (an int, a bool, an object...): the XML parser reads them back only with the
    schemas, so the audit passes them (else: a false parser_mismatch and no parser named)."""
    from agentgrpo.checks.template_audit import audit

    tools = [
        {
            **TOOLS[0],
            "function": {
                **TOOLS[0]["function"],
                "parameters": {**SCHEMA, "required": ["n", "x", "ok", "opt", "note", "tags"]},
            },
        }
    ]
    chat = ChatFormat(
        tok, template=shipped_template("qwen3_6.jinja"), template_kwargs={"preserve_thinking": True}
    )
    report = audit(chat, tools=tools)
    assert report.parser == "qwen3_xml" and report.turns > 0
    assert not [i for i in report.issues if i.kind == "parser_mismatch"], report.format()
