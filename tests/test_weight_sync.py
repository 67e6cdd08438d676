"""WeightSync: in-process, disk (against the fake SGLang server) and distributed (gloo, 2
processes).

The learner is a tiny random Llama; the "engine" side runs a copy of it (`TinyModelBackend`), so a
push is only verified when the engine really computes with the learner's new weights.
"""

from __future__ import annotations

import asyncio
import copy
import json
import math
import re
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from agentgrpo.engine.base import EngineError, SamplingParams
from agentgrpo.engine.sglang.client import SGLangEngine
from agentgrpo.engine.weight_sync import (
    ProbeMismatchError,
    WeightSync,
    WeightSyncConfig,
    WeightSyncError,
    sequence_logprobs,
)
from tests.fake_sglang import FakeSGLang, FakeSGLangProcess, TinyModelBackend

FIXTURES = Path(__file__).resolve().parent / "data" / "sglang"
EOS = 127


def tiny_model(seed: int = 0) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        eos_token_id=EOS,
        bos_token_id=1,
    )
    return LlamaForCausalLM(cfg).eval()


def train_step(model: torch.nn.Module, scale: float = 0.05) -> None:
    """Stand-in for an optimizer step: move every weight a little."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn_like(p))


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


class ConstantLM(torch.nn.Module):
    """Logits [0, ln 3] at every position: p = [1/4, 3/4] whatever the input."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([0.0, math.log(3.0)]))

    def forward(self, ids: torch.Tensor) -> Any:
        class Out:
            logits = self.w.expand(ids.shape[0], ids.shape[1], 2)

        return Out()


def test_sequence_logprobs_hand_computed():
    # log p(0) = log(1/4) = -1.386294, log p(1) = log(3/4) = -0.287682
    lps = sequence_logprobs(ConstantLM(), [1, 0, 1, 1], start=1)
    assert lps == pytest.approx([-1.386294, -0.287682, -0.287682], abs=1e-6)
    assert sequence_logprobs(ConstantLM(), [1, 0, 1, 1], start=3) == pytest.approx(
        [-0.287682], abs=1e-6
    )
    with pytest.raises(ValueError, match="start"):
        sequence_logprobs(ConstantLM(), [1], start=1)


def test_sequence_logprobs_matches_the_model_and_keeps_train_mode():
    model = tiny_model().train()
    ids = [5, 17, 99, 3, 42]
    logp = torch.log_softmax(model.eval()(torch.tensor([ids])).logits[0].float(), -1)
    model.train()
    expected = [logp[i - 1, ids[i]].item() for i in range(1, len(ids))]
    assert sequence_logprobs(model, ids) == pytest.approx(expected, abs=1e-6)
    assert model.training


@pytest.fixture
async def fake_with_model():
    servers = []

    async def make(model: torch.nn.Module, **kw: Any) -> tuple[FakeSGLang, SGLangEngine]:
        s = FakeSGLang(backend=TinyModelBackend(copy.deepcopy(model)), eos_token_ids=(EOS,), **kw)
        await s.start()
        e = SGLangEngine([s.url], backoff_initial_s=0.01)
        servers.append((s, e))
        return s, e

    yield make
    for s, e in servers:
        await e.aclose()
        await s.stop()


async def test_disk_push_loads_verifies_and_versions(fake_with_model, tmp_path):
    learner = tiny_model()
    server, engine = await fake_with_model(learner)
    sync = WeightSync(engine, WeightSyncConfig(shared_dir=str(tmp_path), keep_last=2))
    assert sync.method == "disk"
    train_step(learner)
    with pytest.raises(ProbeMismatchError):  # the probe sees that the engine is stale
        await sync.verify(learner)
    assert await sync.push(learner, 1) == "1"
    assert same_weights(server.backend.model, learner)
    assert sync.last_probe_error is not None and sync.last_probe_error < 1e-5
    assert [p for p, _ in server.calls[-5:-1]] == [
        "/pause_generation",
        "/flush_cache",
        "/update_weights_from_disk",
        "/continue_generation",
    ]
    assert (tmp_path / "step_1" / "model.safetensors").exists()
    assert (tmp_path / "step_1" / "config.json").exists()
    c = await engine.generate([1, 2, 3], SamplingParams(max_new_tokens=4))
    assert c.weight_version == "1"
    for step in (2, 3):
        train_step(learner)
        await sync.push(learner, step)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_2", "step_3"]  # keep_last=2
    assert same_weights(server.backend.model, learner)
    with pytest.raises(ValueError, match="step must increase"):
        await sync.push(learner, 3)


async def test_a_partial_rollouts_push_keeps_the_request_in_flight(tmp_path):
    """With `partial_rollouts` the push does not wait for, nor abort, a request in flight: it
    finishes as one request whose tokens are split between the versions, and the push is
    verified as usual."""
    learner = tiny_model()
    s = FakeSGLang(backend=TinyModelBackend(copy.deepcopy(learner)), eos_token_ids=(EOS,))
    await s.start()
    engine = SGLangEngine([s.url], backoff_initial_s=0.01, partial_rollouts=True)
    try:
        sync = WeightSync(engine, WeightSyncConfig(shared_dir=str(tmp_path)))
        await sync.push(learner, 1)
        s.faults.token_delay_s = 0.05  # 2 s of decoding: the push (save, load) lands mid-request
        params = SamplingParams(max_new_tokens=40, stop_token_ids=(), temperature=1.0, seed=3)
        task = asyncio.create_task(engine.generate([1, 2, 3], params))
        while not any(it.produced for it in s._items.values()):
            await asyncio.sleep(0.005)
        train_step(learner)
        assert await sync.push(learner, 2) == "2"
        assert sync.last_probe_error < 1e-5 and same_weights(s.backend.model, learner)
        c = await task
        (before,) = s.pauses[-1].values()
        assert c.version_runs == [(before, "1"), (len(c.token_ids) - before, "2")]
        assert 0 < before < len(c.token_ids)
        assert sum(bool(r.get("stream")) for r in s.requests) == 1  # kept, not sent again
        assert [p for p, _ in s.calls if p.startswith("/update")] == [
            "/update_weights_from_disk"
        ] * 2
    finally:
        await engine.aclose()
        await s.stop()


async def test_probe_mismatch_names_both_numbers(fake_with_model, tmp_path):
    learner = tiny_model()
    server, engine = await fake_with_model(learner)
    server.faults.ignore_weight_updates = True  # the server answers success but keeps old weights
    sync = WeightSync(engine, WeightSyncConfig(shared_dir=str(tmp_path)))
    train_step(learner, 0.2)
    with pytest.raises(
        ProbeMismatchError, match=r"version 1.*engine -\d+\.\d{4} vs learner -\d+\.\d{4}"
    ):
        await sync.push(learner, 1)


async def test_the_probe_runs_on_every_server_and_names_the_stale_one(tmp_path):
    learner = tiny_model()
    good, stale = (
        FakeSGLang(backend=TinyModelBackend(copy.deepcopy(learner)), eos_token_ids=(EOS,))
        for _ in range(2)
    )
    stale.faults.ignore_weight_updates = True  # answers success but keeps the old weights
    await good.start()
    await stale.start()
    engine = SGLangEngine([good.url, stale.url], backoff_initial_s=0.01)
    try:
        sync = WeightSync(engine, WeightSyncConfig(shared_dir=str(tmp_path)))
        for step in (1, 2):  # whichever server the balancer would have picked
            train_step(learner, 0.2)
            with pytest.raises(
                ProbeMismatchError,
                match=rf"version {step}: probe logprobs of "
                rf"{re.escape(stale.url)} differ",
            ) as err:
                await sync.push(learner, step)
            assert good.url not in str(err.value)
        probes = [r for r in good.requests + stale.requests if r["logprob_start_len"] >= 0]
        assert len(probes) == 4  # each push probed both servers
    finally:
        await engine.aclose()
        await good.stop()
        await stale.stop()


async def test_disk_push_in_bfloat16(fake_with_model, tmp_path):
    from safetensors import safe_open

    learner = tiny_model()
    server, engine = await fake_with_model(learner)
    sync = WeightSync(engine, WeightSyncConfig(shared_dir=str(tmp_path), dtype="bfloat16"))
    train_step(learner)
    await sync.push(learner, 1)
    with safe_open(str(tmp_path / "step_1" / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    assert 0 < sync.last_probe_error < sync.cfg.probe_tolerance  # rounding, within tolerance


async def test_in_process_push_sends_a_copy():
    learner = tiny_model()
    local = TinyModelBackend(copy.deepcopy(learner))  # an in-process engine: update_weights + score
    sync = WeightSync(local, WeightSyncConfig())
    assert sync.method == "in_process"
    train_step(learner)
    assert await sync.push(learner, 1) == "1"
    assert same_weights(local.model, learner) and local.version == "1"
    train_step(learner)  # the engine holds a copy, not the learner's tensors
    assert not same_weights(local.model, learner)


async def test_a_sync_that_hangs_times_out():
    class Stuck:
        async def update_weights(self, weights: Any, *, version: str) -> None:
            await asyncio.sleep(30)

    sync = WeightSync(Stuck(), WeightSyncConfig(timeout_s=0.2, probe_every=0))
    with pytest.raises(WeightSyncError, match="did not finish within 0s"):
        await sync.push(tiny_model(), 1)


async def test_a_failed_disk_update_is_an_error(fake_with_model, tmp_path):
    learner = tiny_model()
    server, engine = await fake_with_model(learner)
    sync = WeightSync(engine, WeightSyncConfig(shared_dir=str(tmp_path)))
    server.backend.model.lm_head = torch.nn.Linear(32, 64, bias=False)  # shapes no longer fit
    with pytest.raises(EngineError, match="update_weights_from_disk answered HTTP 400"):
        await sync.push(learner, 1)
    assert not server.paused


async def test_a_server_refusing_the_group_fails_the_push_at_once_with_its_message():
    """The server's 400 on /init_weights_update_group is the error, raised as soon as it comes,
    not a timeout of the trainer's rendezvous (which waits for that server in vain)."""
    server = FakeSGLang()

    async def refuse(body: Any, query: str, w: Any) -> tuple[int, Any]:
        return 400, {
            "success": False,
            "message": "Failed to initialize custom process group: connect to 127.0.0.1 refused",
        }

    server._init_group = refuse
    await server.start()
    engine = SGLangEngine([server.url])
    try:
        sync = WeightSync(
            engine,
            WeightSyncConfig(method="distributed", backend="gloo", timeout_s=10, probe_every=0),
        )
        t0 = time.monotonic()
        with pytest.raises(
            EngineError,
            match="init_weights_update_group answered HTTP 400: Failed "
            "to initialize custom process group: connect to 127.0.0.1 refused",
        ):
            await sync.push(tiny_model(), 1)
        assert time.monotonic() - t0 < 5  # not timeout_s
    finally:
        await engine.aclose()
        await server.stop()


def test_config_and_construction_errors(tmp_path):
    with pytest.raises(ValueError, match="bucket"):
        WeightSyncConfig(bucket=3)
    engine = SGLangEngine(["http://127.0.0.1:9"])
    with pytest.raises(ValueError, match="shared_dir"):
        WeightSync(engine, WeightSyncConfig(method="disk"))
    assert WeightSync(engine, WeightSyncConfig()).method == "distributed"
    with pytest.raises(ValueError, match="needs a server engine"):
        WeightSync(
            TinyModelBackend(tiny_model()),
            WeightSyncConfig(method="disk", shared_dir=str(tmp_path)),
        )

    class NoScore:
        async def update_weights(self, weights: Any, *, version: str) -> None: ...

    with pytest.raises(ValueError, match="score"):
        WeightSync(NoScore(), WeightSyncConfig())


async def test_distributed_push_with_gloo_in_two_processes(tmp_path):
    learner = tiny_model()
    learner.save_pretrained(tmp_path / "init")
    log = tmp_path / "calls.jsonl"
    with FakeSGLangProcess(
        "--backend",
        "model",
        "--model-path",
        str(tmp_path / "init"),
        "--eos",
        str(EOS),
        "--calls-log",
        str(log),
    ) as proc:
        engine = SGLangEngine([proc.url])
        try:
            await engine.wait_ready(timeout_s=60)
            cfg = WeightSyncConfig(
                method="distributed", backend="gloo", timeout_s=120, bucket_mb=0.01
            )
            sync = WeightSync(engine, cfg, probe_ids=[1, 5, 9, 33, 64, 100, 2])
            for step in (1, 2):
                train_step(learner)
                assert await sync.push(learner, step) == str(step)
                assert sync.last_probe_error < 1e-5
            assert await engine.weight_versions() == {proc.url: "2"}
            c = await engine.generate([1, 2, 3], SamplingParams(max_new_tokens=3))
            assert c.weight_version == "2"
            await sync.close()
        finally:
            await engine.aclose()
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    paths = [
        c["path"]
        for c in calls
        if c["path"] not in ("/health_generate", "/server_info", "/model_info")
    ]
    inits = [c["body"] for c in calls if c["path"] == "/init_weights_update_group"]
    updates = [c["body"] for c in calls if c["path"] == "/update_weights_from_distributed"]
    assert len(inits) == 1  # the group is created once
    assert paths[0] == "/init_weights_update_group" and paths[-1] == "/destroy_weights_update_group"
    assert paths[1:3] == ["/pause_generation", "/flush_cache"] and "/continue_generation" in paths
    assert inits[0]["rank_offset"] == 1 and inits[0]["world_size"] == 2
    sd = learner.state_dict()
    per_push = len(updates) // 2
    assert per_push > 1  # bucketed
    names = [n for u in updates[:per_push] for n in u["names"]]
    assert names == list(sd)
    assert [u.get("weight_version") for u in updates[:per_push]] == [None] * (per_push - 1) + ["1"]
    fx_init = json.loads((FIXTURES / "init_weights_update_group.json").read_text())["request"]
    fx_upd = json.loads((FIXTURES / "update_weights_from_distributed.json").read_text())["request"]
    assert set(inits[0]) == set(fx_init["json"])
    fx_upd = fx_upd["json"]
    assert set(updates[-1]) == set(fx_upd) and all(set(u) <= set(fx_upd) for u in updates)


async def test_a_distributed_push_reaches_every_server_of_the_group_or_none(tmp_path):
    """The group's ranks are all the servers, and a broadcast completes only when each joins: a
    server out of rotation after a blip is probed first and gets the push; one that is gone fails
    the push at once, naming it, before anything is paused or broadcast."""
    learner = tiny_model()
    learner.save_pretrained(tmp_path / "init")
    args = ("--backend", "model", "--model-path", str(tmp_path / "init"), "--eos", str(EOS))
    with FakeSGLangProcess(*args) as a, FakeSGLangProcess(*args) as b:
        engine = SGLangEngine([a.url, b.url])
        try:
            await engine.wait_ready(timeout_s=60)
            sync = WeightSync(
                engine,
                WeightSyncConfig(method="distributed", backend="gloo", timeout_s=30),
                probe_ids=[1, 5, 9, 33, 64, 100, 2],
            )
            train_step(learner)
            await sync.push(learner, 1)
            pool = engine._pool
            pool._mark_unhealthy(pool.servers[1], "HTTP 503: simulated")  # a blip in the rollouts
            train_step(learner)
            assert await sync.push(learner, 2) == "2"
            assert await engine.weight_versions() == {a.url: "2", b.url: "2"}
            b.close()  # gone for good; the rollouts noticed
            pool._mark_unhealthy(pool.servers[1], "ConnectError: connection refused")
            train_step(learner)
            t0 = time.monotonic()
            with pytest.raises(EngineError, match=rf"{re.escape(b.url)} is out of rotation"):
                await sync.push(learner, 3)
            assert time.monotonic() - t0 < 10  # not timeout_s
            assert await engine.weight_versions() == {a.url: "2"}
            await sync.close()
        finally:
            await engine.aclose()
