"""The whole loop, end to end: config -> rollouts -> advantages -> update -> sync -> run
directory."""

import json
import math

import pytest

from agentgrpo.cli import main
from agentgrpo.run.log import read_jsonl
from agentgrpo.types import Message, StopReason, Trajectory
from tests.short_runs import train_short


def _run(tmp_path, model_dir, *extra):
    out = tmp_path / "run"
    assert train_short(out, model_dir, 2, *extra) == 0
    return out


def _check_run_dir(out, steps):
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    for m in metrics:
        assert math.isfinite(m["loss"]) and math.isfinite(m["reward_mean"])
        assert (
            m["phase_s/rollout"] > 0 and m["phase_s/train"] > 0
        )  # logged with log.progress=false too
    rows = read_jsonl(out / "trajectories.jsonl")
    assert rows and {r["step"] for r in rows} == set(range(1, steps + 1))
    for r in rows:
        t = Trajectory(
            task_id=r["task_id"],
            token_ids=r["token_ids"],
            loss_mask=r["loss_mask"],
            logprobs=r["logprobs"],
            prompt_len=r["prompt_len"],
            messages=[Message.from_dict(m) for m in r["messages"]],
            stop_reason=StopReason(r["stop_reason"]),
        )
        t.check()
        assert t.num_sampled > 0 and r["reward"] is not None
    assert (out / "config.yaml").exists() and list((out / "checkpoints").glob("step-*"))
    assert list((out / "tensorboard").iterdir())
    assert (out / "report.html").stat().st_size > 1000  # every run ends with its report
    return metrics


def test_two_steps_with_a_tiny_model(tmp_path, tiny_model_dir):
    out = _run(tmp_path, tiny_model_dir)
    _check_run_dir(out, 2)
    weight_versions = {
        tuple(r["weight_versions"])
        for r in read_jsonl(out / "trajectories.jsonl")
        if r["step"] == 2
    }
    assert weight_versions == {(1,)}  # step 2 was sampled with the weights after step 1


def test_rerun_resumes_instead_of_restarting(tmp_path, tiny_model_dir):
    out = _run(tmp_path, tiny_model_dir)
    assert train_short(out, tiny_model_dir, 3) == 0
    assert [m["step"] for m in read_jsonl(out / "metrics.jsonl")] == [1, 2, 3]


def test_bad_config_key_fails_before_any_work(tmp_path, capsys):
    assert (
        main(
            [
                "train",
                "examples/calculator.yaml",
                f"output_dir={tmp_path}/x",
                "rollout.temprature=0.5",
            ]
        )
        == 2
    )
    assert "rollout.temprature: unknown key" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_one_step_with_the_embedded_model(tmp_path, smol_path):
    out = _run(
        tmp_path, smol_path, "train.steps=1", "rollout.max_new_tokens=48", "rollout.max_tokens=96"
    )
    metrics = _check_run_dir(out, 1)
    assert metrics[0]["sampled_tokens"] > 0
    rows = read_jsonl(out / "trajectories.jsonl")
    assert json.dumps(rows[0]["messages"])  # messages are plain JSON


def test_dynamic_sampling_and_overlong_shaping_are_wired(tmp_path, tiny_model_dir):
    # The random tiny model never answers right: every group has equal rewards, so dynamic sampling
    # drops them all, samples one extra round, and the step trains on nothing (no NaN anywhere).
    out = _run(
        tmp_path,
        tiny_model_dir,
        "train.steps=1",
        "shaping.dynamic_sampling=true",
        "shaping.max_extra_rounds=1",
        "shaping.overlong_buffer_len=8",
    )
    m = read_jsonl(out / "metrics.jsonl")[0]
    assert (
        m["dynamic/extra_rounds"] == 1
        and m["groups_sampled"] == 4
        and m["dynamic/groups_kept"] == 0
    )
    assert m["skipped"] == 1.0
    assert m["reward_mean"] is None  # no group was kept: logged as null, never as a fake 0


def test_engine_blocks_that_would_be_ignored_are_rejected():
    from agentgrpo.run.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="no engine.sglang block"):
        load_config(None, ["engine.kind=sglang"])
    with pytest.raises(ConfigError, match="engine.kind is local"):
        load_config(None, ["engine.sglang.urls=[http://127.0.0.1:30000]"])
    cfg = load_config(None, ["engine.kind=sglang", "engine.sglang.urls=[http://127.0.0.1:30000]"])
    assert cfg.engine.sglang.urls == ["http://127.0.0.1:30000"]


def test_periodic_evaluation_is_logged_beside_training(tmp_path, tiny_model_dir):
    out = _run(
        tmp_path,
        tiny_model_dir,
        "eval.every=1",
        "eval.num_tasks=2",
        "eval.samples_per_task=2",
        "eval.pass_k=[1,2]",
    )
    for m in read_jsonl(out / "metrics.jsonl"):
        assert m["eval/tasks"] == 2 and m["eval/trajectories"] == 4
        assert "eval/pass@2" in m and "eval/reward_mean" in m


def test_a_failing_closer_does_not_skip_the_others():
    # destroying the weight-update group on a dead server once raised in train()'s cleanup, which
    # skipped closing the engine and the loop and replaced the run's own error
    import asyncio
    import warnings

    from agentgrpo.engine.base import close_all

    loop, closed = asyncio.new_event_loop(), []

    async def broken():
        raise RuntimeError("server gone")

    async def engine_close():
        closed.append("engine")

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        close_all(loop, broken, None, engine_close, lambda: closed.append("sync"))
    assert closed == ["engine", "sync"] and loop.is_closed()
    assert any("server gone" in str(w.message) for w in seen)
