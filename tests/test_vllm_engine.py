"""`VLLMEngine` against a small fake (tests/fake_vllm.py): the wire format, the refusals at
`wait_ready`, and the request sequences of each weight update, the NCCL one included (it needs
GPUs on both ends to run for real). The real server is in tests/test_vllm_server.py."""

from __future__ import annotations

import pytest
import torch

from agentgrpo.engine.base import EngineError, SamplingParams
from agentgrpo.engine.config import EngineConfig
from agentgrpo.engine.vllm.client import VLLMEngine
from agentgrpo.engine.vllm.protocol import (
    context_length_of,
    parse_generate_response,
    version_runs,
)
from agentgrpo.engine.weight_sync import WeightSync, WeightSyncConfig
from tests.fake_vllm import FakeVLLM


@pytest.fixture
async def fakes():
    started: list[FakeVLLM] = []

    async def make(**kw) -> FakeVLLM:
        started.append(await FakeVLLM(**kw).start())
        return started[-1]

    yield make
    for f in started:
        await f.stop()


def choice(ids, lps, spans=None, finish="stop"):
    content = [{"token_id": t, "logprob": lp} for t, lp in zip(ids, lps)]
    c = {"token_ids": ids, "logprobs": {"content": content}, "finish_reason": finish}
    return {"choices": [{**c, "weight_versions": spans, "stop_reason": None}]}


def test_answers_become_completions_with_their_version_split():
    spans = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 3}]
    c = parse_generate_response(choice([5, 6, 7], [-0.1, -0.2, -0.3], spans))
    assert (c.token_ids, c.logprobs, c.finish_reason) == ([5, 6, 7], [-0.1, -0.2, -0.3], "stop")
    assert c.version_runs == [(2, "3"), (1, "4")] and c.weight_version == "4"
    one = parse_generate_response(choice([5], [-0.1], [{"version": "3", "start": 0, "end": 1}]))
    assert one.version_runs is None and one.weight_version == "3"
    assert parse_generate_response(choice([5], [-0.1]), weight_version="9").weight_version == "9"
    with pytest.raises(EngineError, match="disagree"):
        bad = choice([5, 6], [-0.1, -0.2])
        bad["choices"][0]["token_ids"] = [5, 7]
        parse_generate_response(bad)
    with pytest.raises(EngineError, match="cover 1 of 2"):
        version_runs([{"version": "1", "start": 0, "end": 1}], 2, None)
    with pytest.raises(EngineError, match="finish_reason"):
        parse_generate_response(choice([5], [-0.1], finish="error"))
    msg = "The decoder prompt (length 2049) is longer than the maximum model length of 2048."
    assert context_length_of(msg) == 2048
    assert context_length_of("This model's maximum context length is 512 tokens.") == 512


def test_config_kind_vllm_needs_its_block_and_refuses_local_settings():
    cfg = EngineConfig(kind="vllm", vllm={"urls": ["http://127.0.0.1:8000/"]})
    assert cfg.vllm.urls == ["http://127.0.0.1:8000"] and cfg.vllm.api_key_env == "VLLM_API_KEY"
    with pytest.raises(ValueError, match="no engine.vllm block"):
        EngineConfig(kind="vllm")
    with pytest.raises(ValueError, match="engine.vllm is set but engine.kind is local"):
        EngineConfig(vllm={"urls": ["http://a:1"]})
    with pytest.raises(ValueError, match="engine.max_batch_size=4 configure the local engine"):
        EngineConfig(kind="vllm", vllm={"urls": ["http://a:1"]}, max_batch_size=4)


async def test_wait_ready_refuses_a_server_not_configured_for_rl(fakes):
    raw = await fakes(logprobs_mode="raw_logprobs")
    e = VLLMEngine([raw.url], ready_timeout_s=5)
    with pytest.raises(EngineError, match="--logprobs-mode processed_logprobs"):
        await e.wait_ready()
    await e.aclose()
    closed = await fakes(scale_out=False)
    e = VLLMEngine([closed.url], ready_timeout_s=5)
    with pytest.raises(EngineError, match="--enable-scale-out"):
        await e.wait_ready()
    await e.aclose()


async def test_generate_clamps_to_the_window_and_sends_token_ids(fakes):
    f = await fakes(max_model_len=10)
    e = VLLMEngine([f.url])
    await e.wait_ready()
    c = await e.generate([1, 2, 3], SamplingParams(max_new_tokens=50, temperature=0.7, seed=4))
    assert len(c.token_ids) == 7  # 3 + 7 == the window: vLLM admits prompt + max_tokens == it
    body = [b for p, b in f.calls if p == "/inference/v1/generate"][-1]
    assert body["token_ids"] == [1, 2, 3] and body["request_id"]  # a fresh id per attempt
    sp = body["sampling_params"]
    assert (sp["max_tokens"], sp["temperature"], sp["seed"], sp["logprobs"]) == (7, 0.7, 4, 0)
    assert sp["detokenize"] is False
    full = await e.generate(list(range(10)), SamplingParams(max_new_tokens=5))
    assert full.token_ids == [] and "no room" in full.detail
    e._context_length = None  # learned again from the 400, which names it
    c = await e.generate(list(range(12)), SamplingParams(max_new_tokens=5))
    assert c.token_ids == [] and e._context_length == 10
    assert await e.score([1, 2], [3, 4]) == [-1.0, -1.0]
    await e.aclose()


async def test_disk_update_pauses_reloads_labels_and_resumes(fakes, tmp_path):
    a, b = await fakes(), await fakes()
    e = VLLMEngine([a.url, b.url])
    await e.wait_ready()
    with pytest.raises(EngineError, match="no config.json"):  # a missing dir kills vLLM's engine
        await e.update_weights_from_disk(tmp_path / "missing", version="1")
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    await e.update_weights_from_disk(tmp_path / "ckpt", version="1")
    for f in (a, b):
        assert f.paths() == [
            "/pause?mode=abort",
            "/collective_rpc",
            "/update_weight_version",
            "/resume",
        ]
        rpc = dict(f.calls)["/collective_rpc"]
        assert rpc == {
            "method": "reload_weights",
            "kwargs": {"weights_path": str(tmp_path / "ckpt")},
        }
    assert await e.weight_versions() == {a.url: "1", b.url: "1"}
    await e.aclose()


async def test_partial_rollouts_keep_requests_and_drop_the_old_kv(fakes, tmp_path):
    f = await fakes()
    e = VLLMEngine([f.url], partial_rollouts=True)
    await e.wait_ready()
    (tmp_path / "config.json").write_text("{}")
    await e.update_weights_from_disk(tmp_path, version="2")
    assert f.paths() == [
        "/pause?mode=keep",
        "/collective_rpc",
        "/update_weight_version",
        "/reset_prefix_cache?reset_running_requests=true",
        "/resume",
    ]
    await e.aclose()


async def test_nccl_push_follows_vllms_weight_transfer_api(fakes, monkeypatch):
    """WeightSync's distributed method on vLLM: the group is vLLM's (trainer_join, replaced here:
    it needs GPUs), every server joins with its rank offset, and a push is start, one update per
    bucket, finish with the version, inside a pause, while the trainer broadcasts each bucket."""
    a, b = await fakes(tp_size=1), await fakes(tp_size=2)
    e = VLLMEngine([a.url, b.url])
    await e.wait_ready()
    joined, sent = [], []
    join = staticmethod(lambda *a, **k: joined.append((a, k)) or "pg")
    monkeypatch.setattr(VLLMEngine, "trainer_join", join)
    monkeypatch.setattr(VLLMEngine, "trainer_broadcast", staticmethod(lambda *a: sent.append(a)))
    monkeypatch.setattr(WeightSync, "_broadcast_device", lambda self: torch.device("cpu"))
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    cfg = WeightSyncConfig(method="distributed", probe_every=0, bucket_mb=100 / 2**20)
    sync = WeightSync(e, cfg)
    await sync.push(model, 1)
    assert joined[0][1]["world_size"] == 4 and joined[0][1]["rank"] == 0
    inits = [dict(f.calls)["/init_weight_transfer_engine"]["init_info"] for f in (a, b)]
    assert [i["rank_offset"] for i in inits] == [1, 2] and {i["world_size"] for i in inits} == {4}
    assert all(i["packed"] is False for i in inits)  # one broadcast per tensor, as sent
    n_buckets = len(sent)
    assert n_buckets > 1 and sum(len(ts) for _, ts in sent) == 4
    for f in (a, b):
        paths = f.paths()
        assert paths[0] == "/init_weight_transfer_engine" and paths[1] == "/pause?mode=abort"
        assert paths[2:] == (
            ["/start_weight_update"]
            + ["/update_weights"] * n_buckets
            + ["/finish_weight_update", "/resume"]
        )
        updates = [body["update_info"] for p, body in f.calls if p == "/update_weights"]
        assert [n for u in updates for n in u["names"]] == [
            n for n, _ in model.state_dict().items()
        ]
        assert dict(f.calls)["/finish_weight_update"] == {"weight_version": "1"}
    assert await e.weight_versions() == {a.url: "1", b.url: "1"}
    await sync.close()
    assert a.paths()[-1] == "/shutdown_weight_transfer_engine"
    await e.aclose()


def test_launcher_adds_what_rl_needs_unless_given(monkeypatch):
    from agentgrpo.engine.vllm import launch

    monkeypatch.setattr(launch, "_has_cuda", lambda: False)
    srv = launch.VLLMServer("m", port=8001, python="/venv/bin/python")
    cmd = srv.command
    assert cmd[:5] == [
        "/venv/bin/python",
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        "m",
    ]
    assert cmd[cmd.index("--logprobs-mode") + 1] == "processed_logprobs"
    assert "--enable-scale-out" in cmd and "--enforce-eager" in cmd  # no CUDA: eager
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and srv.url == "http://127.0.0.1:8001"
    env = srv.server_env({"VLLM_CPU_KVCACHE_SPACE": "4"})
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["VLLM_TARGET_DEVICE"] == "cpu"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "4"  # the user's value stays
    mine = launch.VLLMServer("m", port=8001, extra_args=["--logprobs-mode=raw_logprobs"]).command
    assert "processed_logprobs" not in mine and mine[-1] == "--logprobs-mode=raw_logprobs"
