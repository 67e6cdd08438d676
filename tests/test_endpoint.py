"""The policy endpoint over HTTP: OpenAI-shaped answers and errors, episodes that never mix, and
calls from another process landing in the right episode during a rollout."""

import asyncio
import json
import re
import sys

import httpx
import pytest

from agentgrpo import AgentEnv, StopReason, Task
from agentgrpo.agents.endpoint import EndpointEpisode, PolicyEndpoint
from agentgrpo.engine import SamplingParams
from agentgrpo.rollout.episode import RolloutConfig, collect
from tests.fakes import ScriptedEngine

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate arithmetic.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]
USER = [{"role": "user", "content": "What is 2 + 2?"}]


def echo(chat):
    """Answers `ack <marker>` with the last `ep=<marker>` the prompt holds."""

    def script(ids, i):
        found = re.findall(r"ep=(\w+)", chat.decode(ids))
        return f"ack {found[-1] if found else '?'}"

    return script


async def serve(chat, body_fn, *, token=None, context_len=None, **kw):
    engine = ScriptedEngine(chat.tokenizer, kw.pop("script", ["4"]), chat.end_of_turn_id)
    endpoint = PolicyEndpoint(token=token, **kw)
    endpoint.add(
        EndpointEpisode(
            id="e1",
            engine=engine,
            chat=chat,
            context_len=context_len,
            params=SamplingParams(max_new_tokens=64),
        )
    )
    async with endpoint.serving() as base, httpx.AsyncClient(base_url=base) as http:
        return await body_fn(http, endpoint)


def test_chat_completion_shape_and_record(chat):
    async def body(http, endpoint):
        r = await http.post(
            "/episodes/e1/v1/chat/completions",
            json={
                "model": "policy",
                "messages": USER,
                "tools": TOOLS,
                "seed": 1,
                "user": "ignored",
                "max_completion_tokens": 8,
            },
        )
        models = await http.get("/v1/models")
        return r, models, endpoint.episodes["e1"]

    r, models, ep = asyncio.run(serve(chat, body))
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "chat.completion" and out["model"] == "policy"
    choice = out["choices"][0]
    assert (
        choice["message"] == {"role": "assistant", "content": "4"}
        and choice["finish_reason"] == "stop"
    )
    [call] = ep.calls
    assert call.prompt_ids == chat.prompt_ids([chat_message(m) for m in USER], TOOLS)
    assert out["usage"] == {
        "prompt_tokens": len(call.prompt_ids),
        "completion_tokens": len(call.token_ids),
        "total_tokens": len(call.prompt_ids) + len(call.token_ids),
    }
    assert call.token_ids[-1] == chat.end_of_turn_id and len(call.logprobs) == len(call.token_ids)
    assert call.weight_version == "v0" and call.finish_reason == "stop"
    assert models.json()["data"][0]["id"] == "policy"


def chat_message(d):
    from agentgrpo import Message

    return Message.from_dict(d)


def test_tool_calls_come_back_in_openai_form(chat):
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}}\n</tool_call>'

    async def body(http, endpoint):
        return await http.post(
            "/episodes/e1/v1/chat/completions",
            json={"messages": USER, "tools": TOOLS, "tool_choice": "auto"},
        )

    out = asyncio.run(serve(chat, body, script=[call])).json()
    choice = out["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    [tc] = choice["message"]["tool_calls"]
    assert tc["type"] == "function" and tc["function"]["name"] == "calculator"
    assert json.loads(tc["function"]["arguments"]) == {"expression": "2+2"}


BAD = [  # (what, request, status, param or code)
    ("broken JSON", b'{"messages": [', 400, None),
    ("n > 1", {"messages": USER, "n": 2}, 400, "n"),
    ("stream not a boolean", {"messages": USER, "stream": "yes"}, 400, "stream"),
    (
        "an unknown model, as OpenAI and vLLM answer",
        {"messages": USER, "model": "gpt-4o"},
        404,
        "model_not_found",
    ),
    (
        "a tool message without tool_call_id, as OpenAI answers",
        {"messages": [*USER, {"role": "tool", "content": "4"}]},
        400,
        "missing_required_parameter",
    ),
    (
        "unknown tool in tool_choice",
        {
            "messages": USER,
            "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "search"}},
        },
        400,
        "tool_choice",
    ),
    (
        "tool_choice without tools",
        {"messages": USER, "tool_choice": "required"},
        400,
        "tool_choice",
    ),
    ("a field OpenAI does not have", {"messages": USER, "temprature": 0.5}, 400, "temprature"),
    (
        "a sampling field off its default",
        {"messages": USER, "logit_bias": {"5": 10}},
        400,
        "logit_bias",
    ),
    ("no messages", {"messages": []}, 400, "messages"),
    ("a bad message", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0]"),
    (
        "image content",
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "messages[0]",
    ),
    ("bad temperature", {"messages": USER, "temperature": 3}, 400, "temperature"),
    ("bad max_tokens", {"messages": USER, "max_tokens": 0}, 400, "max_tokens"),
    ("multi-token stop", {"messages": USER, "stop": ["the end of it"]}, 400, "stop"),
    ("body not an object", [1, 2], 400, None),
    (
        "prompt over the context",
        {"messages": [{"role": "user", "content": "word " * 300}]},
        400,
        "context_length_exceeded",
    ),
]


def test_bad_input_gets_openai_shaped_4xx_and_the_server_lives_on(chat):
    async def body(http, endpoint):
        out = []
        for _what, req, *_ in BAD:
            kw = {"content": req} if isinstance(req, bytes) else {"json": req}
            out.append(await http.post("/episodes/e1/v1/chat/completions", **kw))
        out.append(await http.post("/episodes/nope/v1/chat/completions", json={"messages": USER}))
        out.append(await http.post("/episodes/e1/v1/chat/completions", content=b"x" * 5000))
        out.append(await http.post("/v1/chat/completions", json={"messages": USER}))
        out.append(await http.post("/episodes/e1/v1/chat/completions", json={"messages": USER}))
        return out, endpoint.episodes["e1"]

    responses, ep = asyncio.run(serve(chat, body, context_len=256, max_body_bytes=4096))
    for (what, _, status, where), r in zip(BAD, responses):
        assert r.status_code == status, (what, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], what
        assert err["type"] == "invalid_request_error", what
        assert where in (None, err["param"], err["code"]), (what, err)
    unknown, big, no_episode, fine = responses[len(BAD) :]
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "episode_not_found"
    assert big.status_code == 413 and "4096" in big.json()["error"]["message"]
    assert (
        no_episode.status_code == 404
        and "/episodes/<id>/v1" in no_episode.json()["error"]["message"]
    )
    assert fine.status_code == 200 and len(ep.calls) == 1  # only the good request was recorded


def test_token_required_off_loopback_and_when_set(chat):
    async def body(http, endpoint):
        no = await http.post("/episodes/e1/v1/chat/completions", json={"messages": USER})
        wrong = await http.get("/v1/models", headers={"Authorization": "Bearer nope"})
        ok = await http.get("/v1/models", headers={"Authorization": "Bearer s3cret"})
        return no, wrong, ok

    no, wrong, ok = asyncio.run(serve(chat, body, token="s3cret"))
    assert no.status_code == wrong.status_code == 401 and ok.status_code == 200
    assert no.json()["error"]["code"] == "invalid_api_key"

    async def off_loopback():
        async with PolicyEndpoint().serving("0.0.0.0"):
            pass

    with pytest.raises(ValueError, match="without a token"):
        asyncio.run(off_loopback())


class Marked(AgentEnv):
    """Three calls, each with this episode's marker in the newest user message."""

    async def run(self, client, task):
        marker = (
            self.base_url.split("/episodes/")[1].split("/")[0].replace("-", "").replace("_", "")
        )
        messages = []
        for turn in range(3):
            messages.append({"role": "user", "content": f"turn {turn} ep={marker}"})
            reply = await client.chat.completions.create(model=self.model, messages=messages)
            assert reply.choices[0].message.content == f"ack {marker}"
            messages.append(reply.choices[0].message.model_dump(exclude_none=True))
        return 1.0


def test_64_concurrent_episodes_never_mix(chat):
    pytest.importorskip("openai")
    engine = ScriptedEngine(
        chat.tokenizer, echo(chat), chat.end_of_turn_id, delay_s=lambda i: 0.001 * (i % 7)
    )
    cfg = RolloutConfig(group_size=8, tasks_per_step=8, max_turns=3, max_new_tokens=64)
    tasks = [Task(id=f"t{i}", prompt="unused") for i in range(8)]
    groups = asyncio.run(collect(Marked, engine, chat, tasks, cfg))
    trajs = [t for g in groups for t in g.trajectories]
    assert len(trajs) == 64 and engine.max_in_flight > 1
    markers = set()
    for t in trajs:
        assert t.stop_reason == StopReason.COMPLETED and t.num_turns == 3, t.stop_detail
        t.check()
        found = set(re.findall(r"ep=(\w+)", chat.decode(t.token_ids)))
        assert len(found) == 1  # only this episode's calls are in its trajectory
        markers |= found
    assert len(markers) == 64


AGENT_SCRIPT = r"""
import sys, httpx
base, key, marker = sys.argv[1:]
messages = [{"role": "user", "content": f"from another process ep={marker}"}]
for _ in range(2):
    r = httpx.post(base + "/chat/completions", json={"model": "policy", "messages": messages},
                   headers={"Authorization": "Bearer " + key}, timeout=30)
    r.raise_for_status()
    messages.append(r.json()["choices"][0]["message"])
    messages.append({"role": "user", "content": "again"})
print(messages[-2]["content"])
"""


class OtherProcess(AgentEnv):
    """The agent runs in a child process; it knows only the base_url and the key."""

    async def run(self, client, task):
        marker = f"m{task.id}x{self.np_random.integers(1 << 30)}"
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            AGENT_SCRIPT,
            self.base_url,
            self.api_key,
            marker,
            stdout=asyncio.subprocess.PIPE,
        )
        out, _ = await proc.communicate()
        assert proc.returncode == 0
        return float(out.decode().strip() == f"ack {marker}")


def test_calls_from_another_process_land_in_their_episode(chat):
    engine = ScriptedEngine(chat.tokenizer, echo(chat), chat.end_of_turn_id)
    cfg = RolloutConfig(group_size=2, tasks_per_step=2, max_turns=4, max_new_tokens=64)
    tasks = [Task(id=f"t{i}", prompt="unused") for i in range(2)]
    groups = asyncio.run(collect(OtherProcess, engine, chat, tasks, cfg))
    for g in groups:
        for t in g.trajectories:
            assert t.stop_reason == StopReason.COMPLETED and t.reward == 1.0, t.stop_detail
            assert t.num_turns == 2
            t.check()
            [marker] = set(re.findall(r"ep=(\w+)", chat.decode(t.token_ids)))
            assert marker.startswith(f"m{g.task.id}x")


def test_episode_api_start_call_trajectory_reward(chat):
    """serve-policy's API in-process: start an episode, two calls that extend, its trajectory,
    a reward, the end."""
    engine = ScriptedEngine(chat.tokenizer, ["4", "8"], chat.end_of_turn_id)

    def new_episode(eid, seed):
        return EndpointEpisode(
            id=eid, engine=engine, chat=chat, seed=seed, params=SamplingParams(max_new_tokens=32)
        )

    endpoint = PolicyEndpoint(token="k", new_episode=new_episode, max_episodes=1)

    async def body():
        async with (
            endpoint.serving() as base,
            httpx.AsyncClient(base_url=base, headers={"Authorization": "Bearer k"}) as http,
        ):
            start = (await http.post("/episodes", json={"seed": 7})).json()
            url = start["base_url"][len(base) :]
            messages = list(USER)
            for follow_up in ("And 4 + 4?", None):
                out = (
                    await http.post(f"{url}/chat/completions", json={"messages": messages})
                ).json()
                messages.append(out["choices"][0]["message"])
                if follow_up:
                    messages.append({"role": "user", "content": follow_up})
            before = (await http.get(f"/episodes/{start['id']}/trajectory")).json()
            bad = await http.post(f"/episodes/{start['id']}/reward", json={"reward": "high"})
            await http.post(f"/episodes/{start['id']}/reward", json={"reward": 1.5})
            after = (await http.get(f"/episodes/{start['id']}/trajectory")).json()
            dup = await http.post("/episodes", json={"id": start["id"]})
            full = await http.post("/episodes", json={})
            gone = await http.delete(f"/episodes/{start['id']}")
            again = await http.get(f"/episodes/{start['id']}/trajectory")
            return start, before, bad, after, dup, full, gone, again

    start, before, bad, after, dup, full, gone, again = asyncio.run(body())
    assert start["base_url"].endswith(f"/episodes/{start['id']}/v1")
    assert (
        before["reward"] is None
        and before["stop_reason"] == "completed"
        and before["num_turns"] == 2
    )
    sampled = [i for i, m in zip(before["token_ids"], before["loss_mask"]) if m]
    assert sampled == chat.tokenizer.encode("4", add_special_tokens=False) + [
        chat.end_of_turn_id
    ] + chat.tokenizer.encode("8", add_special_tokens=False) + [chat.end_of_turn_id]
    assert engine.calls[1] == before["token_ids"][: len(engine.calls[1])]  # call 2 extends call 1
    assert bad.status_code == 400 and after["reward"] == 1.5
    assert dup.status_code == 409 and full.status_code == 429
    assert gone.status_code == 200 and again.status_code == 404


def test_serve_policy_command_serves_a_model_dir(tiny_model_dir, tmp_path):
    """`agentgrpo serve-policy MODEL_DIR` in its own process, driven over HTTP with a token."""
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp_path / "token").write_text("t0ken\n")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "agentgrpo.cli",
            "serve-policy",
            str(tiny_model_dir),
            "--port",
            str(port),
            "--token-file",
            str(tmp_path / "token"),
            "--max-new-tokens",
            "8",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("serve-policy: http://127.0.0.1:"), line
        with httpx.Client(
            base_url=f"http://127.0.0.1:{port}",
            headers={"Authorization": "Bearer t0ken"},
            timeout=60,
        ) as http:
            assert http.get("/v1/models", headers={"Authorization": ""}).status_code == 401
            eid = http.post("/episodes", json={"seed": 1}).json()["id"]
            out = http.post(f"/episodes/{eid}/v1/chat/completions", json={"messages": USER}).json()
            traj = http.get(f"/episodes/{eid}/trajectory").json()
        assert out["usage"]["completion_tokens"] == sum(traj["loss_mask"]) <= 8
        assert traj["num_turns"] == 1 and traj["stop_reason"] == "completed"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
