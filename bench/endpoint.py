"""Policy endpoint overhead: one chat completion through the endpoint against calling the engine
directly, in the same run.

    python -m bench.endpoint                 # 100 episodes x 3 calls per mode
    python -m bench.endpoint --local-engine  # also one real turn of the embedded model (loads it)

The engine answers at once with fixed ids (a 24-token reply that calls the calculator), so what
is measured is the endpoint's own work: rendering the prompt (first call: the chat template;
later calls: the suffix after the previous turn), parsing the reply into OpenAI tool_calls,
recording the call, and for the HTTP mode the request and reply through uvicorn, from an httpx
client in a child process (this process's CPU time is the server's alone; the wall time is the
client's clock around its calls). Each mode runs multi-turn episodes of `--turns` calls whose
history grows as an agent's does (reply, tool result, next call). Per call: wall time and this
process's CPU time.

- direct: `engine.generate(prompt_ids)` with the ids a rollout would send (the baseline).
- endpoint: `EndpointEpisode.complete(body)`, the endpoint without HTTP.
- http: a POST to `/episodes/<id>/v1/chat/completions` on a served endpoint.
- per API, without HTTP, each as its route answers (request checks, translation, the reply's
  JSON or its events, read to the end): chat, chat-stream (Chat Completions), responses,
  responses-stream (the Responses API), messages, messages-stream (Anthropic's Messages API). The
  agent sends back what each API replied in that API's own form (output items, content blocks).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # the shared CPU: see docs/performance.md

from transformers import AutoTokenizer  # noqa: E402

from agentgrpo.agents import anthropic, responses  # noqa: E402
from agentgrpo.agents.endpoint import EndpointEpisode, PolicyEndpoint, chat_answer  # noqa: E402
from agentgrpo.chat.format import ChatFormat  # noqa: E402
from agentgrpo.engine.base import Completion, SamplingParams  # noqa: E402
from agentgrpo.models.embedded import default_model_path  # noqa: E402
from agentgrpo.types import Message  # noqa: E402
from tools.calculator import calculator  # noqa: E402

REPLY = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "56 + 55"}}\n</tool_call>'


class InstantEngine:
    """Answers every request at once with the same ids."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
        return Completion(
            token_ids=list(self.ids),
            logprobs=[-0.5] * len(self.ids),
            finish_reason="stop",
            weight_version="0",
        )

    async def update_weights(self, weights, *, version: str) -> None:
        pass


CLIENT = r"""
import json, sys, time, httpx
base, episodes, turns = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
tools = json.loads(sys.argv[4])
with httpx.Client(base_url=base) as http:
    t0 = time.perf_counter()
    for e in range(episodes):
        messages = [{"role": "system", "content": "You are a careful assistant with a calculator."},
                    {"role": "user", "content": "What is 56 + 55?"}]
        for _ in range(turns):
            r = http.post(f"/episodes/h{e}/v1/chat/completions",
                          json={"model": "policy", "messages": messages, "tools": tools})
            r.raise_for_status()
            message = r.json()["choices"][0]["message"]
            messages += [message, {"role": "tool", "content": "111",
                                   "tool_call_id": message["tool_calls"][0]["id"]}]
    print(time.perf_counter() - t0)
"""


def conversation(turn: int) -> list[dict]:
    """The request body's messages at call `turn` (0-based), as an agent builds them."""
    messages = [
        {"role": "system", "content": "You are a careful assistant with a calculator."},
        {"role": "user", "content": "What is 56 + 55?"},
    ]
    for k in range(turn):
        call = {
            "id": f"call_{k}",
            "type": "function",
            "function": {"name": "calculator", "arguments": '{"expression": "56 + 55"}'},
        }
        messages += [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"call_{k}", "content": "111"},
        ]
    return messages


async def run(chat: ChatFormat, episodes: int, turns: int) -> dict[str, tuple[float, float]]:
    ids = chat.encode(REPLY) + [chat.end_of_turn_id]
    engine = InstantEngine(ids)
    tools = [calculator.schema]
    params = SamplingParams(max_new_tokens=64)
    out = {}

    def body(messages: list[dict]) -> dict:
        return {"model": "policy", "messages": messages, "tools": tools}

    async def agent(send, ep: str) -> None:  # replies carry new call ids: rebuild from the reply
        messages = conversation(0)
        for _ in range(turns):
            reply = await send(ep, body(messages))
            messages.append(reply["choices"][0]["message"])
            messages.append(
                {
                    "role": "tool",
                    "content": "111",
                    "tool_call_id": reply["choices"][0]["message"]["tool_calls"][0]["id"],
                }
            )

    async def timed(name: str, episode_fn) -> None:
        t0, c0 = time.perf_counter(), time.process_time()
        for e in range(episodes):
            await episode_fn(e)
        n = episodes * turns
        out[name] = ((time.perf_counter() - t0) / n * 1e3, (time.process_time() - c0) / n * 1e3)

    prompts = []  # the ids a rollout sends: the endpoint's own records, so both see the same
    endpoint = PolicyEndpoint()

    async def endpoint_episode(e: int) -> None:
        ep = endpoint.add(EndpointEpisode(id=f"d{e}", engine=engine, chat=chat, params=params))

        async def send(_ep: str, b: dict) -> dict:
            return await ep.complete(b)

        await agent(send, ep.id)
        prompts.append([c.prompt_ids for c in ep.calls])
        endpoint.remove(ep.id)

    await timed("endpoint", endpoint_episode)

    async def direct_episode(e: int) -> None:
        for prompt in prompts[e]:
            await engine.generate(prompt, params)

    await timed("direct", direct_episode)
    async with (
        endpoint.serving() as base
    ):  # the client in its own process: CPU here is the server's
        for e in range(episodes):
            endpoint.add(EndpointEpisode(id=f"h{e}", engine=engine, chat=chat, params=params))
        c0 = time.process_time()
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            CLIENT,
            base,
            str(episodes),
            str(turns),
            json.dumps(tools),
            stdout=asyncio.subprocess.PIPE,
        )
        wall_s, _ = await proc.communicate()  # the client's own clock around its calls
        assert proc.returncode == 0
        n = episodes * turns
        out["http"] = (float(wall_s) / n * 1e3, (time.process_time() - c0) / n * 1e3)
        assert all(len(endpoint.episodes[f"h{e}"].calls) == turns for e in range(episodes))
    return out


SYSTEM = "You are a careful assistant with a calculator."
QUESTION = "What is 56 + 55?"


async def read(response) -> list[dict]:
    """A route's answer as JSON objects: the body, or each event's data (the stream read to its
    end, as a client reads it)."""
    if not hasattr(response, "body_iterator"):
        return [json.loads(response.body)]
    text = "".join([c if isinstance(c, str) else c.decode() async for c in response.body_iterator])
    return [
        json.loads(line[6:])
        for line in text.splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]


def chat_reply(objs: list[dict]) -> dict:
    """The assistant message of a chat reply, or joined from its chunks."""
    if objs[0]["object"] == "chat.completion":
        return objs[0]["choices"][0]["message"]
    calls: dict[int, dict] = {}
    for chunk in objs:
        for choice in chunk["choices"]:
            for d in choice["delta"].get("tool_calls") or []:
                call = calls.setdefault(d["index"], {"type": "function", "function": {}})
                call["id"] = d.get("id") or call.get("id")
                fn = d.get("function") or {}
                call["function"]["name"] = fn.get("name") or call["function"].get("name")
                args = call["function"].get("arguments", "") + fn.get("arguments", "")
                call["function"]["arguments"] = args
    return {"role": "assistant", "content": None, "tool_calls": list(calls.values())}


def messages_reply(objs: list[dict]) -> list[dict]:
    """The content blocks of a Messages reply, or joined from its events."""
    if objs[0].get("type") == "message":
        return objs[0]["content"]
    blocks: list[dict] = []
    for event in objs:
        if event["type"] == "content_block_start":
            blocks.append(dict(event["content_block"], _json=""))
        elif event["type"] == "content_block_delta" and "partial_json" in event["delta"]:
            blocks[-1]["_json"] += event["delta"]["partial_json"]
    for b in blocks:
        raw = b.pop("_json")
        if b["type"] == "tool_use":
            b["input"] = json.loads(raw)
    return blocks


async def api_episode(api: str, ep: EndpointEpisode, turns: int, tools: list[dict]) -> None:
    """One agent's calls through one API's route answer, sending back each reply in that API's
    form."""
    stream = api.endswith("-stream")
    kind = api.removesuffix("-stream")
    fn = tools[0]["function"]
    if kind == "chat":
        messages = conversation(0)
        for _ in range(turns):
            b = {"model": "policy", "messages": messages, "tools": tools, "stream": stream}
            message = chat_reply(await read(await chat_answer(ep, b, "policy")))
            call_id = message["tool_calls"][0]["id"]
            messages += [message, {"role": "tool", "tool_call_id": call_id, "content": "111"}]
    elif kind == "responses":
        tool = {"type": "function", "name": fn["name"], "parameters": fn["parameters"]}
        items: list[dict] = [{"role": "user", "content": QUESTION}]
        for _ in range(turns):
            b = {"model": "policy", "instructions": SYSTEM, "input": items, "tools": [tool]}
            objs = await read(await responses.answer(ep, {**b, "stream": stream}, "policy"))
            output = objs[-1]["response"]["output"] if stream else objs[0]["output"]
            call_id = next(i["call_id"] for i in output if i["type"] == "function_call")
            items += output + [
                {"type": "function_call_output", "call_id": call_id, "output": "111"}
            ]
    else:
        tool = {"name": fn["name"], "input_schema": fn["parameters"]}
        messages = [{"role": "user", "content": QUESTION}]
        for _ in range(turns):
            b = {"model": "policy", "max_tokens": 64, "system": SYSTEM, "tools": [tool]}
            b |= {"messages": messages, "stream": stream}
            blocks = messages_reply(await read(await anthropic.answer(ep, b, "policy")))
            use = next(x for x in blocks if x["type"] == "tool_use")
            result = {"type": "tool_result", "tool_use_id": use["id"], "content": "111"}
            messages += [
                {"role": "assistant", "content": blocks},
                {"role": "user", "content": [result]},
            ]


API_MODES = ("chat", "chat-stream", "responses", "responses-stream", "messages", "messages-stream")


async def run_apis(chat: ChatFormat, episodes: int, turns: int) -> dict[str, tuple[float, float]]:
    """Per API mode: (wall ms, CPU ms) per call; each episode's calls must stay one sequence."""
    engine = InstantEngine(chat.encode(REPLY) + [chat.end_of_turn_id])
    params, out = SamplingParams(max_new_tokens=64), {}
    for api in API_MODES:
        t0, c0 = time.perf_counter(), time.process_time()
        for e in range(episodes):
            ep = EndpointEpisode(id=f"{api}{e}", engine=engine, chat=chat, params=params)
            await api_episode(api, ep, turns, [calculator.schema])
            _, diverged = ep.trajectory("bench")
            assert diverged is None and len(ep.calls) == turns
        n = episodes * turns
        out[api] = ((time.perf_counter() - t0) / n * 1e3, (time.process_time() - c0) / n * 1e3)
    return out


def local_turn_ms(path, chat: ChatFormat, max_new_tokens: int) -> tuple[float, float, int]:
    from agentgrpo.engine.local.engine import LocalEngine

    engine = LocalEngine(path, tokenizer=chat.tokenizer, seed=0, max_batch_size=1)
    prompt = chat.prompt_ids(
        [Message(role="user", content="What is 56 + 55?")], [calculator.schema]
    )
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.7, seed=0)
    asyncio.run(engine.generate(prompt, params))  # warm-up
    t0, c0 = time.perf_counter(), time.process_time()
    out = asyncio.run(engine.generate(prompt, params))
    return (time.perf_counter() - t0) * 1e3, (time.process_time() - c0) * 1e3, len(out.token_ids)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--episodes", type=int, default=100)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument(
        "--local-engine",
        action="store_true",
        help="also time one 48-token turn of the embedded model with the local engine",
    )
    args = p.parse_args()
    path = default_model_path()
    chat = ChatFormat(AutoTokenizer.from_pretrained(path))
    asyncio.run(run(chat, 5, args.turns))  # warm-up: template compile, first-render checks
    asyncio.run(run_apis(chat, 5, args.turns))
    res = asyncio.run(run(chat, args.episodes, args.turns))
    res |= asyncio.run(run_apis(chat, args.episodes, args.turns))
    print(f"{args.episodes} episodes x {args.turns} calls; per call: wall ms, CPU ms")
    for name in ("direct", "endpoint", "http", *API_MODES):
        print(f"  {name:16s} {res[name][0]:7.3f} {res[name][1]:7.3f}")
    for name in ("endpoint", "http", *API_MODES):
        print(
            f"  overhead {name:16s} wall {res[name][0] - res['direct'][0]:.3f} ms, "
            f"CPU {res[name][1] - res['direct'][1]:.3f} ms"
        )
    if args.local_engine:
        ms, cpu, n = local_turn_ms(path, chat, 48)
        over = res["http"][1] - res["direct"][1]
        print(
            f"  local engine turn ({n} tokens, embedded model): wall {ms:.0f} ms, "
            f"CPU {cpu:.0f} ms; http overhead CPU = {100 * over / ms:.2f}% of its wall time, "
            f"{100 * over / cpu:.2f}% of its CPU"
        )


if __name__ == "__main__":
    main()
