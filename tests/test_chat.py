"""Token-in/token-out rendering: prompt + sampled ids + suffix ids == the template's full render."""

import json

import pytest

from agentgrpo.chat import ChatFormat, TemplateError, parse_hermes
from agentgrpo.types import Message, ToolCall
from tests.conftest import shared_template

TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.",
                                           "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                                                          "required": ["expression"]}}}]


def _call(expr: str, i: int) -> ToolCall:
    return ToolCall(id=f"call_{i}", name="calculator", arguments={"expression": expr})


def _conversation():
    """A 3-turn tool conversation: (messages before each assistant turn, canonical assistant text)."""
    return [
        Message(role="system", content="Use tools."),
        Message(role="user", content="What is 12*7+3?"),
        Message(role="assistant", content="", tool_calls=[_call("12*7", 0)]),
        Message(role="tool", content="84", tool_call_id="call_0", name="calculator"),
        Message(role="assistant", content="Now add 3.", tool_calls=[_call("84+3", 1), _call("3", 2)]),
        Message(role="tool", content="87", tool_call_id="call_1", name="calculator"),
        Message(role="tool", content="3", tool_call_id="call_2", name="calculator"),
        Message(role="assistant", content="The answer is 87."),
    ]


def _assistant_ids(chat: ChatFormat, history, msg) -> list[int]:
    """What a model would sample for `msg`: the template's rendering of that turn up to and
    including the end-of-turn token."""
    before = chat.render(history, TOOLS, add_generation_prompt=True)
    full = chat.render(list(history) + [msg], TOOLS)
    turn = full[len(before):]
    return chat.encode(turn[: turn.index(chat.end_of_turn) + len(chat.end_of_turn)])


def _tito_equals_full_render(chat: ChatFormat):
    conv = _conversation()
    ids = chat.prompt_ids(conv[:2], TOOLS)
    history = list(conv[:2])
    i = 2
    while i < len(conv):
        msg = conv[i]
        ids += _assistant_ids(chat, history, msg)
        history.append(msg)
        i += 1
        new = []
        while i < len(conv) and conv[i].role != "assistant":
            new.append(conv[i])
            i += 1
        if new:
            ids += chat.suffix_ids(history, new, TOOLS)
            history += new
            assert ids == chat.encode(chat.render(history, TOOLS, add_generation_prompt=True))
    return ids


def test_hermes_chatml_is_token_exact(chat):
    assert chat.template_source == "agentgrpo-hermes-chatml"  # SmolLM2's own template has no tools
    _tito_equals_full_render(chat)


@pytest.mark.parametrize("name", ["qwen2_5.jinja", "qwen3_instruct_2507.jinja"])
def test_real_chatml_templates_are_token_exact(smol_tokenizer, name):
    chat = ChatFormat(smol_tokenizer, template=shared_template(name))
    _tito_equals_full_render(chat)


def test_qwen25_suffix_matches_the_documented_rendering(smol_tokenizer):
    chat = ChatFormat(smol_tokenizer, template=shared_template("qwen2_5.jinja"))
    hist = [Message(role="user", content="Weather?"),
            Message(role="assistant", content="", tool_calls=[ToolCall(id="c", name="get_weather", arguments={"city": "Paris"})])]
    suffix = chat.suffix_ids(hist, [Message(role="tool", content='{"temp_c": 18}', tool_call_id="c")])
    assert chat.decode(suffix) == "\n<|im_start|>user\n<tool_response>\n{\"temp_c\": 18}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


def test_qwen3_think_stripping_is_refused(smol_tokenizer):
    chat = ChatFormat(smol_tokenizer, template=shared_template("qwen3.jinja"))
    hist = [Message(role="user", content="Guess a number."),
            Message(role="assistant", content="<think>\nhmm\n</think>\n\n5")]
    with pytest.raises(TemplateError, match="not prefix-preserving"):
        chat.suffix_ids(hist, [Message(role="user", content="Higher.")])


def test_template_with_tools_is_kept(smol_tokenizer):
    import copy

    tok = copy.deepcopy(smol_tokenizer)
    tok.chat_template = shared_template("qwen2_5.jinja")
    assert ChatFormat(tok).template_source == "tokenizer"


@pytest.mark.parametrize("text, calls, errors, content", [
    ('<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>', [("f", {"x": 1})], [], ""),
    ('Let me see.<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "g", "arguments": "{\\"y\\": 2}"}</tool_call>',
     [("f", {}), ("g", {"y": 2})], [], "Let me see."),
    ('<tool_call>{"name": "f", "arguments": {"x": 1}</tool_call>', [], ["not valid JSON"], ""),
    ('<tool_call>{"arguments": {}}</tool_call>', [], ['string "name"'], ""),
    ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', [], ['"arguments" must be a JSON object'], ""),
    ('<tool_call>{"name": "f", "argu', [], ["not closed"], ""),
    ("The answer is 4.", [], [], "The answer is 4."),
])
def test_hermes_parser(text, calls, errors, content):
    turn = parse_hermes(text)
    assert [(c.name, c.arguments) for c in turn.message.tool_calls or []] == calls
    assert len(turn.errors) == len(errors)
    for err, needle in zip(turn.errors, errors):
        assert needle in err.reason
    assert turn.message.content == content


def test_parse_assistant_drops_only_the_stop_token(chat):
    ids = chat.encode('<tool_call>{"name": "f", "arguments": {}}</tool_call>') + [chat.end_of_turn_id]
    turn = chat.parse_assistant(ids)
    assert turn.message.tool_calls[0].name == "f" and not turn.errors
    assert json.loads(turn.message.tool_calls[0].to_dict()["function"]["arguments"]) == {}
