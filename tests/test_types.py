"""Message / ToolCall / Task take the dicts OpenAI's API and chat datasets write, wherever they are
validated, and reject what they cannot represent with an error that names it."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from agentgrpo.types import Message, Task, ToolCall

OPENAI_ASSISTANT = {  # as OpenAI's chat completions API returns it
    "role": "assistant",
    "content": None,
    "refusal": None,
    "annotations": [],
    "tool_calls": [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'},
        }
    ],
}


def test_an_openai_tool_calling_turn_validates_everywhere():
    want = Message(
        role="assistant",
        content="",
        tool_calls=[ToolCall(id="call_1", name="add", arguments={"a": 1, "b": 2})],
    )
    assert Message.model_validate(OPENAI_ASSISTANT) == want
    assert Message(**OPENAI_ASSISTANT) == want
    assert Message.from_dict(OPENAI_ASSISTANT) == want
    task = Task(
        id="t",
        prompt=[
            {"role": "user", "content": "1+2?"},
            OPENAI_ASSISTANT,
            {"role": "tool", "tool_call_id": "call_1", "content": "3"},
        ],
    )
    assert task.prompt_messages()[1] == want
    # and back: the OpenAI form again (arguments as a JSON string), without the empty extras
    assert want.to_dict()["tool_calls"][0]["function"] == {
        "name": "add",
        "arguments": '{"a": 1, "b": 2}',
    }


def test_text_parts_are_joined_and_other_parts_refused():
    parts = {
        "role": "user",
        "content": [{"type": "text", "text": "Hello, "}, {"type": "text", "text": "world"}],
    }
    assert Message.model_validate(parts).content == "Hello, world"
    image = {
        "role": "user",
        "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": "x"}},
        ],
    }
    with pytest.raises(ValidationError, match="image_url"):
        Message.model_validate(image)


def test_unknown_keys_with_a_value_and_bad_calls_are_errors():
    with pytest.raises(ValidationError, match="reasoning_content"):
        Message.model_validate(
            {"role": "assistant", "content": "x", "reasoning_content": "thought"}
        )
    bad_json = {"id": "c", "type": "function", "function": {"name": "add", "arguments": "{a: 1"}}
    with pytest.raises(ValidationError, match="arguments are not JSON"):
        ToolCall.model_validate(bad_json)
    with pytest.raises(ValidationError, match="only 'function'"):
        ToolCall.model_validate({"type": "custom", "function": {"name": "x"}})
    assert ToolCall.model_validate({"name": "add", "arguments": {"a": 1}}) == ToolCall(
        name="add", arguments={"a": 1}
    )


def test_a_trajectory_row_is_strict_json_with_unscorable_parts():
    import json
    import math

    from agentgrpo.types import StopReason, Trajectory

    t = Trajectory(
        task_id="t",
        token_ids=[1, 2],
        loss_mask=[0, 1],
        logprobs=[0.0, -1.0],
        prompt_len=1,
        messages=[],
        stop_reason=StopReason.COMPLETED,
        reward=math.nan,
        reward_parts={"correct": math.nan, "format": 1.0},
    )
    row = json.loads(json.dumps(t.to_dict(), allow_nan=False))  # what strict JSON readers need
    assert (row["reward"], row["reward_parts"]) == (None, {"correct": None, "format": 1.0})
