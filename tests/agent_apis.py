"""What the tests of the endpoint's APIs share: serve-policy's app in-process over a scripted
engine (with the real SmolLM2 tokenizer), the calculator tool in each API's form, and the check
that an episode's record is token-exact."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator

import httpx

from agentgrpo.agents.endpoint import EndpointEpisode, PolicyEndpoint
from agentgrpo.engine import SamplingParams
from tests.fakes import ScriptedEngine

TOKEN = "k3y"
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}}\n</tool_call>'
THINK_CALL = "<think>\nI should use the tool.\n</think>\n\n" + CALL
PARAMETERS = {
    "type": "object",
    "properties": {"expression": {"type": "string"}},
    "required": ["expression"],
}
DESCRIPTION = "Evaluate arithmetic."
CHAT_TOOL = {
    "type": "function",
    "function": {"name": "calculator", "description": DESCRIPTION, "parameters": PARAMETERS},
}
RESPONSES_TOOL = {
    "type": "function",
    "name": "calculator",
    "description": DESCRIPTION,
    "parameters": PARAMETERS,
}
ANTHROPIC_TOOL = {"name": "calculator", "description": DESCRIPTION, "input_schema": PARAMETERS}


class Recording(ScriptedEngine):
    """A ScriptedEngine that also keeps what each call sampled (ids and logprobs)."""

    async def generate(self, prompt_ids, params):
        out = await super().generate(prompt_ids, params)
        self.__dict__.setdefault("sampled", []).append((out.token_ids, out.logprobs))
        return out


def by_turn(chat, *texts):
    """A script answering the k-th assistant turn of a prompt with texts[k-1] (the last after)."""
    return lambda ids, i: texts[
        min(chat.decode(ids).count("<|im_start|>assistant") - 1, len(texts) - 1)
    ]


@contextlib.asynccontextmanager
async def policy_server(chat, script, **kw) -> AsyncIterator[tuple[httpx.AsyncClient, Recording]]:
    """serve-policy's endpoint (episode API included) on 127.0.0.1 with a token; yields an httpx
    client holding the token at its base URL, and the engine."""
    engine = Recording(chat.tokenizer, script, chat.end_of_turn_id)

    def new_episode(eid, seed):
        return EndpointEpisode(
            id=eid, engine=engine, chat=chat, seed=seed, params=SamplingParams(max_new_tokens=64)
        )

    endpoint = PolicyEndpoint(token=TOKEN, new_episode=new_episode, **kw)
    async with (
        endpoint.serving() as base,
        httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {TOKEN}"}) as http,
    ):
        yield http, engine


async def start(http: httpx.AsyncClient, seed: int = 7) -> dict:
    """A new episode: {id, base_url, ...}."""
    r = await http.post("/episodes", json={"seed": seed})
    r.raise_for_status()
    return r.json()


async def trajectory(http: httpx.AsyncClient, eid: str) -> dict:
    r = await http.get(f"/episodes/{eid}/trajectory")
    r.raise_for_status()
    return r.json()


def assert_token_exact(traj: dict, engine: Recording) -> None:
    """One sequence that every prompt the engine got is a prefix of, with loss mask 1 exactly on
    the ids it sampled and their logprobs."""
    assert "segments" not in traj or len(traj["segments"]) <= 1, "the episode was split"
    ids, mask, logprobs = traj["token_ids"], traj["loss_mask"], traj["logprobs"]
    assert len(ids) == len(mask) == len(logprobs)
    spans = []
    for prompt, (sampled, lps) in zip(engine.calls, engine.sampled, strict=True):
        assert ids[: len(prompt)] == prompt
        assert ids[len(prompt) : len(prompt) + len(sampled)] == sampled
        assert logprobs[len(prompt) : len(prompt) + len(sampled)] == lps
        spans += range(len(prompt), len(prompt) + len(sampled))
    assert [i for i, m in enumerate(mask) if m] == spans


def assert_sampled_by_engine(traj, engine):
    """Every run of loss-mask-1 ids (with its logprobs) is what the engine sampled for exactly the
    ids before it: the record is token-exact (the engine's calls of all episodes mixed)."""
    traj.check()
    ids, mask = list(traj.token_ids), list(traj.loss_mask)
    by_prompt = {}
    for prompt, (sampled, logprobs) in zip(engine.calls, engine.sampled, strict=True):
        by_prompt.setdefault(tuple(prompt), []).append((sampled, logprobs))
    runs = 0
    for s in (i for i in range(len(mask)) if mask[i] and (i == 0 or not mask[i - 1])):
        e = next((i for i in range(s, len(mask)) if not mask[i]), len(mask))
        assert (ids[s:e], list(traj.logprobs[s:e])) in by_prompt[tuple(ids[:s])]
        runs += 1
    assert runs == traj.num_turns


def same_record(a: dict, b: dict) -> bool:
    """Two trajectories with the same tokens, mask and logprobs."""
    return all(a[k] == b[k] for k in ("token_ids", "loss_mask", "logprobs", "prompt_len"))


def arguments(text: str) -> dict:
    return json.loads(text)
