"""The Responses API, driven by the official `openai` client against serve-policy's endpoint:
function tools, reasoning items of a thinking reply, `previous_response_id`, streaming; every
reply and event validates as the client's own types, and each episode's record is token-exact
(the items the client sends back continue the episode's tokens)."""

import asyncio

import pytest

openai = pytest.importorskip("openai")
from openai.types.responses import Response, ResponseStreamEvent  # noqa: E402
from pydantic import TypeAdapter  # noqa: E402

from tests.agent_apis import (  # noqa: E402
    RESPONSES_TOOL,
    THINK_CALL,
    TOKEN,
    arguments,
    assert_token_exact,
    by_turn,
    policy_server,
    same_record,
    start,
    trajectory,
)

EVENTS = TypeAdapter(ResponseStreamEvent)
INSTRUCTIONS = "Use the calculator, then answer with the number."


async def create(client, stream, **kw):
    """responses.create, plain or streamed (through the client's stream helper, every event
    validated); the final response, validated."""
    if not stream:
        raw = await client.responses.with_raw_response.create(**kw)
        Response.model_validate(raw.http_response.json())
        return raw.parse()
    kinds = []
    async with client.responses.stream(**kw) as events:
        async for event in events:
            EVENTS.validate_python(event.to_dict())
            kinds.append(event.type)
        final = await events.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    Response.model_validate(final.to_dict())
    return final


async def play(http, *, stream, chained):
    """Two calls: the model thinks and calls the calculator, then answers. `chained` continues
    with previous_response_id, else the whole input is sent again with the output items."""
    ep = await start(http)
    async with openai.AsyncOpenAI(base_url=ep["base_url"], api_key=TOKEN, max_retries=0) as client:
        common = {"model": "policy", "instructions": INSTRUCTIONS, "tools": [RESPONSES_TOOL]}
        first_input = [{"role": "user", "content": "What is 2 + 2?"}]
        first = await create(client, stream, input=first_input, **common)
        [call] = [item for item in first.output if item.type == "function_call"]
        result = {"type": "function_call_output", "call_id": call.call_id, "output": "4"}
        if chained:
            second = await create(
                client, stream, input=[result], previous_response_id=first.id, **common
            )
        else:
            items = [item.model_dump(exclude_none=True) for item in first.output]
            second = await create(client, stream, input=first_input + items + [result], **common)
    return first, second, await trajectory(http, ep["id"])


@pytest.mark.parametrize("chained", [False, True], ids=["full-input", "previous_response_id"])
def test_function_calls_and_reasoning_token_exact(chat, chained):
    async def body():
        out = {}
        for stream in (False, True):
            script = by_turn(chat, THINK_CALL, "The answer is 4.")
            async with policy_server(chat, script) as (http, engine):
                out[stream] = (*await play(http, stream=stream, chained=chained), engine)
        return out

    out = asyncio.run(body())
    for first, second, traj, engine in out.values():
        reasoning, call = first.output
        assert reasoning.type == "reasoning"
        assert reasoning.content[0].text == "I should use the tool."
        assert call.type == "function_call" and call.name == "calculator"
        assert arguments(call.arguments) == {"expression": "2+2"}
        assert second.output_text == "The answer is 4." and second.status == "completed"
        assert second.usage.output_tokens == len(engine.sampled[1][0])
        assert traj["num_turns"] == 2 and traj["stop_reason"] == "completed"
        assert_token_exact(traj, engine)  # the reasoning went back exactly as it was sampled
    assert same_record(out[False][2], out[True][2])


def test_errors_in_openai_shape(chat):
    async def body():
        async with policy_server(chat, ["4"]) as (http, _):
            ep = await start(http)
            client = openai.AsyncOpenAI(base_url=ep["base_url"], api_key=TOKEN, max_retries=0)
            results = []
            for kw in (
                {"model": "gpt-5", "input": "hi"},
                {"model": "policy", "input": "hi", "previous_response_id": "resp_nope"},
                {"model": "policy", "input": "hi", "tools": [{"type": "web_search"}]},
                {"model": "policy", "input": [{"type": "input_image", "image_url": "x"}]},
                {"model": "policy", "input": "hi", "background": True},
            ):
                try:
                    await client.responses.create(**kw)
                    results.append(None)
                except openai.APIStatusError as e:
                    results.append((e.status_code, e.body))
            ok = await client.responses.create(model="policy", input="hi", max_output_tokens=1)
            await client.close()
            return results, ok

    results, ok = asyncio.run(body())
    (missing_model, no_previous, web_search, image, background) = results
    assert missing_model[0] == 404 and missing_model[1]["code"] == "model_not_found"
    assert no_previous[0] == 400 and no_previous[1]["param"] == "previous_response_id"
    assert web_search[0] == 400 and web_search[1]["param"] == "tools[0]"
    assert image[0] == 400 and background[0] == 400
    assert ok.status == "incomplete" and ok.incomplete_details.reason == "max_output_tokens"
