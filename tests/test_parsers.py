"""Tool-call parsers on hostile model text: every malformed call is a typed event, never a raise."""

import pytest

from agentgrpo.chat.parsers import parse_deepseek_v3, parse_harmony, parse_hermes, parse_llama3_json
from agentgrpo.types import ToolErrorKind

HUGE_INT = (
    "1" * 5000
)  # past Python's 4300-digit int limit: json raises ValueError, not JSONDecodeError
DEEP = "[" * 3000 + "]" * 3000  # json raises RecursionError


def _hermes(args: str) -> str:
    return '<tool_call>{"name": "f", "arguments": ' + args + "}</tool_call>"


def _llama(args: str) -> str:
    return '{"name": "f", "parameters": ' + args + "}"


def _deepseek(args: str) -> str:
    return (
        "<｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n"
        + args
        + "\n```<｜tool▁call▁end｜>"
    )


def _harmony(args: str) -> str:
    return "<|channel|>commentary to=functions.f <|constrain|>json<|message|>" + args + "<|call|>"


@pytest.mark.parametrize(
    "parse, wrap",
    [
        (parse_hermes, _hermes),
        (parse_llama3_json, _llama),
        (parse_deepseek_v3, _deepseek),
        (parse_harmony, _harmony),
    ],
)
@pytest.mark.parametrize(
    "args, why",
    [
        ('{"n": ' + HUGE_INT + "}", "4300"),
        ('{"n": ' + DEEP + "}", "nested too deeply"),
        ('{"x": NaN}', "NaN is not JSON"),
        (
            '{"q": "a\\ud83d"}',
            "surrogate",
        ),  # an unpaired escape: not text, and no tokenizer takes it
    ],
)
def test_json_the_decoder_cannot_take_is_a_bad_json_event(parse, wrap, args, why):
    turn = parse(wrap(args))
    assert turn.message.tool_calls is None
    assert [e.kind for e in turn.errors] == [ToolErrorKind.BAD_JSON] and why in turn.errors[
        0
    ].reason


def test_a_closing_tag_inside_a_string_does_not_end_the_call():
    turn = parse_hermes(
        'Writing.<tool_call>{"name": "write", "arguments": {"text": "end with '
        '</tool_call> here"}}</tool_call> done'
    )
    assert turn.errors == [] and turn.message.content == "Writing. done"
    assert [c.arguments for c in turn.message.tool_calls] == [
        {"text": "end with </tool_call> here"}
    ]
    # where the JSON is broken, the call still ends at the first closing tag
    turn = parse_hermes('<tool_call>{"name": "f", "arguments": {</tool_call>after')
    assert [e.kind for e in turn.errors] == [ToolErrorKind.BAD_JSON]
    assert turn.message.content == "after"
    turn = parse_hermes('a<tool_call>{"name": "f", "arguments": {')  # cut by the token limit
    assert [e.kind for e in turn.errors] == [ToolErrorKind.UNCLOSED] and turn.message.content == "a"
    # a complete call whose </tool_call> is missing still runs (vLLM runs it)
    turn = parse_hermes('a<tool_call>{"name": "f", "arguments": {}}<tool_call>{"name": "g"}')
    assert [c.name for c in turn.message.tool_calls] == ["f", "g"] and turn.errors == []


@pytest.mark.parametrize(
    "obj, why",
    [
        ('{"name": "search", "args": {"q": "x"}}', "unknown key(s) ['args']"),
        ('{"name": "search", "params": {"q": "x"}}', "unknown key(s) ['params']"),
        (
            '{"name": "s", "arguments": {}, "parameters": {"q": 1}}',
            'both "arguments" and "parameters"',
        ),
    ],
)
def test_arguments_under_another_key_are_not_dropped(obj, why):
    # The call used to run as search({}) with no event: the model never learned what it did wrong.
    for turn in (parse_hermes(f"<tool_call>{obj}</tool_call>"), parse_llama3_json(obj)):
        assert turn.message.tool_calls is None
        assert [e.kind for e in turn.errors] == [ToolErrorKind.BAD_CALL] and why in turn.errors[
            0
        ].reason


def test_keys_models_really_send_are_accepted():
    turn = parse_llama3_json('{"type": "function", "name": "f", "parameters": {"a": 1}}')
    assert turn.errors == [] and turn.message.tool_calls[0].arguments == {"a": 1}
    turn = parse_hermes(
        '<tool_call>{"id": "c1", "name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
    )
    assert turn.errors == [] and turn.message.tool_calls[0].arguments == {"a": 1}


def test_llama_python_tag_without_json_is_a_malformed_call_not_an_answer():
    for text in (
        '<|python_tag|>brave_search.call(query="x")',
        "<|python_tag|>print(1)",
        "<|python_tag|>",
    ):
        turn = parse_llama3_json(text)
        assert turn.message.content == "" and turn.message.tool_calls is None
        assert [e.kind for e in turn.errors] == [ToolErrorKind.BAD_CALL]
        assert "built-in tool syntax is not supported" in turn.errors[0].reason
    assert parse_llama3_json("The answer is 4.").message.content == "The answer is 4."


def test_qwen3_xml_reads_long_or_hostile_values_in_linear_time():
    """SGLang's own bound (test_qwen3_coder_detector): an unclosed value of 100,000 spaces parses in
    under 2 s; so do 5,000 `<parameter=` tags opened and never closed (both were quadratic)."""
    import time

    from agentgrpo.chat.parsers import parse_qwen3_xml

    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                },
            },
        }
    ]
    value = "a" + " " * 100_000 + "b"
    spaces = (
        f"<tool_call>\n<function=get_weather>\n<parameter=city>\n{value}\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
    )
    hostile = "<tool_call><function=get_weather>" + "<parameter=city>" * 5000
    for text in (spaces, hostile):
        start = time.perf_counter()
        turn = parse_qwen3_xml(text, tools)
        assert time.perf_counter() - start < 2.0
    assert [e.kind for e in turn.errors] == [ToolErrorKind.UNCLOSED]
    assert parse_qwen3_xml(spaces, tools).message.tool_calls[0].arguments == {
        "city": value,
        "days": 3,
    }
