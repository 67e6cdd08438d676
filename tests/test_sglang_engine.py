"""SGLangEngine against the fixtures of tests/data/sglang and against the fake server (real HTTP).

Three groups: (1) the fake server reproduces every fixture it covers, so it is a faithful stand-in;
(2) the client's parser and request body match the fixtures; (3) client behaviour under faults,
with several servers, during weight updates, and the launcher.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentgrpo.engine.base import Completion, EngineError, SamplingParams
from agentgrpo.engine.sglang.client import (
    SGLangConfig,
    SGLangEngine,
    error_message,
    is_context_length_error,
    parse_generate_response,
)
from tests.fake_sglang import (
    FakeSGLang,
    FakeSGLangProcess,
    engine_fixture,
    scripted_logprob,
    server_fixture,
)

FIXTURES = Path(__file__).resolve().parent / "data" / "sglang"  # tests/data/sglang/README.md
VOCAB = {19: "4", 13048: "Hi", 1052: " there", 0: "!", 2585: " How", 26972: "Four"}
VOLATILE = {"id", "cached_tokens", "e2e_latency", "timestamp", "port", "host"}
OPTIONAL = {"response_sent_to_client_ts"}  # the fixtures carry it on some chunks only
FAST = {"backoff_initial_s": 0.01, "probe_interval_s": 0.05, "ready_poll_s": 0.02}


def fixture(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / name).read_text())  # a missing fixture fails the test


def assert_matches(
    exp: Any, got: Any, path: str = "$", *, loose: frozenset[str] = frozenset()
) -> None:
    """`got` has exactly the structure of `exp` (keys in order, lengths, types) and its values,
    except invented ones (`VOLATILE`) and keys in `loose`, compared by type and shape only."""
    if isinstance(exp, dict):
        assert isinstance(got, dict), f"{path}: {type(got).__name__} instead of an object"
        ek = [k for k in exp if k not in OPTIONAL]
        gk = [k for k in got if k not in OPTIONAL]
        assert gk == ek, f"{path}: keys {gk} != {ek}"
        for k in ek:
            if k in VOLATILE:
                assert isinstance(got[k], type(exp[k])) or exp[k] is None, f"{path}.{k}"
            elif k in loose:
                _assert_shape(exp[k], got[k], f"{path}.{k}")
            else:
                assert_matches(exp[k], got[k], f"{path}.{k}", loose=loose)
    elif isinstance(exp, list):
        assert isinstance(got, list) and len(got) == len(exp), f"{path}: {got!r} vs {exp!r}"
        for i, (e, g) in enumerate(zip(exp, got, strict=True)):
            assert_matches(e, g, f"{path}[{i}]", loose=loose)
    elif isinstance(exp, float):
        assert got == pytest.approx(exp), f"{path}: {got} != {exp}"
    else:
        assert got == exp, f"{path}: {got!r} != {exp!r}"


def _assert_shape(exp: Any, got: Any, path: str) -> None:
    if isinstance(exp, list):
        assert isinstance(got, list) and len(got) == len(exp), f"{path}: length {got!r} vs {exp!r}"
        for i, (e, g) in enumerate(zip(exp, got, strict=True)):
            _assert_shape(e, g, f"{path}[{i}]")
    elif exp is None:
        assert got is None, path
    else:
        assert isinstance(got, (int, float) if isinstance(exp, (int, float)) else type(exp)), path


async def send(
    url: str, req: dict[str, Any], headers: dict[str, str] | None = None
) -> httpx.Response:
    async with httpx.AsyncClient(timeout=10) as c:
        return await c.request(
            req["method"],
            url + req["path"],
            json=req.get("json"),
            params=req.get("query"),
            headers={**req.get("headers", {}), **(headers or {})},
        )


async def until_decoding(s: FakeSGLang, timeout_s: float = 10.0) -> None:
    """Wait until a request on `s` has decoded a token (a new httpx client alone can take 0.2 s
    to make its SSL context on a loaded machine: a fixed sleep raced it)."""
    t0 = time.monotonic()
    while not any(it.produced for it in s._items.values()):
        assert time.monotonic() - t0 < timeout_s, "no request started decoding"
        await asyncio.sleep(0.005)


def scripted(*outputs: list[Any]) -> Any:
    """A script that returns the given outputs in turn (one per generated sequence)."""
    queue = list(outputs)
    return lambda prompt: queue.pop(0) if queue else []


server = server_fixture(vocab=VOCAB)
engine = engine_fixture(**FAST)


# ---------------------------------------------------------------------------------------------
# 1. The fake server reproduces the fixtures


def _lp(entries: list[list[Any]]) -> list[tuple[int, float]]:
    return [(e[1], e[0]) for e in entries]


async def test_fake_batch_of_two_with_logprobs(server):
    fx = fixture("generate_batch2_logprobs.json")
    exp = fx["response"]["json"]
    s = await server(script=scripted(*(_lp(o["meta_info"]["output_token_logprobs"]) for o in exp)))
    r = await send(s.url, fx["request"])
    assert r.status_code == 200
    assert_matches(exp, r.json())


async def test_fake_single_text_request_trims_eos_from_text(server):
    fx = fixture("generate_single_text_default.json")
    s = await server(script=scripted([19, 151645]))
    r = await send(s.url, fx["request"])
    exp = copy.deepcopy(fx["response"]["json"])
    exp["meta_info"]["prompt_tokens"] = r.json()["meta_info"]["prompt_tokens"]  # toy tokenizer
    assert_matches(exp, r.json())


async def test_fake_n2_gives_a_list_with_fresh_rids(server):
    fx = fixture("generate_single_prompt_n2.json")
    exp = fx["response"]["json"]
    s = await server(script=scripted(*(_lp(o["meta_info"]["output_token_logprobs"]) for o in exp)))
    got = (await send(s.url, fx["request"])).json()
    assert_matches(exp, got)
    assert len({o["meta_info"]["id"] for o in got} | {"ignored-for-n-gt-1"}) == 3


async def test_fake_prompt_and_top_logprobs(server):
    fx = fixture("generate_top_logprobs_prompt_logprobs.json")
    exp = fx["response"]["json"]  # the fixture shows the meta_info object
    s = await server(
        script=scripted(_lp(exp["output_token_logprobs"])), eos_token_ids=(151643,)
    )  # a base model
    got = (await send(s.url, fx["request"])).json()
    assert_matches(
        exp, got["meta_info"], loose=frozenset({"input_top_logprobs", "output_top_logprobs"})
    )
    assert [e[:2] for e in got["meta_info"]["output_top_logprobs"][0][:1]] == [[-0.1053, 151645]]


async def test_fake_skip_tokenizer_init_has_no_text(server):
    fx = fixture("generate_skip_tokenizer_init.json")
    s = await server(
        script=scripted(_lp(fx["response"]["json"]["meta_info"]["output_token_logprobs"])),
        skip_tokenizer_init=True,
    )
    assert_matches(fx["response"]["json"], (await send(s.url, fx["request"])).json())
    bad = {"method": "POST", "path": "/generate", "json": {"text": "hi"}}
    assert (await send(s.url, bad)).status_code == 400


@pytest.mark.parametrize(
    "name,incremental",
    [("generate_stream_default.json", False), ("generate_stream_incremental.json", True)],
)
async def test_fake_sse_stream(server, name, incremental):
    fx = fixture(name)
    events = fx["response"]["events_parsed"]
    s = await server(
        script=scripted(
            _lp(events[-2]["meta_info"]["output_token_logprobs"])
            if not incremental
            else [t for e in events[:-1] for t in _lp(e["meta_info"]["output_token_logprobs"])]
        ),
        incremental_streaming=incremental,
    )
    r = await send(s.url, fx["request"])
    assert r.headers["content-type"].startswith("text/event-stream")
    raw = r.text
    assert raw.endswith("data: [DONE]\n\n")
    chunks = [c for c in raw.split("\n\n") if c]
    assert all(c.startswith("data: ") and ": " not in c[6:8] for c in chunks)
    got = [json.loads(c[6:]) if c != "data: [DONE]" else "[DONE]" for c in chunks]
    assert_matches(events, got)


async def test_fake_context_length_error_message(server):
    fx = fixture("generate_error_context_length.json")
    s = await server(context_length=256)
    r = await send(s.url, fx["request"])
    assert r.status_code == 400
    assert r.json() == fx["response"]["json"]


async def test_fake_schema_error_and_unknown_sampling_key(server):
    fx = fixture("generate_error_validation_422_as_400.json")
    s = await server()
    r = await send(s.url, fx["request"])
    assert r.status_code == 400
    exp = dict(fx["response"]["json"], message=r.json()["message"])
    assert r.json() == exp
    bad = {
        "method": "POST",
        "path": "/generate",
        "json": {"input_ids": [1, 2], "sampling_params": {"max_tokens": 4}},
    }
    assert (await send(s.url, bad)).status_code == 500  # SGLang's TypeError, not a 400


async def test_fake_abort_returns_partial_output(server):
    fx = fixture("generate_aborted_response.json")
    exp = fx["response"]["json"]
    s = await server(
        script=scripted(_lp(exp["meta_info"]["output_token_logprobs"]) + [(5, -1.0)] * 10)
    )
    s.faults.inject("abort")
    assert_matches(exp, (await send(s.url, fx["request"])).json())


async def test_fake_abort_request_aborts_a_live_request(server):
    fx = fixture("abort_request.json")
    s = await server()
    s.faults.token_delay_s = 0.01
    gen = {
        "method": "POST",
        "path": "/generate",
        "json": {
            "rid": "traj-0001-turn-3",
            "input_ids": [1, 2],
            "sampling_params": {"max_new_tokens": 500},
        },
    }
    task = asyncio.create_task(send(s.url, gen))
    await until_decoding(s)
    r = await send(s.url, fx["request"])
    assert (r.status_code, r.content) == (200, b"")
    out = (await task).json()
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < out["meta_info"]["completion_tokens"] < 500


@pytest.mark.parametrize("version", ["0.5.2", "0.4.6"])
async def test_fake_legacy_shapes(server, version):
    fx = fixture("generate_legacy_versions.json")
    exp = fx["response_v0_5_2" if version == "0.5.2" else "response_v0_4_6_post5"]["json"]
    s = await server(
        script=scripted(_lp(exp["meta_info"]["output_token_logprobs"])), legacy=version
    )
    assert_matches(exp, (await send(s.url, fx["request"])).json())


async def test_fake_auth(server):
    fx = fixture("auth_unauthorized.json")
    s = await server(api_key="sk-123")
    r = await send(s.url, fx["request"])
    assert (r.status_code, r.json()) == (401, fx["response"]["json"])
    assert (await send(s.url, {"method": "GET", "path": "/health_generate"})).status_code == 200
    ok = await send(s.url, fx["request"], headers={"Authorization": "Bearer sk-123"})
    assert ok.status_code == 200


@pytest.mark.parametrize(
    "name",
    [
        "health_generate.json",
        "continue_generation.json",
        "pause_generation.json",
        "flush_cache.json",
        "model_info.json",
        "release_memory_occupation.json",
        "resume_memory_occupation.json",
        "update_weight_version.json",
        "v1_loads_core.json",
        "server_info.json",
        "update_weights_from_disk.json",
        "update_weights_from_tensor.json",
        "get_weights_by_name.json",
    ],
)
async def test_fake_control_endpoints(server, name, tmp_path):
    fx = fixture(name)
    req, res = copy.deepcopy(fx["request"]), fx["response"]

    class Weights:  # what /get_weights_by_name reads
        def get_weight(self, name: str) -> Any:
            import torch

            return torch.full((4, 4), 1.5)

    s = await server(model_path="Qwen/Qwen2.5-1.5B-Instruct", backend=Weights())
    if name == "update_weights_from_disk.json":
        req["json"]["model_path"] = str(tmp_path)
        bad = await send(s.url, {**req, "json": {**req["json"], "model_path": "/no/such/dir"}})
        assert bad.status_code == 400 and bad.json()["success"] is False
    if name == "update_weights_from_tensor.json":
        req["json"]["serialized_named_tensors"] = [base64.b64encode(b"opaque").decode()]
    r = await send(s.url, req)
    assert r.status_code == res["status"]
    if "body_text" in res:
        assert r.text == res["body_text"]
    elif "json_subset" in res:
        got = r.json()
        for k, v in res["json_subset"].items():
            assert k in got and isinstance(got[k], type(v)) or v is None, k
    else:
        assert_matches(res["json"], r.json(), loose=frozenset({"loads", "timestamp"}))
    if name == "v1_loads_core.json":
        assert list(r.json()["loads"][0]) == list(res["json"]["loads"][0])


async def test_fake_flush_is_refused_while_busy_and_release_is_fatal(server):
    s = await server()
    s.faults.token_delay_s = 0.01
    gen = {
        "method": "POST",
        "path": "/generate",
        "json": {"input_ids": [1], "sampling_params": {"max_new_tokens": 30}},
    }
    task = asyncio.create_task(send(s.url, gen))
    await asyncio.sleep(0.05)
    r = await send(s.url, {"method": "POST", "path": "/flush_cache"})
    assert (r.status_code, r.text) == (400, "Flush cache failed.\n")
    r = await send(s.url, {"method": "POST", "path": "/release_memory_occupation", "json": {}})
    assert r.status_code == 500
    assert (await send(s.url, {"method": "GET", "path": "/health_generate"})).status_code == 503
    await task


async def test_fake_pause_retract_blocks_and_updates_run_at_once(server, tmp_path):
    s = await server()
    s.faults.token_delay_s = 0.01
    gen = {
        "method": "POST",
        "path": "/generate",
        "json": {"input_ids": [1], "sampling_params": {"max_new_tokens": 20}},
    }
    running = asyncio.create_task(send(s.url, gen))
    await asyncio.sleep(0.05)
    r = await send(
        s.url, {"method": "POST", "path": "/pause_generation", "json": {"mode": "retract"}}
    )
    assert r.json()["status"] == "ok"
    new = asyncio.create_task(send(s.url, gen))  # blocks while paused
    r = await send(s.url, {"method": "POST", "path": "/flush_cache"})
    assert r.status_code == 400  # the retracted request is still waiting
    upd = {  # no flush: the parked request holds its KV (see the test below)
        "method": "POST",
        "path": "/update_weights_from_disk",
        "json": {"model_path": str(tmp_path), "weight_version": "2", "flush_cache": False},
    }
    r = await asyncio.wait_for(send(s.url, upd), 2)  # no writer-lock wait while paused
    assert r.json()["success"] is True
    await asyncio.sleep(0.1)
    assert not running.done() and not new.done()
    await send(s.url, {"method": "POST", "path": "/continue_generation", "json": {}})
    for t in (running, new):
        out = (await t).json()
        assert out["meta_info"]["finish_reason"]["type"] == "length"
        assert out["meta_info"]["weight_version"] == "2"


@pytest.mark.parametrize("retract_flush", [False, True])
async def test_fake_update_that_flushes_over_parked_requests_kills_the_scheduler(
    server, tmp_path, retract_flush
):
    """SGLang asserts that the cache flush after a weight update succeeds; stock SGLang cannot
    flush while a retract pause parks requests (sgl-project/sglang#33783), a build with
    sgl-project/sglang#33784 can. The update is applied either way (loaded before the flush)."""
    s = await server(retract_flush=retract_flush)
    s.faults.token_delay_s = 0.05  # 1 s: each httpx call here takes ~0.2 s
    gen = {
        "method": "POST",
        "path": "/generate",
        "json": {"input_ids": [1], "sampling_params": {"max_new_tokens": 20}},
    }
    running = asyncio.create_task(send(s.url, gen))
    await until_decoding(s)
    await send(s.url, {"method": "POST", "path": "/pause_generation", "json": {"mode": "retract"}})
    flushed = await send(s.url, {"method": "POST", "path": "/flush_cache"})
    upd = {
        "method": "POST",
        "path": "/update_weights_from_disk",
        "json": {"model_path": str(tmp_path), "weight_version": "2"},
    }
    r = await send(s.url, upd)
    if retract_flush:
        assert flushed.status_code == 200 and r.json()["success"] is True
        await send(s.url, {"method": "POST", "path": "/continue_generation", "json": {}})
        assert (await running).json()["meta_info"]["finish_reason"]["type"] == "length"
    else:
        assert flushed.status_code == 400 and r.status_code == 500
        assert "Cache flush failed" in r.json()["message"]
        assert (await send(s.url, {"method": "GET", "path": "/health_generate"})).status_code == 503
        assert (await running).json()["meta_info"]["finish_reason"]["type"] == "abort"


async def test_fake_stream_chunks_carry_the_version_that_decoded_them(server, tmp_path):
    """A streamed request paused (retract) across an update: the chunks of the tokens decoded
    before carry the old version, the others the new one; a streamed validation error is an
    error event in a 200 stream."""
    s = await server(weight_version="0")
    s.faults.token_delay_s = 0.05  # 1 s: each httpx call here takes ~0.2 s
    gen = {
        "method": "POST",
        "path": "/generate",
        "json": {
            "input_ids": [1],
            "sampling_params": {"max_new_tokens": 20},
            "return_logprob": True,
            "stream": True,
        },
    }
    running = asyncio.create_task(send(s.url, gen))
    await until_decoding(s)
    await send(s.url, {"method": "POST", "path": "/pause_generation", "json": {"mode": "retract"}})
    upd = {
        "method": "POST",
        "path": "/update_weights_from_disk",
        "json": {"model_path": str(tmp_path), "weight_version": "1", "flush_cache": False},
    }
    assert (await send(s.url, upd)).json()["success"] is True
    await send(s.url, {"method": "POST", "path": "/continue_generation", "json": {}})
    chunks = [json.loads(c[6:]) for c in (await running).text.split("\n\n")[:-2]]
    (before,) = s.pauses[0].values()
    assert 0 < before < 20
    versions = {
        c["meta_info"]["completion_tokens"]: c["meta_info"]["weight_version"] for c in chunks
    }
    assert versions == {n: "0" if n <= before else "1" for n in range(1, 21)}
    bad = copy.deepcopy(gen)
    bad["json"]["sampling_params"]["max_new_tokens"] = 5000
    r = await send(s.url, bad)
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    assert "maximum context length" in json.loads(r.text.split("\n\n")[0][6:])["error"]["message"]


async def test_fake_batch_stream_chunks_carry_an_index(server):
    s = await server(script=lambda p: [5, 6, 151645])
    req = {
        "method": "POST",
        "path": "/generate",
        "json": {
            "input_ids": [[1, 2], [3]],
            "sampling_params": {"max_new_tokens": 8},
            "stream": True,
        },
    }
    chunks = [
        json.loads(c[6:])
        for c in (await send(s.url, req)).text.split("\n\n")
        if c and c != "data: [DONE]"
    ]
    finals = {c["index"]: c for c in chunks if c["meta_info"]["finish_reason"]}
    assert sorted(finals) == [0, 1]
    assert all(
        f["output_ids"] == [5, 6, 151645] and f["text"] == "\x05\x06" for f in finals.values()
    )


async def test_fake_destroy_missing_group(server):
    fx = fixture("destroy_weights_update_group.json")
    s = await server()
    r = await send(s.url, fx["request"])
    assert (r.status_code, r.json()) == (
        400,
        {"success": False, "message": "The group to be destroyed does not exist."},
    )


async def test_fake_duplicate_inflight_rid_is_rejected(server):
    s = await server()
    s.faults.token_delay_s = 0.01
    gen = {
        "method": "POST",
        "path": "/generate",
        "json": {"rid": "r1", "input_ids": [1], "sampling_params": {"max_new_tokens": 20}},
    }
    task = asyncio.create_task(send(s.url, gen))
    await asyncio.sleep(0.05)
    r = await send(s.url, gen)
    assert r.status_code == 400 and "Duplicate request ID" in r.json()["error"]["message"]
    await task
    assert (await send(s.url, gen)).status_code == 200  # sequential reuse is fine


# ---------------------------------------------------------------------------------------------
# 2. The client's parser and request body against the fixtures


def test_parse_batch_and_n2_fixtures():
    b = parse_generate_response(fixture("generate_batch2_logprobs.json")["response"]["json"])
    assert [c.token_ids for c in b] == [[19, 151645], [13048, 1052, 0, 2585]]
    assert [c.finish_reason for c in b] == ["stop", "length"]
    assert b[0].logprobs == [-0.0213, -0.0009] and b[0].weight_version == "default"
    assert b[0].meta["matched"] == 151645
    n2 = parse_generate_response(fixture("generate_single_prompt_n2.json")["response"]["json"])
    assert [c.token_ids for c in n2] == [[19, 151645], [26972, 151645]]


def test_parse_legacy_versions_take_ids_from_logprobs():
    fx = fixture("generate_legacy_versions.json")
    for key, version in (("response_v0_5_2", "default"), ("response_v0_4_6_post5", "7")):
        (c,) = parse_generate_response(fx[key]["json"], weight_version="7")
        assert (c.token_ids, c.logprobs, c.finish_reason) == (
            [19, 151645],
            [-0.0213, -0.0009],
            "stop",
        )
        assert c.weight_version == version  # 0.4.6 has none: the client's own version is used


def test_parse_other_shapes():
    (c,) = parse_generate_response(fixture("generate_skip_tokenizer_init.json")["response"]["json"])
    assert c.token_ids == [19, 151645]
    (c,) = parse_generate_response(
        fixture("generate_top_logprobs_prompt_logprobs.json")["response"]["json"]
    )
    assert (c.token_ids, c.finish_reason) == ([151645, 198], "length")
    (c,) = parse_generate_response(fixture("generate_aborted_response.json")["response"]["json"])
    assert (c.token_ids, c.finish_reason) == ([13048, 1052], "abort") and "Aborted" in c.detail
    final = fixture("generate_stream_default.json")["response"]["events_parsed"][-2]
    (c,) = parse_generate_response(final)
    assert c.token_ids == [13048, 1052, 0] and c.finish_reason == "length"


def test_parse_rejects_untrustworthy_outputs():
    text_only = fixture("generate_single_text_default.json")["response"]["json"]
    with pytest.raises(EngineError, match="no output_token_logprobs"):
        parse_generate_response(text_only)
    bad = copy.deepcopy(fixture("generate_batch2_logprobs.json")["response"]["json"][0])
    bad["output_ids"] = [19, 5]
    with pytest.raises(EngineError, match="disagree"):
        parse_generate_response(bad)
    bad["output_ids"], bad["meta_info"]["finish_reason"] = [19, 151645], {"type": "weird"}
    with pytest.raises(EngineError, match="unknown SGLang finish_reason"):
        parse_generate_response(bad)
    bad["meta_info"]["finish_reason"], bad["meta_info"]["output_token_logprobs"][0][0] = (
        {"type": "stop"},
        None,
    )
    with pytest.raises(EngineError, match="malformed"):
        parse_generate_response(bad)


def test_error_messages_of_every_error_shape():
    ctx = fixture("generate_error_context_length.json")["response"]["json"]
    msg = error_message(json.dumps(ctx).encode())
    assert msg.startswith("Requested token count exceeds") and is_context_length_error(msg)
    val = fixture("generate_error_validation_422_as_400.json")["response"]["json"]
    assert not is_context_length_error(error_message(json.dumps(val).encode()))
    assert (
        error_message(json.dumps(fixture("auth_unauthorized.json")["response"]["json"]).encode())
        == "Unauthorized"
    )
    assert error_message(b"Flush cache failed.\n") == "Flush cache failed."


async def test_request_body_is_section_9_with_known_keys_only(server, engine):
    fx = fixture("generate_batch2_logprobs.json")["request"]["json"]
    s = await server(script=scripted([19, 151645]))
    e = engine([s.url])
    c = await e.generate([1, 2, 3], SamplingParams(max_new_tokens=4, stop_token_ids=(151645,)))
    assert (c.token_ids, c.finish_reason) == ([19, 151645], "stop")
    assert c.logprobs == [scripted_logprob(0, 19), scripted_logprob(1, 151645)]
    body = s.requests[-1]
    assert set(body) <= set(fx) and body["input_ids"] == [1, 2, 3] and "text" not in body
    assert body["sampling_params"] == fx["sampling_params"] | {"max_new_tokens": 4}
    assert body["return_logprob"] is True and body["stream"] is False
    await e.generate([1], SamplingParams(max_new_tokens=4, top_k=0, temperature=0.0))
    assert s.requests[-1]["rid"] != body["rid"]  # a fresh rid per request
    assert s.requests[-1]["sampling_params"]["top_k"] == -1  # SGLang's "no top-k"
    assert s.requests[-1]["sampling_params"]["temperature"] == 0.0  # greedy


async def test_seed_needs_a_new_enough_server(server, engine):
    s = await server()
    e = engine([s.url])
    await e.wait_ready()
    await e.generate([1], SamplingParams(max_new_tokens=2, seed=7))
    assert s.requests[-1]["sampling_params"]["sampling_seed"] == 7
    old = await server(legacy="0.5.2")
    e2 = engine([old.url])
    await e2.wait_ready()
    with pytest.raises(EngineError, match="0.5.9"):
        await e2.generate([1], SamplingParams(max_new_tokens=2, seed=7))
    # training and eval seed every request: they are refused at start-up, not once per trajectory
    await e.wait_ready(seeded=True)
    with pytest.raises(EngineError, match=f"{old.url}.*0.5.2"):
        await e2.wait_ready(seeded=True)


# ---------------------------------------------------------------------------------------------
# 3. Client behaviour


async def test_finish_reasons_stop_length_abort(server, engine):
    s = await server(script=lambda p: [5, 6, 7, 151645] if p[-1] == 1 else [5, 6, 7, 8])
    e = engine([s.url])
    assert (await e.generate([1], SamplingParams(max_new_tokens=9))).finish_reason == "stop"
    c = await e.generate([2], SamplingParams(max_new_tokens=3))
    assert (c.token_ids, c.finish_reason) == ([5, 6, 7], "length")
    c = await e.generate([2], SamplingParams(max_new_tokens=9, stop_token_ids=(7,)))
    assert (c.token_ids, c.finish_reason) == ([5, 6, 7], "stop")
    s.faults.inject("abort")  # an abort we did not cause is reported, not retried
    c = await e.generate([2], SamplingParams(max_new_tokens=9))
    assert (c.token_ids, c.finish_reason) == ([5, 6], "abort") and "Aborted" in c.detail


async def test_context_length_400_becomes_a_length_finish(server, engine):
    s = await server(context_length=64)
    e = engine([s.url])
    c = await e.generate(list(range(64)), SamplingParams(max_new_tokens=10))  # no room left at all
    assert (c.token_ids, c.finish_reason) == ([], "length")
    assert "longer than the model's context length (64 tokens)" in c.detail  # the server's message
    s.faults.inject("context")
    assert (await e.generate([1], SamplingParams(max_new_tokens=2))).finish_reason == "length"


async def test_a_turn_may_ask_for_the_rest_of_the_window(server, engine):
    """The rollout asks for `window - prompt` tokens (the local engine's rule); SGLang refuses
    prompt + max_new_tokens >= context_length, so the client clamps to one less. It learns the
    window at wait_ready() from /server_info, or, where SGLang reports none there (its default
    without --context-length), from the first 400, which names it."""
    prompt = list(range(100, 156))  # 56 tokens in a window of 64: the rollout's budget is 8
    s = await server(context_length=64, script=lambda p: [65] * 10)
    e = engine([s.url])
    await e.wait_ready()
    c = await e.generate(prompt, SamplingParams(max_new_tokens=8))
    assert (len(c.token_ids), c.finish_reason) == (7, "length")
    assert [r["sampling_params"]["max_new_tokens"] for r in s.requests] == [7]

    quiet = await server(context_length=64, script=lambda p: [65] * 10)
    server_info = quiet._server_info

    async def like_sglang(*args: Any) -> tuple[int, Any]:
        status, info = await server_info(*args)
        return status, {**info, "context_length": None}

    quiet._server_info = like_sglang
    e = engine([quiet.url])
    await e.wait_ready()
    for _ in range(2):
        c = await e.generate(prompt, SamplingParams(max_new_tokens=8))
        assert (len(c.token_ids), c.finish_reason, c.detail) == (7, "length", "")
    assert [r["sampling_params"]["max_new_tokens"] for r in quiet.requests] == [8, 7, 7]


async def test_context_length_is_clamped_client_side(server, engine):
    s = await server(context_length=64)
    e = engine([s.url], context_length=64)
    c = await e.generate(list(range(60)), SamplingParams(max_new_tokens=10))
    assert s.requests[-1]["sampling_params"]["max_new_tokens"] == 3  # 60 + 3 < 64
    assert c.finish_reason == "length" and len(c.token_ids) == 3
    n = len(s.requests)
    c = await e.generate(list(range(63)), SamplingParams(max_new_tokens=10))
    assert c.finish_reason == "length" and "no room" in c.detail and len(s.requests) == n


@pytest.mark.parametrize("fault", ["503", "500", "drop"])
async def test_transient_failures_are_retried(server, engine, fault):
    s = await server(script=scripted([3, 151645]))
    e = engine([s.url])
    s.faults.inject(fault, fault)
    c = await e.generate([1], SamplingParams(max_new_tokens=4))
    assert c.token_ids == [3, 151645]
    rids = [r["rid"] for r in s.requests]
    assert len(rids) == 3 and len(set(rids)) == 3  # one fresh rid per attempt


async def test_retries_run_out_with_an_engine_error(server, engine):
    s = await server()
    e = engine([s.url], max_retries=2)
    s.faults.inject(*["503"] * 5)
    with pytest.raises(EngineError, match="after 3 attempts.*HTTP 503"):
        await e.generate([1], SamplingParams(max_new_tokens=4))


async def test_a_hung_server_fails_at_the_deadline_not_later(server, engine):
    s = await server()
    e = engine([s.url], request_timeout_s=0.5)
    s.faults.inject("hang")
    t0 = time.monotonic()
    with pytest.raises(EngineError, match="deadline"):
        await e.generate([1], SamplingParams(max_new_tokens=4))
    assert time.monotonic() - t0 < 1.5


async def test_bad_request_is_not_retried(server, engine):
    s = await server()
    e = engine([s.url])
    s.faults.inject("400")
    with pytest.raises(EngineError, match="HTTP 400: injected bad request"):
        await e.generate([1], SamplingParams(max_new_tokens=4))
    assert len(s.requests) == 1


async def test_api_key_is_sent_and_a_wrong_key_is_a_clear_error(server, engine):
    s = await server(api_key="sk-123")
    good = engine([s.url], api_key="sk-123")
    assert (await good.generate([1], SamplingParams(max_new_tokens=2))).finish_reason == "length"
    bad = engine([s.url], api_key="nope")
    with pytest.raises(EngineError, match="401.*api-key"):
        await bad.generate([1], SamplingParams(max_new_tokens=2))


async def test_api_key_comes_from_the_environment(server, monkeypatch):
    s = await server(api_key="sk-env")
    monkeypatch.setenv("MY_SGLANG_KEY", "sk-env")
    cfg = SGLangConfig(urls=[s.url], api_key_env="MY_SGLANG_KEY")
    assert "sk-env" not in cfg.model_dump_json()
    async with SGLangEngine.from_config(cfg) as e:
        assert (await e.generate([1], SamplingParams(max_new_tokens=2))).finish_reason == "length"


def test_config_rejects_unknown_keys_and_bad_urls():
    with pytest.raises(ValueError, match="max_inflight"):
        SGLangConfig(urls=["http://a:1"], max_inflight=3)
    with pytest.raises(ValueError, match="http://"):
        SGLangConfig(urls=["a:1"])
    with pytest.raises(ValueError, match="duplicate"):
        SGLangConfig(urls=["http://a:1", "http://a:1/"])


async def test_dead_server_among_several_is_taken_out(server, engine):
    live = await server()
    dead = await server()
    dead_url = dead.url
    await dead.stop()
    e = engine([dead_url, live.url])
    outs = await asyncio.gather(
        *(e.generate([1], SamplingParams(max_new_tokens=2)) for _ in range(20))
    )
    assert all(c.finish_reason == "length" for c in outs)
    st = {s.url: s for s in e.servers()}
    assert not st[dead_url].healthy and st[dead_url].completed == 0
    assert st[live.url].completed == 20


async def test_server_comes_back_after_reprobe(server, engine):
    s = await server()
    url, port = s.url, s.port
    e = engine([url], request_timeout_s=5)
    await s.stop()
    task = asyncio.create_task(e.generate([1], SamplingParams(max_new_tokens=2)))
    await asyncio.sleep(0.3)
    assert not task.done() and not e.servers()[0].healthy
    await s.start(port=port)  # the same server restarts
    c = await task
    assert c.finish_reason == "length" and e.servers()[0].healthy


async def test_waiting_requests_sleep_while_a_health_probe_hangs(server, engine):
    """A server out of rotation whose /health_generate takes long (a hung scheduler): requests
    waiting for it sleep until the probe ends instead of polling, and a probe that raises still
    wakes them."""
    s = await server()
    answer = asyncio.Event()
    health = s._health

    async def slow_health(*args: Any) -> Any:
        await answer.wait()
        return await health(*args)

    s._health = slow_health
    e = engine([s.url], request_timeout_s=10)
    pool = e._pool
    sleeps = 0

    class CountedWaiters(list):
        def append(self, fut: Any) -> None:
            nonlocal sleeps
            sleeps += 1
            super().append(fut)

    pool._waiters = CountedWaiters()
    pool._mark_unhealthy(pool.servers[0], "HTTP 503: simulated")
    tasks = [
        asyncio.create_task(e.generate([1], SamplingParams(max_new_tokens=2))) for _ in range(20)
    ]
    await asyncio.sleep(0.5)
    assert sleeps <= 2 * len(tasks)  # polling every millisecond made thousands
    answer.set()
    assert all(c.finish_reason == "length" for c in await asyncio.gather(*tasks))

    resync = pool._resync
    crashes: list[str] = []

    async def crashing_once(srv: Any) -> str:
        if not crashes:
            crashes.append(srv.url)
            raise RuntimeError("resync crashed")
        return await resync(srv)

    pool._resync = crashing_once
    pool._mark_unhealthy(pool.servers[0], "HTTP 503: simulated")
    t0 = time.monotonic()
    assert (await e.generate([1], SamplingParams(max_new_tokens=2))).finish_reason == "length"
    assert crashes and time.monotonic() - t0 < 2  # woken by the crashed probe, not the deadline


async def test_least_outstanding_balancing(server, engine):
    a, b = await server(), await server()
    a.faults.generate_delay_s = 0.2  # a is slow: it keeps requests outstanding longer
    e = engine([a.url, b.url])
    await asyncio.gather(*(e.generate([1], SamplingParams(max_new_tokens=2)) for _ in range(4)))
    assert (len(a.requests), len(b.requests)) == (2, 2)  # equal load splits evenly

    async def stream_of(n: int) -> None:
        for _ in range(n):
            await e.generate([1], SamplingParams(max_new_tokens=2))

    await asyncio.gather(*(stream_of(10) for _ in range(4)))
    assert len(b.requests) - 2 > 3 * (len(a.requests) - 2)  # the fast server took most


async def test_inflight_per_server_is_bounded(server, engine):
    s = await server()
    s.faults.generate_delay_s = 0.05
    e = engine([s.url], max_inflight_per_server=3)
    outs = await asyncio.gather(
        *(e.generate([1], SamplingParams(max_new_tokens=2)) for _ in range(12))
    )
    assert len(outs) == 12 and s.peak_inflight == 3


async def test_no_server_at_all_fails_within_the_deadline(engine):
    e = engine(["http://127.0.0.1:9"], request_timeout_s=0.5)
    t0 = time.monotonic()
    with pytest.raises(EngineError):
        await e.generate([1], SamplingParams(max_new_tokens=2))
    assert time.monotonic() - t0 < 1.5


async def test_wait_ready(server, engine):
    s = await server(start_delay_s=0.3)
    e = engine([s.url])
    t0 = time.monotonic()
    await e.wait_ready(timeout_s=5)
    # Ready only once the server's delay has passed, counted from its own start: the delay partly
    # runs out while the engine is made (a lower bound from t0 failed once, at 0.248 s, under load).
    assert time.monotonic() - s._started_at >= 0.3
    assert time.monotonic() - t0 < 3
    assert e.servers()[0].version == "0.5.15.post1"


async def test_wait_ready_timeout_names_the_server(server, engine):
    s = await server(start_delay_s=100)
    e = engine([s.url, "http://127.0.0.1:9"])
    with pytest.raises(EngineError, match=r"not ready after 0s.*HTTP 503.*127\.0\.0\.1:9: Connect"):
        await e.wait_ready(timeout_s=0.2)


async def test_update_weights_from_disk_sequence(server, engine, tmp_path):
    s = await server()
    e = engine([s.url])
    await e.update_weights_from_disk(tmp_path, version="3")
    assert [p for p, _ in s.calls] == [
        "/pause_generation",
        "/flush_cache",
        "/update_weights_from_disk",
        "/continue_generation",
    ]
    assert s.calls[2][1] == {
        "model_path": str(tmp_path),
        "weight_version": "3",
        "flush_cache": True,
    }
    assert (await e.generate([1], SamplingParams(max_new_tokens=2))).weight_version == "3"
    assert await e.weight_versions() == {s.url: "3"} and s.model_path == str(tmp_path)


async def test_failed_update_still_continues_generation(server, engine):
    s = await server()
    e = engine([s.url])
    with pytest.raises(EngineError, match="model_path not found"):
        await e.update_weights_from_disk("/no/such/dir", version="3")
    assert s.calls[-1][0] == "/continue_generation" and not s.paused
    assert (await e.generate([1], SamplingParams(max_new_tokens=2))).weight_version == "default"
    with pytest.raises(TypeError, match="WeightSync"):
        await e.update_weights({"w": 1}, version="4")


async def test_requests_in_flight_during_an_update_are_resubmitted(server, engine, tmp_path):
    s = await server()
    s.faults.token_delay_s = 0.01
    e = engine([s.url])
    task = asyncio.create_task(e.generate([1], SamplingParams(max_new_tokens=30)))
    await asyncio.sleep(0.1)
    await e.update_weights_from_disk(tmp_path, version="5")
    c = await task
    assert (c.finish_reason, c.weight_version, len(c.token_ids)) == ("length", "5", 30)
    assert len(s.requests) == 2  # aborted by the pause, then sent again


async def test_score_reads_prompt_logprobs(server, engine):
    s = await server()
    e = engine([s.url])
    lps = await e.score([7, 8, 9], [10, 11], 1.0)
    body = s.requests[-1]
    assert body["logprob_start_len"] == 2 and body["input_ids"] == [7, 8, 9, 10, 11]
    assert lps == pytest.approx([-0.5, -0.5 - 0.37])  # the fake's values for positions 3 and 4


class ScriptedModel:
    """The same scripted 'model' behind the engine directly and behind the fake server."""

    def __init__(self) -> None:
        self.turn = {0: [40, 41, 151645], 1: [50, 151645], 2: [60, 61, 62, 151645]}

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
        out = self.turn[prompt_ids.count(77091) - 1][: params.max_new_tokens]  # one per turn
        stop = out[-1] in params.stop_token_ids
        return Completion(out, [-0.01 * (t % 9) - 0.1 for t in out], "stop" if stop else "length")


async def _episode(engine: Any) -> tuple[list[int], list[int], list[float], list[str]]:
    """A token-in/token-out multi-turn loop: prompt + sampled ids (mask 1) + tool suffix (mask
    0)."""
    ids, mask, lps, reasons = [151644, 872, 198, 30, 151644, 77091, 198], [0] * 7, [0.0] * 7, []
    params = SamplingParams(max_new_tokens=8, stop_token_ids=(151645,))
    for _ in range(3):
        c = await engine.generate(ids, params)
        ids += c.token_ids
        mask += [1] * len(c.token_ids)
        lps += c.logprobs
        reasons.append(c.finish_reason)
        suffix = [198, 151644, 872, 198, 99, 151645, 198, 151644, 77091, 198]
        ids, mask, lps = ids + suffix, mask + [0] * len(suffix), lps + [0.0] * len(suffix)
    return ids, mask, lps, reasons


async def test_multi_turn_episode_matches_the_backend_exactly(server, engine):
    direct = await _episode(ScriptedModel())
    s = await server(backend=ScriptedModel())
    via_http = await _episode(engine([s.url]))
    assert via_http == direct
    assert direct[3] == ["stop", "stop", "stop"]


# ---------------------------------------------------------------------------------------------
# The launcher


def test_launcher_starts_waits_and_stops_a_server(tmp_path):
    from agentgrpo.engine.sglang.launch import SGLangServer

    with SGLangServer(
        "fake-model",
        port=0,
        module="tests.fake_sglang",
        ready_timeout_s=60,
        extra_args=["--start-delay", "0.3"],
        log_path=tmp_path / "server.log",
    ) as srv:
        r = httpx.get(f"{srv.url}/model_info", timeout=5)
        assert r.json()["model_path"] == "fake-model"
        proc = srv.process
    assert proc.poll() is not None  # stopped with the block


def test_launcher_command_has_rl_settings_and_respects_overrides():
    from agentgrpo.engine.sglang.launch import build_command, masked

    cmd = build_command("Qwen/Qwen2.5-0.5B-Instruct", ["--port=31000", "--tp", "2"], api_key="sk-1")
    assert cmd[:3] == [sys.executable, "-m", "sglang.launch_server"]
    assert cmd[cmd.index("--model-path") + 1] == "Qwen/Qwen2.5-0.5B-Instruct"
    assert "--port" not in cmd and "--port=31000" in cmd  # the user's value wins
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"  # loopback unless asked otherwise
    assert cmd[-2:] == ["--tp", "2"] and cmd[cmd.index("--api-key") + 1] == "sk-1"
    assert "sk-1" not in masked(cmd) and "--api-key ***" in masked(cmd)


def test_serve_sglang_main_runs_until_sigterm(tmp_path):
    import subprocess

    root = Path(__file__).resolve().parents[1]
    p = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from agentgrpo.engine.sglang.launch import main; "
            "sys.exit(main(sys.argv[1:]))",
            "fake-model",
            "--port",
            "0",
            "--ready-timeout",
            "60",
            "--module",
            "tests.fake_sglang",
            "--log-file",
            str(tmp_path / "log"),
        ],
        cwd=root,
        stdout=subprocess.PIPE,
        text=True,
    )
    line = p.stdout.readline()
    assert line.startswith("SGLang ready at http://127.0.0.1:"), line
    url = line.split()[-1]
    assert httpx.get(f"{url}/health_generate", timeout=5).status_code == 200
    p.send_signal(signal.SIGTERM)
    assert p.wait(30) == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health_generate", timeout=5)  # the server went with it


def test_launcher_reports_a_server_that_dies_during_startup(tmp_path):
    from agentgrpo.engine.sglang.launch import SGLangServer

    with pytest.raises(RuntimeError, match="exited with code"):
        with SGLangServer(
            "m",
            port=0,
            module="tests.no_such_module",
            ready_timeout_s=30,
            log_path=tmp_path / "server.log",
        ):
            pass


async def test_update_skips_a_dead_server_which_catches_up_when_it_returns(
    server, engine, tmp_path
):
    a, b = await server(), await server()
    e = engine([a.url, b.url], probe_interval_s=0.02)
    port = b.port
    await b.stop()
    await asyncio.gather(*(e.generate([1], SamplingParams(max_new_tokens=2)) for _ in range(4)))
    assert not {s.url: s for s in e.servers()}[b.url].healthy
    await e.update_weights_from_disk(tmp_path, version="3")  # goes to a only
    assert a.weight_version == "3"
    restarted = FakeSGLang(vocab=VOCAB)  # b comes back with its initial weights
    await restarted.start(port=port)
    try:
        for _ in range(50):
            await asyncio.gather(
                *(e.generate([1], SamplingParams(max_new_tokens=2)) for _ in range(4))
            )
            if restarted.requests:
                break
            await asyncio.sleep(0.02)
        assert (
            "/update_weights_from_disk",
            {"model_path": str(tmp_path), "weight_version": "3", "flush_cache": True},
        ) in restarted.calls
        c = await e.generate([1], SamplingParams(max_new_tokens=2))
        assert restarted.weight_version == "3" and c.weight_version == "3"
    finally:
        await restarted.stop()


async def test_a_returning_server_that_cannot_catch_up_stays_out(server, engine, tmp_path):
    a, b = await server(), await server()
    e = engine([a.url, b.url], probe_interval_s=0.02)
    port = b.port
    await b.stop()
    await asyncio.gather(*(e.generate([1], SamplingParams(max_new_tokens=2)) for _ in range(4)))
    ckpt = tmp_path / "step_7"
    ckpt.mkdir()
    await e.update_weights_from_disk(ckpt, version="7")
    ckpt.rmdir()  # the checkpoint is gone: replaying it on b fails
    restarted = FakeSGLang(vocab=VOCAB)
    await restarted.start(port=port)
    try:
        for _ in range(10):
            await e.generate([1], SamplingParams(max_new_tokens=2))
            await asyncio.sleep(0.03)
        st = e.servers()[1]
        assert not st.healthy and "could not bring it to weight version 7" in st.last_error
        assert not restarted.requests and restarted.weight_version == "default"
    finally:
        await restarted.stop()


async def test_a_server_returning_during_an_update_gets_the_new_weights(server, engine, tmp_path):
    """b comes back while an update that it is not part of runs: it is checked against the new
    version once the update is done (and caught up), not against the one being replaced."""
    a, b = await server(), await server()
    update = a._update_from_disk

    async def slow_update(*args: Any) -> Any:  # a's load takes a while
        await asyncio.sleep(0.5)
        return await update(*args)

    a._update_from_disk = slow_update
    e = engine([a.url, b.url])
    (tmp_path / "1").mkdir()
    (tmp_path / "2").mkdir()
    await e.update_weights_from_disk(tmp_path / "1", version="1")
    e._pool._mark_unhealthy(e._pool.servers[1], "HTTP 503: simulated")  # a blip in the rollouts
    health = b._health

    async def late_health(*args: Any) -> Any:  # b's probe answers while the update runs
        await asyncio.sleep(0.2)
        return await health(*args)

    b._health = late_health
    await e.generate([1], SamplingParams(max_new_tokens=2))  # served by a; starts b's probe
    await e.update_weights_from_disk(tmp_path / "2", version="2")  # to a only: b is out
    for _ in range(100):
        if e.servers()[1].healthy:
            break
        await asyncio.sleep(0.02)
    assert e.servers()[1].healthy and b.weight_version == "2"
    assert await e.weight_versions() == {a.url: "2", b.url: "2"}


def test_a_training_run_waits_for_its_servers_before_the_first_push(tmp_path, tiny_model_dir):
    """train() readies the engine first: a server still loading is waited for, up to
    ready_timeout_s, then named; no weights are pushed to it meanwhile."""
    from agentgrpo.cli import main

    log = tmp_path / "calls.jsonl"
    with FakeSGLangProcess("--start-delay", "100", "--calls-log", str(log)) as server:
        with pytest.raises(EngineError, match=r"not ready after 3s.*HTTP 503"):
            main(
                [
                    "train",
                    "examples/calculator.yaml",
                    f"output_dir={tmp_path / 'run'}",
                    "train.steps=1",
                    f"model.path={tiny_model_dir}",
                    "rollout.group_size=2",
                    "rollout.tasks_per_step=1",
                    "rollout.max_new_tokens=4",
                    "rollout.max_tokens=16",
                    "log.progress=false",
                    "engine.kind=sglang",
                    f"engine.sglang.urls=[{server.url}]",
                    "engine.sglang.ready_timeout_s=3",
                    "engine.sglang.ready_poll_s=0.1",
                    f"weight_sync.shared_dir={tmp_path / 'w'}",
                ]
            )
    paths = [json.loads(line)["path"] for line in log.read_text().splitlines()]
    assert paths and set(paths) == {"/health_generate"}


async def test_a_cancelled_request_frees_its_slot(server, engine):
    s = await server()
    s.faults.generate_delay_s = 5.0
    e = engine([s.url], max_inflight_per_server=2)
    tasks = [
        asyncio.create_task(e.generate([1], SamplingParams(max_new_tokens=2))) for _ in range(3)
    ]
    await asyncio.sleep(0.1)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert e.servers()[0].outstanding == 0
    s.faults.generate_delay_s = 0.0
    outs = await asyncio.gather(
        *(e.generate([1], SamplingParams(max_new_tokens=2)) for _ in range(2))
    )
    assert [c.finish_reason for c in outs] == ["length", "length"]
