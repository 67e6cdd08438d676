"""SGLangEngine for asynchronous RL, against the fake server (real HTTP): sticky routing (every
turn of an episode on one server, failover when it leaves) and partial rollouts (a weight update
that keeps the requests in flight, each token's weight version known)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from agentgrpo.engine.base import EngineError, SamplingParams
from agentgrpo.engine.sglang.client import StreamFold, parse_generate_output
from tests.fake_sglang import FakeSGLang, engine_fixture, server_fixture
from tests.test_sglang_engine import FAST, fixture

server = server_fixture()
engine = engine_fixture(**FAST)


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
    long = asyncio.create_task(e.generate([1], SamplingParams(max_new_tokens=300, session_id="ep")))
    await asyncio.sleep(0.05)
    home = e._pool.session_server("ep")
    busy, free = (a, b) if home == a.url else (b, a)
    turn = asyncio.create_task(
        e.generate([1, 2], SamplingParams(max_new_tokens=2, session_id="ep"))
    )
    await asyncio.sleep(0.05)
    other = await asyncio.wait_for(
        e.generate([3], SamplingParams(max_new_tokens=2, session_id="other")), 2
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


# ---------------------------------------------------------------------------------------------
# Partial rollouts: a weight update keeps the requests in flight


def _script(prompt: list[int]) -> list[int]:
    return list(range(100, 130))  # 30 distinct ids, whatever the prompt


async def _wait_decoding(s: FakeSGLang) -> None:
    for _ in range(2000):
        if any(it.produced for it in s._items.values()):
            return
        await asyncio.sleep(0.005)
    raise AssertionError("no request started decoding")


@pytest.mark.parametrize("incremental", [False, True])
async def test_a_request_in_flight_keeps_its_tokens_across_a_push(
    server, engine, tmp_path, incremental
):
    """The request is paused (retract), not aborted: it finishes with all its tokens from one
    request, and says how many the old weights sampled (the fake records how many it had
    decoded when paused). The update does not ask to flush: over the parked request that would
    kill stock SGLang's scheduler (the fake's too)."""
    s = await server(script=_script, weight_version="0", incremental_streaming=incremental)
    s.faults.token_delay_s = 0.05  # 1.5 s of decoding: the push lands mid-request under load
    e = engine([s.url], partial_rollouts=True)
    task = asyncio.create_task(e.generate([1, 2], SamplingParams(max_new_tokens=30)))
    await _wait_decoding(s)
    await e.update_weights_from_disk(tmp_path, version="1")
    c = await task
    (before,) = s.pauses[0].values()
    assert 0 < before < 30
    assert (c.finish_reason, c.token_ids, c.weight_version) == ("length", _script([]), "1")
    assert c.version_runs == [(before, "0"), (30 - before, "1")]
    assert len(s.requests) == 1 and s.requests[0]["stream"] is True
    assert [(p, b) for p, b in s.calls] == [
        ("/pause_generation", {"mode": "retract"}),
        ("/flush_cache", None),
        (
            "/update_weights_from_disk",
            {"model_path": str(tmp_path), "weight_version": "1", "flush_cache": False},
        ),
        ("/continue_generation", {}),
    ]
    assert not s.unhealthy
    # a request that did not cross the push has one version: no runs
    c = await e.generate([1, 2], SamplingParams(max_new_tokens=3))
    assert (c.weight_version, c.version_runs, c.token_version_runs) == ("1", None, [(3, "1")])


async def test_without_partial_rollouts_a_push_still_aborts_and_resends(server, engine, tmp_path):
    s = await server(script=_script)
    s.faults.token_delay_s = 0.01
    e = engine([s.url])
    task = asyncio.create_task(e.generate([1, 2], SamplingParams(max_new_tokens=30)))
    await _wait_decoding(s)
    await e.update_weights_from_disk(tmp_path, version="1")
    c = await task
    assert (c.version_runs, len(s.requests), s.calls[0]) == (
        None,
        2,
        ("/pause_generation", {"mode": "abort"}),
    )
    assert "stream" not in s.requests[0] or s.requests[0]["stream"] is False


@pytest.mark.parametrize("retract_flush", [False, True])
async def test_a_server_that_cannot_flush_under_retract_is_reported_once(
    server, engine, tmp_path, caplog, retract_flush
):
    s = await server(script=_script, retract_flush=retract_flush)
    s.faults.token_delay_s = 0.05
    e = engine([s.url], partial_rollouts=True)
    task = asyncio.create_task(e.generate([1], SamplingParams(max_new_tokens=30)))
    await _wait_decoding(s)
    with caplog.at_level("WARNING", logger="agentgrpo.engine.sglang.client"):
        for v in ("1", "2"):
            await e.update_weights_from_disk(tmp_path, version=v)
    runs = (await task).version_runs
    order = ["default", "1", "2"]  # "1" may have decoded nothing: the second push came at once
    versions = [v for _, v in runs]
    assert versions[0] == "default" and len(versions) >= 2
    assert versions == sorted(set(versions), key=order.index) and sum(n for n, _ in runs) == 30
    warned = [r for r in caplog.records if "cannot flush" in r.getMessage()]
    assert len(warned) == (0 if retract_flush else 1)


async def test_a_streamed_request_learns_the_context_window(server, engine):
    """SGLang reports a streamed request's validation error as an event of a 200 stream: the
    client still learns the window from it and clamps, as from the 400 of a plain request."""
    s = await server(context_length=32)
    e = engine([s.url], partial_rollouts=True)
    c = await e.generate([1] * 10, SamplingParams(max_new_tokens=100))
    assert (c.finish_reason, len(c.token_ids)) == ("length", 32 - 10 - 1)
    assert [r["sampling_params"]["max_new_tokens"] for r in s.requests] == [100, 21]


async def test_partial_rollouts_need_a_new_enough_server_and_live_memory(server, engine):
    s = await server(version="0.5.5")
    with pytest.raises(Exception, match="partial_rollouts needs SGLang >= 0.5.6"):
        await engine([s.url], partial_rollouts=True).wait_ready(timeout_s=5)
    await engine([s.url]).wait_ready(timeout_s=5)  # fine without
    with pytest.raises(ValueError, match="choose one"):
        engine([s.url], partial_rollouts=True, release_memory_during_training=True)


@pytest.mark.parametrize(
    "name", ["generate_stream_default.json", "generate_stream_incremental.json"]
)
def test_stream_fold_reads_both_chunk_forms_of_the_fixtures(name):
    events = fixture(name)["response"]["events_parsed"][:-1]  # without "[DONE]"
    fold = StreamFold()
    for e in events:
        fold.feed(e)
    c = parse_generate_output(fold.output())
    assert c.token_ids == [13048, 1052, 0] and c.logprobs == [-0.4521, -1.2034, -0.0871]
    assert c.finish_reason == "length" and fold.version_runs(None) == [(3, "default")]


def test_stream_fold_counts_tokens_to_the_version_of_their_chunk_and_rejects_nonsense():
    def chunk(entries: int, total: int, version: str, finish: Any = None) -> dict[str, Any]:
        meta = {
            "finish_reason": finish,
            "weight_version": version,
            "output_token_logprobs": [[-0.1, 5, None]] * entries,
            "completion_tokens": total,
        }
        return {"meta_info": meta}

    fold = StreamFold()
    for c in (chunk(2, 2, "3"), chunk(3, 3, "3"), chunk(5, 5, "4"), chunk(6, 6, "4", {"t": 1})):
        fold.feed(c)  # cumulative
    assert fold.version_runs(None) == [(3, "3"), (3, "4")]
    fold = StreamFold()
    for c in (chunk(2, 2, "3"), chunk(1, 3, "3"), chunk(2, 5, "4"), chunk(1, 6, "4", {"t": 1})):
        fold.feed(c)  # deltas
    assert fold.version_runs(None) == [(3, "3"), (3, "4")]
    assert len(fold.output()["meta_info"]["output_token_logprobs"]) == 6
    with pytest.raises(EngineError, match="neither cumulative nor a delta"):
        fold.feed(chunk(2, 9, "4"))
    with pytest.raises(EngineError, match="ended before its request finished"):
        StreamFold().output()


@pytest.mark.parametrize("incremental", [False, True])
async def test_cumulative_streaming_servers_are_reported(server, engine, caplog, incremental):
    s = await server(incremental_streaming=incremental)
    with caplog.at_level("WARNING", logger="agentgrpo.engine.sglang.client"):
        await engine([s.url], partial_rollouts=True).wait_ready(timeout_s=5)
    warned = [r for r in caplog.records if "streams cumulative chunks" in r.getMessage()]
    assert len(warned) == (0 if incremental else 1)
