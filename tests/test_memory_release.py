"""The engine lends its memory to the learner while it trains: SGLang servers on the learner's GPUs
release weights and KV cache (`engine.sglang.release_memory_during_training`, SGLang's memory
saver), the local engine drops its prefix cache (dead once the weights change); both come back
before the weight push. Against the fake SGLang server, in-process and as a whole training run."""

from __future__ import annotations

import asyncio
import json

import pytest

from agentgrpo.cli import main
from agentgrpo.engine import EngineError, SamplingParams, SGLangEngine
from agentgrpo.run.config import ConfigError, load_config
from agentgrpo.run.log import read_jsonl
from tests.fake_sglang import FakeSGLang, FakeSGLangProcess
from tests.short_runs import train

FAST = {"backoff_initial_s": 0.01, "probe_interval_s": 0.05, "ready_poll_s": 0.02}
RELEASE = ["/pause_generation", "/release_memory_occupation"]
RESUME = ["/resume_memory_occupation", "/resume_memory_occupation", "/continue_generation"]
PUSH = ["/pause_generation", "/flush_cache", "/update_weights_from_disk", "/continue_generation"]


@pytest.fixture
async def fake():
    servers: list[FakeSGLang] = []
    engines: list[SGLangEngine] = []

    async def make(*, memory_saver: bool, release: bool = True) -> tuple[FakeSGLang, SGLangEngine]:
        s = FakeSGLang(memory_saver=memory_saver)
        await s.start()
        servers.append(s)
        engines.append(SGLangEngine([s.url], release_memory_during_training=release, **FAST))
        return s, engines[-1]

    yield make
    for e in engines:
        await e.aclose()
    for s in servers:
        await s.stop()


def control_calls(s: FakeSGLang) -> list[str]:
    return [p for p, _ in s.calls if p != "/server_info"]


async def test_release_then_resume_follow_sglangs_memory_saver_protocol(fake, tmp_path):
    s, e = await fake(memory_saver=True)
    await e.release_memory()
    assert control_calls(s) == RELEASE
    assert s.calls[-1][1] == {"tags": ["kv_cache", "weights"]} and s.released_tags == {
        "kv_cache",
        "weights",
    }
    # Generation waits in the client (the released server would fail it), and a push is refused
    # before it reaches a server whose weights are unmapped.
    waiting = asyncio.create_task(e.generate([1], SamplingParams(max_new_tokens=2)))
    await asyncio.sleep(0.1)
    assert not waiting.done() and not s.requests
    with pytest.raises(EngineError, match=r"resume_memory\(\) first"):
        await e.update_weights_from_disk(tmp_path, version="1")
    assert control_calls(s) == RELEASE
    await e.resume_memory()
    assert control_calls(s) == RELEASE + RESUME
    assert [b for p, b in s.calls if p == "/resume_memory_occupation"] == [
        {"tags": ["weights"]},
        {"tags": ["kv_cache"]},
    ]
    assert (await waiting).finish_reason == "length"
    assert not s.released_tags and not s.paused and not s.unhealthy
    await e.update_weights_from_disk(tmp_path, version="1")
    assert control_calls(s) == RELEASE + RESUME + PUSH
    await e.resume_memory()  # nothing released: nothing sent
    assert control_calls(s) == RELEASE + RESUME + PUSH


async def test_a_request_still_running_is_aborted_first_and_resubmitted_after_the_resume(fake):
    s, e = await fake(memory_saver=True)
    s.faults.token_delay_s = 0.01
    running = asyncio.create_task(e.generate([1], SamplingParams(max_new_tokens=30)))
    await asyncio.sleep(0.1)
    await e.release_memory()  # without the pause SGLang's idleness assertion would kill the server
    assert not s.unhealthy and s.released_tags
    await e.resume_memory()
    c = await running
    assert (c.finish_reason, len(c.token_ids)) == ("length", 30) and len(s.requests) == 2


async def test_a_server_without_the_memory_saver_is_refused_and_keeps_serving(fake):
    s, e = await fake(memory_saver=False)
    with pytest.raises(EngineError, match="without --enable-memory-saver"):
        await e.release_memory()
    assert control_calls(s) == [] and not s.paused
    assert (await e.generate([1], SamplingParams(max_new_tokens=2))).finish_reason == "length"


async def test_without_the_setting_nothing_is_released(fake):
    s, e = await fake(memory_saver=True, release=False)
    await e.release_memory()
    await e.resume_memory()
    assert s.calls == []


async def test_the_fake_dies_on_a_weight_update_into_released_weights(fake, tmp_path):
    s, _ = await fake(memory_saver=True)
    import httpx

    async with httpx.AsyncClient(timeout=10) as c:
        await c.post(f"{s.url}/release_memory_occupation", json={"tags": ["weights"]})
        r = await c.post(f"{s.url}/update_weights_from_disk", json={"model_path": str(tmp_path)})
    assert r.status_code == 500 and s.unhealthy


def test_config_refuses_releasing_while_overlapped_rollouts_sample():
    sglang = [
        "engine.kind=sglang",
        "engine.sglang.urls=[http://127.0.0.1:30000]",
        "engine.sglang.release_memory_during_training=true",
    ]
    load_config(None, sglang)
    with pytest.raises(
        ConfigError, match="release_memory_during_training with train.max_staleness=1"
    ):
        load_config(
            None,
            [
                *sglang,
                "train.overlap_rollouts=true",
                "learner.old_logprobs=recompute",
                "loss.tis=token",
            ],
        )


def test_a_training_run_lends_the_servers_memory_to_every_learner_step(
    tmp_path, stopping_model_dir, monkeypatch
):
    """Per step: rollouts, then pause + release, the learner step, resume + continue, then the push;
    the run samples with every pushed version, so the weights the servers got back were refilled."""
    from agentgrpo.learner.learner import Learner

    log = tmp_path / "calls.jsonl"
    real_step = Learner.train_step

    def logged_step(self, *a, **kw):  # the learner step, in the server's call log
        with open(log, "a") as f:
            f.write(json.dumps({"path": "TRAIN"}) + "\n")
        return real_step(self, *a, **kw)

    monkeypatch.setattr(Learner, "train_step", logged_step)
    out = tmp_path / "run"
    with FakeSGLangProcess(
        "--backend",
        "model",
        "--model-path",
        str(stopping_model_dir),
        "--enable-memory-saver",
        "--calls-log",
        str(log),
    ) as server:
        assert (
            train(
                out,
                stopping_model_dir,
                2,
                "engine.kind=sglang",
                f"engine.sglang.urls=[{server.url}]",
                "engine.sglang.release_memory_during_training=true",
                f"weight_sync.shared_dir={tmp_path / 'w'}",
                "rollout.max_turns=1",
            )
            == 0
        )
    paths = [
        c["path"]
        for c in map(json.loads, log.read_text().splitlines())
        if c["path"] in {"TRAIN", *RELEASE, *RESUME, *PUSH}
    ]
    assert paths == PUSH + 2 * (RELEASE + ["TRAIN"] + RESUME + PUSH)
    versions = {
        r["step"]: set(r["weight_versions"]) for r in read_jsonl(out / "trajectories.jsonl")
    }
    assert versions == {1: {0}, 2: {1}}


def test_a_run_against_a_server_without_the_memory_saver_stops_before_training(
    tmp_path, stopping_model_dir
):
    with FakeSGLangProcess("--backend", "model", "--model-path", str(stopping_model_dir)) as server:
        with pytest.raises(EngineError, match="without --enable-memory-saver"):
            main(
                [
                    "train",
                    "examples/calculator.yaml",
                    f"output_dir={tmp_path / 'run'}",
                    "train.steps=1",
                    f"model.path={stopping_model_dir}",
                    "rollout.group_size=2",
                    "rollout.tasks_per_step=1",
                    "rollout.max_new_tokens=4",
                    "rollout.max_tokens=16",
                    "rollout.max_turns=1",
                    "log.progress=false",
                    "engine.kind=sglang",
                    f"engine.sglang.urls=[{server.url}]",
                    f"weight_sync.shared_dir={tmp_path}",
                    "engine.sglang.release_memory_during_training=true",
                ]
            )
