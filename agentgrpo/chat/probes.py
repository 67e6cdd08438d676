"""Probe renders that find what a chat template does (its end-of-turn tokens, whether it wants
tool-call arguments as a JSON string, whether a turn ends at the next role token), never by
the template's name."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from agentgrpo.chat.errors import TemplateError
from agentgrpo.chat.template import Render
from agentgrpo.types import Message, ToolCall

# The tool the end-of-turn probe calls (`detected_end_of_turns`).
_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "probe",
        "description": "A probe.",
        "parameters": {"type": "object", "properties": {"value": {"type": "string"}}},
    },
}


def detected_end_of_turns(
    render: Render,
    template_dict: Callable[[Message], dict[str, Any]],
    special_text: re.Pattern[str] | None,
) -> list[str]:
    """The special tokens this template ends an assistant turn with, after a tool call first,
    then after an answer (GPT-OSS: `<|call|>`, `<|return|>`): the last special token rendered
    after the turn's text, or where the template renders none (GLM-4.5) the one that opens the
    next message (a tool result after a call, a user message after an answer: `<|observation|>`,
    `<|user|>`). `template_dict` is the message as the template reads it. Empty where the probes
    find none."""
    if special_text is None:
        return []
    user = {"role": "user", "content": "Hi"}
    call = ToolCall(id="call_0", name="probe", arguments={"value": "agentgrpo_probe_value"})
    probes = [
        (Message(role="assistant", content="", tool_calls=[call]), "agentgrpo_probe_value"),
        (Message(role="assistant", content="agentgrpo probe answer"), "agentgrpo probe answer"),
    ]
    nexts = [
        {"role": "tool", "tool_call_id": "call_0", "content": "Hi"},
        {"role": "user", "content": "Hi"},
    ]
    found: list[str] = []
    for (message, mark), follow in zip(probes, nexts, strict=True):
        chat = [user, template_dict(message)]
        try:
            text = render(chat, [_PROBE_TOOL], False)
            at = text.rfind(mark)
            ends = [m.group() for m in special_text.finditer(text, max(at, 0))]
            if at >= 0 and not ends:
                rest = render([*chat, follow], [_PROBE_TOOL], False)[len(text) :]
                opens = special_text.match(rest.lstrip())
                ends = [opens.group()] if opens else []
        except TemplateError:  # a template without tool calls refuses the probe call
            continue
        found += [] if at < 0 or not ends or ends[-1] in found else [ends[-1]]
    return found


def wants_string_arguments(template: str, render: Render) -> bool:
    """Whether the template takes a tool call's `arguments` as a JSON string rather than an
    object (DeepSeek-V3's concatenates them as text): a probe call it cannot render with an
    object and renders, as the JSON text, with a string. Then the history's calls are rendered
    from that JSON text (`ChatFormat._template_dict`)."""
    if "tool_calls" not in template:
        return False
    args = {"agentgrpo_probe": 1}

    def probe(arguments: Any) -> str:
        call = {"id": "call_0", "type": "function"}
        call["function"] = {"name": "probe", "arguments": arguments}
        user = {"role": "user", "content": "Hi"}
        return render(
            [user, {"role": "assistant", "content": "", "tool_calls": [call]}], None, False
        )

    try:
        probe(args)
        return False
    except TemplateError:
        pass
    try:
        return json.dumps(args) in probe(json.dumps(args))
    except TemplateError:
        return False


def turn_end_opens_next(render: Render, end_of_turns: tuple[str, ...]) -> bool:
    """Whether the template renders an assistant turn with none of `end_of_turns` and starts the
    next message with one (GLM-4.5: the model stops on the next role token). Found by a probe
    render of a short chat with and without a user message after the answer."""
    answer = "agentgrpo probe answer"
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": answer}]
    try:
        alone = render(chat, None, False)
        followed = render([*chat, {"role": "user", "content": "Hi"}], None, False)
    except TemplateError:
        return False
    at = alone.rfind(answer)
    if at < 0 or any(e in alone[at:] for e in end_of_turns):
        return False
    return followed.startswith(alone) and followed[len(alone) :].startswith(end_of_turns)
