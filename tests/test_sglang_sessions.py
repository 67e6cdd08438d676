"""SGLangEngine for asynchronous RL, against the fake server (real HTTP): sticky routing (every
turn of an episode on one server, failover when it leaves) and partial rollouts (a weight update
that keeps the requests in flight, each token's weight version known)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from agentgrpo.engine.base import SamplingParams
from agentgrpo.engine.sglang import SGLangEngine
from tests.fake_sglang import FakeSGLang
from tests.test_sglang_engine import FAST


@pytest.fixture
async def server():
    servers: list[FakeSGLang] = []

    async def make(**kw: Any) -> FakeSGLang:
        s = FakeSGLang(**kw)
        await s.start()
        servers.append(s)
        return s

    yield make
    for s in servers:
        await s.stop()


@pytest.fixture
async def engine():
    engines: list[SGLangEngine] = []

    def make(urls: list[str], **kw: Any) -> SGLangEngine:
        e = SGLangEngine(urls, **{**FAST, **kw})
        engines.append(e)
        return e

    yield make
    for e in engines:
        await e.aclose()


# ---------------------------------------------------------------------------------------------
# Sticky routing


async def _episode(e: Any, ep: int, turns: int, log: list[Any]) -> None:
    """A multi-turn episode: each turn's prompt is the last one plus its output and a 'tool' id,
    as a rollout builds it."""
    prompt = [1000 + ep]
    for t in range(turns):
        c = await e.generate(prompt, SamplingParams(max_new_tokens=3, session_id=f"ep{ep}"))
        log.append((ep, t, len(prompt), c.meta["cached_tokens"]))
        prompt = prompt + c.token_ids + [7]


def _servers_of(servers: list[Any], ep: int) -> set[int]:
    """Which servers received a request of episode `ep` (its prompts start with 1000 + ep)."""
    return {
        i for i, s in enumerate(servers) if any(r["input_ids"][0] == 1000 + ep for r in s.requests)
    }


async def test_every_turn_of_an_episode_goes_to_one_server(server, engine):
    servers = [await server() for _ in range(3)]
    e = engine([s.url for s in servers])
    log: list[Any] = []
    await asyncio.gather(*(_episode(e, ep, 4, log) for ep in range(6)))
    assert all(len(_servers_of(servers, ep)) == 1 for ep in range(6))
    assert all(len(s.requests) > 0 for s in servers)  # the episodes spread over the servers
    # every later turn found the episode so far (all but its new 'tool' id) in the server's cache
    assert all(cached == prompt_len - 1 for ep, t, prompt_len, cached in log if t > 0)

    # turns of 4 episodes taken in turn, one at a time: each goes to an idle server, which the
    # balancer rotates; only the session keeps an episode on its server (fails without it)
    for sticky in (100, 0):
        servers = [await server() for _ in range(3)]
        e = engine([s.url for s in servers], max_sticky_sessions=sticky)
        prompts = {ep: [1000 + ep] for ep in range(4)}
        for _turn in range(3):
            for ep, prompt in prompts.items():
                p = SamplingParams(max_new_tokens=3, session_id=f"ep{ep}")
                prompt += (await e.generate(prompt, p)).token_ids + [7]
        spread = [len(_servers_of(servers, ep)) for ep in range(4)]
        assert spread == [1] * 4 if sticky else max(spread) > 1


async def test_a_session_moves_when_its_server_dies_and_stays_moved(server, engine):
    a, b = await server(), await server()
    e = engine([a.url, b.url], request_timeout_s=10)
    p = SamplingParams(max_new_tokens=2, session_id="ep")
    await e.generate([1, 2], p)
    home = e._pool.session_server("ep")
    dead, other = (a, b) if home == a.url else (b, a)
    port = dead.port
    await dead.stop()  # mid-episode
    c = await e.generate([1, 2, 3], p)
    assert c.finish_reason == "length" and e._pool.session_server("ep") == other.url
    await dead.start(port=port)  # it comes back healthy
    await e.wait_ready(timeout_s=5)
    assert all(s.healthy for s in e.servers())
    n_dead = len(dead.requests)
    for turn in range(3):
        await e.generate([1, 2, 3, 4 + turn], p)
    assert len(dead.requests) == n_dead  # the session stayed on the server it moved to
    assert e._pool.session_server("ep") == other.url


async def test_new_sessions_are_balanced_by_least_outstanding(server, engine):
    """As `test_least_outstanding_balancing`, each request a new session."""
    a, b = await server(), await server()
    a.faults.generate_delay_s = 0.2
    e = engine([a.url, b.url])
    n = iter(range(10**6))

    def new() -> SamplingParams:
        return SamplingParams(max_new_tokens=2, session_id=f"s{next(n)}")

    await asyncio.gather(*(e.generate([1], new()) for _ in range(4)))
    assert (len(a.requests), len(b.requests)) == (2, 2)

    async def stream_of(k: int) -> None:
        for _ in range(k):
            await e.generate([1], new())

    await asyncio.gather(*(stream_of(10) for _ in range(4)))
    assert len(b.requests) - 2 > 3 * (len(a.requests) - 2)


async def test_a_full_session_server_is_waited_for_and_others_pass(server, engine):
    """One slot per server: a session's turn waits for its own server's slot; a request of
    another session meanwhile takes the free server at once (the waiter does not hold it)."""
    a, b = await server(), await server()
    for s in (a, b):
        s.faults.token_delay_s = 0.01
    e = engine([a.url, b.url], max_inflight_per_server=1)
    long = asyncio.create_task(e.generate([1], SamplingParams(max_new_tokens=40, session_id="ep")))
    await asyncio.sleep(0.05)
    home = e._pool.session_server("ep")
    busy, free = (a, b) if home == a.url else (b, a)
    turn = asyncio.create_task(
        e.generate([1, 2], SamplingParams(max_new_tokens=2, session_id="ep"))
    )
    await asyncio.sleep(0.05)
    other = await asyncio.wait_for(
        e.generate([3], SamplingParams(max_new_tokens=2, session_id="other")), 0.3
    )
    assert other.finish_reason == "length" and not long.done() and not turn.done()
    await asyncio.gather(long, turn)
    assert [r["input_ids"] for r in busy.requests] == [[1], [1, 2]]
    assert [r["input_ids"] for r in free.requests] == [[3]]


async def test_the_session_table_forgets_the_least_recently_used(server, engine):
    a, b = await server(), await server()
    e = engine([a.url, b.url], max_sticky_sessions=2)
    for sid in ("s0", "s1", "s0", "s2"):  # s0 used again: s1 is the oldest when s2 comes
        await e.generate([1], SamplingParams(max_new_tokens=2, session_id=sid))
    assert [e._pool.session_server(s) is not None for s in ("s0", "s1", "s2")] == [
        True,
        False,
        True,
    ]
    with pytest.raises(ValueError):
        engine([a.url], max_sticky_sessions=-1)
