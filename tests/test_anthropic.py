"""Anthropic's Messages API, driven by the official `anthropic` client against serve-policy's
endpoint: tools, tool_use / tool_result, thinking blocks of a thinking reply, stop sequences,
streaming; every reply and event validates as the client's own types, errors have Anthropic's
shape, and each episode's record is token-exact (the blocks the client sends back continue the
episode's tokens)."""

import asyncio

import pytest

anthropic = pytest.importorskip("anthropic", exc_type=ImportError)
from anthropic.types import Message, RawMessageStreamEvent  # noqa: E402
from pydantic import TypeAdapter  # noqa: E402

from tests.agent_apis import (  # noqa: E402
    ANTHROPIC_TOOL,
    THINK_CALL,
    TOKEN,
    assert_token_exact,
    by_turn,
    policy_server,
    same_record,
    start,
    trajectory,
)

EVENTS = TypeAdapter(RawMessageStreamEvent)
SYSTEM = "Use the calculator, then answer with the number."


async def create(client, stream, **kw):
    """messages.create, plain or streamed (through the client's stream helper, every event
    validated); the final message, validated."""
    if not stream:
        raw = await client.messages.with_raw_response.create(**kw)
        Message.model_validate(raw.http_response.json())
        return await raw.parse()
    kinds = []
    async with client.messages.stream(**kw) as events:
        async for event in events:
            if event.type in ("text", "thinking", "input_json", "signature", "citation"):
                continue  # the helper's own convenience events, not the wire's
            EVENTS.validate_python(event.to_dict())
            kinds.append(event.type)
        final = await events.get_final_message()
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    Message.model_validate(final.to_dict())
    return final


async def play(http, *, stream):
    """Two calls: the model thinks and calls the calculator, then answers."""
    ep = await start(http)
    base = ep["anthropic_base_url"]
    async with anthropic.AsyncAnthropic(base_url=base, api_key=TOKEN, max_retries=0) as client:
        common = {"model": "policy", "max_tokens": 64, "system": SYSTEM, "tools": [ANTHROPIC_TOOL]}
        messages = [{"role": "user", "content": "What is 2 + 2?"}]
        first = await create(client, stream, messages=messages, **common)
        [use] = [b for b in first.content if b.type == "tool_use"]
        messages += [
            {"role": "assistant", "content": [b.model_dump() for b in first.content]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "4"}],
            },
        ]
        second = await create(client, stream, messages=messages, **common)
    return first, second, await trajectory(http, ep["id"])


def test_tool_use_and_thinking_token_exact(chat):
    async def body():
        out = {}
        for stream in (False, True):
            script = by_turn(chat, THINK_CALL, "The answer is 4.")
            async with policy_server(chat, script) as (http, engine):
                out[stream] = (*await play(http, stream=stream), engine)
        return out

    out = asyncio.run(body())
    for first, second, traj, engine in out.values():
        thinking, use = first.content
        assert thinking.type == "thinking" and thinking.thinking == "I should use the tool."
        assert use.type == "tool_use" and use.name == "calculator"
        assert use.input == {"expression": "2+2"} and first.stop_reason == "tool_use"
        assert [b.text for b in second.content] == ["The answer is 4."]
        assert second.stop_reason == "end_turn"
        assert second.usage.output_tokens == len(engine.sampled[1][0])
        assert traj["num_turns"] == 2 and traj["stop_reason"] == "completed"
        assert_token_exact(traj, engine)  # the thinking went back exactly as it was sampled
    assert same_record(out[False][2], out[True][2])


def test_stop_sequences_tool_choice_and_errors(chat):
    """A one-token stop sequence ends the turn as `stop_sequence`; tool_choice any is accepted
    (not enforced); bad requests get Anthropic's error shape and the client's error classes."""

    async def body():
        async with policy_server(chat, ["4 END"]) as (http, _):
            ep = await start(http)
            base = ep["anthropic_base_url"]
            client = anthropic.AsyncAnthropic(base_url=base, api_key=TOKEN, max_retries=0)
            user = [{"role": "user", "content": "2 + 2?"}]
            stopped = await client.messages.create(
                model="policy",
                max_tokens=16,
                messages=user,
                stop_sequences=[" END"],
                tools=[ANTHROPIC_TOOL],
                tool_choice={"type": "any"},
            )
            errors = []
            for kw in (
                {"model": "claude-opus", "max_tokens": 8, "messages": user},
                {"model": "policy", "max_tokens": 8, "messages": user, "extra_body": {"top_k": 5}},
                {
                    "model": "policy",
                    "max_tokens": 8,
                    "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}],
                },
            ):
                try:
                    await client.messages.create(**kw)
                    errors.append(None)
                except anthropic.APIStatusError as e:
                    errors.append(e)
            wrong_key = anthropic.AsyncAnthropic(base_url=base, api_key="nope", max_retries=0)
            try:
                await wrong_key.messages.create(model="policy", max_tokens=8, messages=user)
            except anthropic.AuthenticationError as e:
                errors.append(e)
            await client.close()
            await wrong_key.close()
            return stopped, errors

    stopped, (model, top_k, image, key) = asyncio.run(body())
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == " END"
    assert isinstance(model, anthropic.NotFoundError)
    assert model.body == {
        "type": "error",
        "error": {"type": "not_found_error", "message": model.body["error"]["message"]},
    }
    assert isinstance(top_k, anthropic.BadRequestError) and "top_k" in top_k.message
    assert isinstance(image, anthropic.BadRequestError) and "image" in image.message
    assert key.body["error"]["type"] == "authentication_error"
