"""Streamed Chat Completions, driven by the official `openai` client against serve-policy's
endpoint: every chunk validates as the client's `ChatCompletionChunk`, tool calls arrive as
deltas the client's own accumulator joins, usage comes last with `include_usage`, and the
recorded trajectory is the one the same calls make without streaming."""

import asyncio

import pytest

openai = pytest.importorskip("openai")
from openai.types.chat import ChatCompletion, ChatCompletionChunk  # noqa: E402

from agentgrpo import AgentEnv, StopReason, Task  # noqa: E402
from agentgrpo.engine import SamplingParams  # noqa: E402
from agentgrpo.rollout.episode import run_group  # noqa: E402
from tests.agent_apis import (  # noqa: E402
    ANTHROPIC_TOOL,
    CALL,
    CHAT_TOOL,
    TOKEN,
    Recording,
    arguments,
    assert_sampled_by_engine,
    assert_token_exact,
    by_turn,
    policy_server,
    same_record,
    start,
    trajectory,
)

USER = [{"role": "user", "content": "What is 2 + 2?"}]


async def play(http, engine, *, stream: bool):
    """A calculator agent's two calls, streamed or not; (first reply's message, second reply's
    text, chunks seen, trajectory)."""
    ep = await start(http)
    client = openai.AsyncOpenAI(base_url=ep["base_url"], api_key=TOKEN, max_retries=0)
    chunks = []
    async with client:
        messages = list(USER)
        if stream:
            created = await client.chat.completions.create(
                model="policy",
                messages=messages,
                tools=[CHAT_TOOL],
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = [c async for c in created]
            first = _joined(chunks)
        else:
            reply = await client.chat.completions.create(
                model="policy", messages=messages, tools=[CHAT_TOOL]
            )
            ChatCompletion.model_validate(reply.to_dict())
            first = reply.choices[0].message
        messages += [
            first.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "4"},
        ]
        if stream:
            async with client.chat.completions.stream(
                model="policy", messages=messages, tools=[CHAT_TOOL]
            ) as s:
                text = (await s.get_final_completion()).choices[0].message.content
        else:
            reply = await client.chat.completions.create(
                model="policy", messages=messages, tools=[CHAT_TOOL]
            )
            text = reply.choices[0].message.content
    return first, text, chunks, await trajectory(http, ep["id"])


def _joined(chunks):
    """The assistant message the chunks spell, joined as a streaming client joins them."""
    from openai.types.chat import ChatCompletionMessage

    content, calls = "", {}
    for c in chunks:
        for choice in c.choices:
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"type": "function", "function": {}})
                call["id"] = d.id or call.get("id")
                fn = call["function"]
                fn["name"] = (d.function.name or fn.get("name")) if d.function else fn.get("name")
                fn["arguments"] = fn.get("arguments", "") + (
                    (d.function and d.function.arguments) or ""
                )
    return ChatCompletionMessage(
        role="assistant", content=content or None, tool_calls=list(calls.values()) or None
    )


def test_streamed_calls_record_what_plain_calls_record(chat):
    async def body():
        out = {}
        for stream in (False, True):
            async with policy_server(chat, by_turn(chat, CALL, "The answer is 4.")) as (http, e):
                out[stream] = (*await play(http, e, stream=stream), e)
        return out

    out = asyncio.run(body())
    (first, text, _, plain, _), (sfirst, stext, chunks, streamed, engine) = out[False], out[True]
    for message in (first, sfirst):
        [call] = message.tool_calls
        assert call.function.name == "calculator"
        assert arguments(call.function.arguments) == {"expression": "2+2"}
        assert call.id.startswith("call_")
    assert text == stext == "The answer is 4."
    for c in chunks:
        ChatCompletionChunk.model_validate(c.to_dict())
    *body_chunks, usage = chunks
    assert usage.choices == [] and usage.usage.completion_tokens == len(engine.sampled[0][0])
    assert all(c.usage is None for c in body_chunks)
    assert body_chunks[0].choices[0].delta.role == "assistant"
    assert body_chunks[-1].choices[0].finish_reason == "tool_calls"
    deltas = [tc for c in body_chunks for tc in c.choices[0].delta.tool_calls or []]
    assert deltas[0].id == sfirst.tool_calls[0].id and deltas[0].function.name == "calculator"
    assert "".join(d.function.arguments or "" for d in deltas) == '{"expression": "2+2"}'
    assert streamed["num_turns"] == plain["num_turns"] == 2
    assert_token_exact(streamed, engine)
    assert same_record(plain, streamed)


def test_stream_errors_come_before_the_stream(chat):
    """Bad stream options are a 400 and an engine failure a 503, in OpenAI's error shape, as plain
    responses (found before any event is sent)."""

    def script(ids, i):
        return RuntimeError("engine down") if i == 1 else "4"

    async def body():
        async with policy_server(chat, script) as (http, _):
            url = (await start(http))["base_url"][len(str(http.base_url).rstrip("/")) :]
            post = lambda **b: http.post(f"{url}/chat/completions", json={"messages": USER, **b})  # noqa: E731
            return [
                await post(stream_options={"include_usage": True}),
                await post(stream=True, stream_options={"usage": True}),
                await post(stream="yes"),
                await post(stream=True),
                await post(stream=True),
            ]

    only_with_stream, bad_option, not_bool, fine, failed = asyncio.run(body())
    assert only_with_stream.status_code == bad_option.status_code == not_bool.status_code == 400
    assert only_with_stream.json()["error"]["param"] == "stream_options"
    assert fine.status_code == 200 and fine.headers["content-type"].startswith("text/event-stream")
    assert fine.text.endswith("data: [DONE]\n\n")
    assert failed.status_code == 503 and failed.json()["error"]["code"] == "engine_error"


class MixedStreams(AgentEnv):
    """One episode, two APIs, both streamed: the tool call through Chat Completions, the answer
    through Anthropic's Messages API with the call sent back as tool_use / tool_result."""

    async def run(self, client, task):
        import anthropic

        messages = [{"role": "user", "content": task.prompt}]
        created = await client.chat.completions.create(
            model=self.model, messages=messages, tools=[CHAT_TOOL], stream=True
        )
        call = _joined([c async for c in created]).tool_calls[0]
        claude = anthropic.AsyncAnthropic(
            base_url=self.anthropic_base_url, api_key=self.api_key, max_retries=0
        )
        use = {
            "type": "tool_use",
            "id": call.id,
            "name": "calculator",
            "input": arguments(call.function.arguments),
        }
        result = {"type": "tool_result", "tool_use_id": call.id, "content": "4"}
        async with (
            claude,
            claude.messages.stream(
                model=self.model,
                max_tokens=64,
                tools=[ANTHROPIC_TOOL],
                messages=[
                    *messages,
                    {"role": "assistant", "content": [use]},
                    {"role": "user", "content": [result]},
                ],
            ) as stream,
        ):
            final = await stream.get_final_message()
        return float(final.content[0].text == "The answer is 4.")


def test_an_agent_env_streams_through_two_apis_in_one_episode(chat):
    pytest.importorskip("anthropic", exc_type=ImportError)
    engine = Recording(chat.tokenizer, by_turn(chat, CALL, "The answer is 4."), chat.end_of_turn_id)
    task = Task(id="t", prompt="What is 2 + 2?", answer=4)
    group = asyncio.run(
        run_group(
            MixedStreams, engine, chat, task, 2, SamplingParams(max_new_tokens=64, seed=1), seed=0
        )
    )
    for traj in group.trajectories:
        assert traj.stop_reason == StopReason.COMPLETED and traj.reward == 1.0, traj.stop_detail
        assert traj.num_turns == 2 and not traj.segments[1:]  # one sequence across the two APIs
        assert_sampled_by_engine(traj, engine)
