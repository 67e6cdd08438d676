"""Trust boundaries, round 2 (issue 42): the policy endpoint under hostile clients, tool schemas as
data, checkpoints that stay in their directory, short keys masked. Each test names the finding it
covers; docs/security.md lists them."""

from __future__ import annotations

# --- finding 8: short API keys in innocent fields ---------------------------------------------


def test_a_short_key_in_an_innocent_field_is_masked():
    """Finding 8: `sk-` and 8 key characters under a key named `note` went to config.yaml in
    clear (the rule wanted 12). Every key prefix is now masked from 8 characters on; shorter
    values and look-alikes inside words stay."""
    from agentgrpo.run.log import mask_secrets

    assert mask_secrets(
        {
            "note": "sk-abcd1234",
            "env": {"kwargs": {"x": "use hf_abcdefgh here", "y": "ghp_12345678"}},
            "short": "sk-1234567",
            "word": "task-abcdefghij",
        }
    ) == {
        "note": "***",
        "env": {"kwargs": {"x": "use *** here", "y": "***"}},
        "short": "sk-1234567",
        "word": "task-abcdefghij",
    }


# --- the policy endpoint: bad requests are 4xx, and leave the episode usable (findings 6, 7) ---

USER = [{"role": "user", "content": "What is 2 + 2?"}]


def _nested(depth):
    value = "x"
    for _ in range(depth):
        value = {"a": value}
    return value


def _serve_episodes(chat, body_fn, **kw):
    """Run `body_fn(http, endpoint, engine)` against an in-process serve-policy endpoint (token
    `k`) holding episode `e1`."""
    import asyncio

    import httpx

    from agentgrpo.agents.endpoint import EndpointEpisode, PolicyEndpoint
    from agentgrpo.engine import SamplingParams
    from agentgrpo.rollout.episode import turn_seed
    from tests.fakes import ScriptedEngine

    engine = ScriptedEngine(chat.tokenizer, ["4"], chat.end_of_turn_id)

    def new_episode(eid, seed):
        return EndpointEpisode(
            id=eid,
            engine=engine,
            chat=chat,
            seed=seed,
            seed_of=turn_seed,
            params=SamplingParams(max_new_tokens=16),
        )

    endpoint = PolicyEndpoint(token="k", new_episode=new_episode, **kw)
    endpoint.add(new_episode("e1", None))

    async def run():
        async with (
            endpoint.serving() as base,
            httpx.AsyncClient(
                base_url=base, headers={"Authorization": "Bearer k"}, timeout=30
            ) as http,
        ):
            return await body_fn(http, endpoint, engine)

    return asyncio.run(run())


def test_bad_seeds_and_deep_json_are_400s_that_leave_the_episode_usable(chat):
    """Finding 6: a seed past 64 bits reached the engine (whose generator overflows: a 503 that
    ended the episode as an engine failure), and JSON nested 900 deep in tools or in a tool call's
    arguments overflowed the template's recursion (a 500). Each is now a 400 naming the field,
    nothing reaches the engine, and the episode goes on."""
    import json

    url = "/episodes/e1/v1/chat/completions"
    tools = [
        {
            "type": "function",
            "function": {
                "name": "f",
                "parameters": {"type": "object", "properties": {"x": _nested(900)}},
            },
        }
    ]
    call = {"id": "c", "type": "function", "function": {"name": "f"}}
    deep_args = [
        *USER,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {**call, "function": {"name": "f", "arguments": json.dumps(_nested(900))}}
            ],
        },
        {"role": "tool", "tool_call_id": "c", "content": "1"},
    ]
    bad = {
        "seed 2**64": {"messages": USER, "seed": 2**64},
        "seed -2**63 - 1": {"messages": USER, "seed": -(2**63) - 1},
        "seed 1e300": {"messages": USER, "seed": 1e300},
        "tools 900 deep": {"messages": USER, "tools": tools},
        "arguments 900 deep": {"messages": deep_args},
    }

    async def body(http, endpoint, engine):
        out = {what: await http.post(url, json=req) for what, req in bad.items()}
        out["episode seed 2**64"] = await http.post("/episodes", json={"seed": 2**64})
        out["fine"] = await http.post(url, json={"messages": USER, "seed": 2**63 - 1})
        return out, len(engine.calls)

    out, generated = _serve_episodes(chat, body)
    for what, r in out.items():
        if what != "fine":
            assert r.status_code == 400, (what, r.status_code, r.text[:200])
            assert r.json()["error"]["type"] == "invalid_request_error", what
    assert out["seed 2**64"].json()["error"]["param"] == "seed"
    assert "nest deeper than 64" in out["arguments 900 deep"].json()["error"]["message"]
    assert out["fine"].status_code == 200 and generated == 1  # only the good request generated


def test_episode_ids_are_bounded_and_every_accepted_id_is_reachable(chat):
    """Finding 7: a 4 MB episode id was accepted, and one over 16 KB could never be reached or
    deleted again (its URL exceeds the server's request-head limit), holding an episode slot until
    restart. Ids are now 1-128 URL-safe characters; the longest one is reachable and deletable."""
    longest = "a" * 128

    async def body(http, endpoint, engine):
        refused = [
            await http.post("/episodes", json={"id": eid})
            for eid in ("x" * ((4 << 20) - 64), "b" * 129, "a/b", "..", "é")
        ]
        made = await http.post("/episodes", json={"id": longest})
        chat_url = f"/episodes/{longest}/v1/chat/completions"
        called = await http.post(chat_url, json={"messages": USER})
        deleted = await http.delete(f"/episodes/{longest}")
        return refused, made, called, deleted, set(endpoint.episodes)

    refused, made, called, deleted, left = _serve_episodes(chat, body, max_body_bytes=8 << 20)
    assert [r.status_code for r in refused] == [400] * 5
    assert all(r.json()["error"]["param"] == "id" for r in refused)
    assert made.status_code == called.status_code == deleted.status_code == 200
    assert left == {"e1"}
