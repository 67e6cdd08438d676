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

    from agentgrpo.types import Score, StopReason, Trajectory

    t = Trajectory(
        task_id="t",
        token_ids=[1, 2],
        loss_mask=[0, 1],
        logprobs=[0.0, -1.0],
        prompt_len=1,
        messages=[],
        stop_reason=StopReason.COMPLETED,
        id="g/0",
    )
    score = Score("g/0", math.nan, {"correct": math.nan, "format": 1.0})
    row = json.loads(json.dumps(t.to_dict(score), allow_nan=False))  # what strict JSON readers need
    assert (row["reward"], row["reward_parts"]) == (None, {"correct": None, "format": 1.0})


def _record(**fields):
    from agentgrpo.types import StopReason, Trajectory

    return Trajectory(
        task_id="t",
        token_ids=[5, 6, 7],
        loss_mask=[0, 1, 1],
        logprobs=[0.0, -0.5, -0.25],
        prompt_len=1,
        messages=[Message(role="user", content="hi")],
        stop_reason=StopReason.COMPLETED,
        reward=1.0,
        tool_error_kinds={"bad_json": 1},
        **fields,
    )


def test_a_finished_trajectory_cannot_be_changed():
    """The episode's record is frozen: fields, token sequences, mappings and messages all refuse
    a change; `dataclasses.replace` makes a new record and leaves this one as it was."""
    import dataclasses
    import pickle

    t = _record(id="g/0", group_id="g")
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.reward = 0.0  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.token_ids = (1,)  # type: ignore[misc]
    with pytest.raises(AttributeError):
        t.token_ids.append(8)  # type: ignore[attr-defined]  # a tuple
    with pytest.raises(TypeError):
        t.loss_mask[0] = 1  # type: ignore[index]
    with pytest.raises(TypeError, match="read-only"):
        t.tool_error_kinds["bad_json"] = 2  # type: ignore[index]
    with pytest.raises(ValidationError, match="frozen"):
        t.messages[0].content = "forged"  # type: ignore[misc]
    seg = t.segments[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        seg.prompt_len = 0  # type: ignore[misc]
    other = dataclasses.replace(t, reward=0.0)
    assert (t.reward, other.reward, other.token_ids) == (1.0, 0.0, (5, 6, 7))
    back = pickle.loads(pickle.dumps(t))  # ranks receive the step's records pickled
    assert back == t and back.tool_error_kinds == {"bad_json": 1}
    with pytest.raises(TypeError, match="read-only"):
        back.tool_error_kinds.clear()


def test_scores_and_advantages_join_their_trajectory_by_id():
    import math

    from agentgrpo.types import Advantage, Group, Score, Task

    a, b = _record(id="g/0", group_id="g"), _record(id="g/1", group_id="g")
    group = Group(
        "g", Task(id="t", prompt="hi"), [a, b], {"g/1": Score("g/1", 0.5), "g/0": Score("g/0", 2.0)}
    )
    assert group.rewards == [2.0, 0.5] and group.score(b).reward == 0.5  # by id, not by position
    row = a.to_dict(group.score(a), Advantage("g/0", 0.7, (0.1, 0.2)))
    assert (row["reward"], row["advantage"], row["turn_advantages"]) == (2.0, 0.7, [0.1, 0.2])
    assert a.to_dict()["reward"] == 1.0 and a.to_dict()["advantage"] is None  # its own reward
    with pytest.raises(ValueError, match="joined to trajectory 'g/0'"):
        a.to_dict(Score("g/1", 0.0))
    with pytest.raises(ValueError, match="scores for"):
        Group("g", Task(id="t", prompt="hi"), [a, b], {"g/0": Score("g/0", 1.0)})
    with pytest.raises(ValueError, match="ids repeat"):
        Group("g", Task(id="t", prompt="hi"), [a, a])
    assert Group("g", Task(id="t", prompt="hi"), [a]).rewards == [1.0]  # default: its own reward
    with pytest.raises(ValueError, match="finite"):
        Advantage("g/0", math.nan)  # a trajectory not trained on has no Advantage at all


def test_a_training_row_is_checked_when_made():
    import math

    from agentgrpo.types import TrainingRow

    row = TrainingRow("g/0", "g", [1, 2, 3], [0, 1, 1], [0.0, -1.0, -2.0], 0.5)
    assert row.num_sampled == 2 and row.token_ids == (1, 2, 3)
    bad = [
        (([1, 2], [0, 1, 1], [0.0, -1.0, -2.0], 0.5), "lengths differ"),
        (([1, 2, 3], [0, 0, 0], [0.0] * 3, 0.5), "at least one loss token"),
        (([1, 2, 3], [1, 1, 0], [-1.0, -1.0, 0.0], 0.5), "nothing predicts it"),
        (([1, 2, 3], [0, 1, 1], [0.0, -1.0, -2.0], math.nan), "finite"),
    ]
    for args, match in bad:
        with pytest.raises(ValueError, match=match):
            TrainingRow("g/0", "g", *args)
