"""The synthetic conversations the template audit walks: plain chat shapes always, and tool-call
shapes (single, parallel, several turns, reasoning, awkward output) when the env has tools."""

from __future__ import annotations

from agentgrpo.checks.env_check import example_arguments
from agentgrpo.types import Message, ToolCall

SYNTHETIC_TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}


def _a(content: str, *calls: ToolCall) -> Message:
    return Message(role="assistant", content=content, tool_calls=list(calls) or None)


def _t(content: str, call: ToolCall | None = None) -> Message:
    return Message(
        role="tool",
        content=content,
        tool_call_id=call.id if call else None,
        name=call.name if call else None,
    )


def _u(content: str) -> Message:
    return Message(role="user", content=content)


Shape = tuple[str, list[Message], list[Message]]  # name, head, the turns after it


def conversations(
    tools: list[dict] | None, prompt: list[Message] | None
) -> list[tuple[str, list[Message], int]]:
    """The synthetic conversations the audit walks, as (name, messages, length of the head that
    the first prompt renders): plain shapes always, tool shapes when the env has tools. `prompt`
    (the env's first messages, which may hold worked examples) replaces the synthetic heads."""
    head = (
        list(prompt)
        if prompt
        else [
            Message(role="system", content="You are a careful assistant."),
            _u("What is 12 * 7 + 3?"),
        ]
    )
    short = list(prompt) if prompt else [_u("Hi!")]
    shapes = _plain(head, short) + (_with_tools(head, tools) if tools != [] else [])
    return [(name, h + rest, len(h)) for name, h, rest in shapes]


def _plain(head: list[Message], short: list[Message]) -> list[Shape]:
    """Tool-free shapes: chat with and without a system message, feedback, reasoning."""
    return [
        ("chat", head, [_a("12 * 7 = 84, plus 3 is 87."), _u("Are you sure?"), _a("Yes: 87.")]),
        ("chat without system", short, [_a("Hello! How can I help?"), _u("Say 4."), _a("4")]),
        (
            "feedback loop",
            head,
            [_a("86"), _u("No, try again."), _a("88"), _u("No, try again."), _a("87")],
        ),
        (
            "reasoning",
            head,
            [
                _a("<think>\n12 * 7 = 84.\n</think>\n\n87"),
                _u("Are you sure?"),
                _a("<think>\nCheck: 84 + 3 = 87.\n</think>\n\nYes, 87."),
            ],
        ),
    ]


def _with_tools(head: list[Message], tools: list[dict] | None) -> list[Shape]:
    """Tool shapes, calling the env's first tool (the synthetic calculator without tools)."""
    fn = (tools or [SYNTHETIC_TOOL])[0]["function"]
    args = example_arguments(fn.get("parameters", {})) if tools else {"expression": "12*7"}

    def c(i: int) -> ToolCall:
        return ToolCall(id=f"call_{i}", name=fn["name"], arguments=args)

    return [
        ("tool call", head, [_a("", c(0)), _t("84", c(0)), _a("The answer is 87.")]),
        (
            "text and tool call",
            head,
            [_a("Let me compute 12 * 7 first.", c(0)), _t('{"result": 84}', c(0)), _a("87")],
        ),
        (
            "parallel tool calls",
            head,
            [_a("", c(0), c(1)), _t("84", c(0)), _t("3", c(1)), _a("87")],
        ),
        (
            "several tool turns",
            head,
            [_a("", c(0)), _t("84", c(0)), _a("", c(1)), _t("87", c(1)), _a("87")],
        ),
        (
            "tool then user feedback",
            head,
            [
                _a("", c(0)),
                _t("84", c(0)),
                _a("84"),
                _u("Add the 3."),
                _a("", c(1)),
                _t("87", c(1)),
                _a("87"),
            ],
        ),
        (
            "reasoning with tools",
            head,
            [
                _a("<think>\nProduct first.\n</think>\n\n", c(0)),
                _t("84", c(0)),
                _a("<think>\nNow add 3.\n</think>\n\n87"),
                _u("Sure?"),
                _a("<think>\nYes.\n</think>\n\nYes."),
            ],
        ),
        (
            "awkward tool output",
            head,
            [
                _a("", c(0)),
                _t('  line 1\n\tline 2: ünïcode ✓ {"k": [1, 2]}\n', c(0)),
                _a("done"),
            ],
        ),
        ("empty tool output", head, [_a("", c(0)), _t("", c(0)), _a("done")]),
    ]
