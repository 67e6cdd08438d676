"""train.max_staleness >= 2: the training loop on the asynchronous pipeline, end to end on the tiny
model: no sample beyond k, no group lost or trained twice across a SIGTERM and resume."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from agentgrpo.run.log import read_jsonl
from tests.test_checkpoint import VariedRewardEnv, _train


class SlowTaskEnv(VariedRewardEnv):
    """Every third task's episode starts 1.5 s late: long-tailed groups."""

    def reset(self, *, seed=None, options=None):
        task = options["task"]
        if int(task.id.rsplit("-", 1)[-1]) % 3 == 0:
            time.sleep(1.5)
        return super().reset(seed=seed, options=options)


ASYNC = (
    "train.max_staleness=2",
    "env.name=tests.test_async_train:SlowTaskEnv",
    # stale samples need an importance correction (agentgrpo.run.config)
    "learner.old_logprobs=recompute",
    "loss.tis=token",
)


def _positions(out):
    """step -> sorted positions of the groups it trained (group ids are p<position>:<task>)."""
    by_step: dict[int, set[int]] = {}
    for r in read_jsonl(out / "trajectories.jsonl"):
        by_step.setdefault(r["step"], set()).add(int(r["group_id"].split(":")[0][1:]))
    return {s: sorted(ps) for s, ps in by_step.items()}


@pytest.mark.parametrize("partial", [False, True])
def test_no_step_trains_a_sample_beyond_max_staleness(tmp_path, stopping_model_dir, partial):
    """Also with partial rollouts (a push lands between two decode steps of running requests)."""
    out = tmp_path / "run"
    assert _train(out, stopping_model_dir, 5, *ASYNC, f"engine.partial_rollouts={partial}") == 0
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5]
    assert all(0 <= m["policy_lag"] <= 2 for m in metrics)
    assert all(m["policy_lag_mean"] <= m["policy_lag"] for m in metrics)
    assert all("pipeline/in_flight" in m for m in metrics)
    # with slow groups moved back, samples from older weights were trained: the pipeline ran ahead
    assert max(m["policy_lag"] for m in metrics) >= 1
    for r in read_jsonl(out / "trajectories.jsonl"):  # every token's version is within the bound
        assert all(0 <= r["step"] - 1 - v <= 2 for _, v in r["token_versions"])
        assert sum(n for n, _ in r["token_versions"]) == sum(r["loss_mask"])
    positions = [p for ps in _positions(out).values() for p in ps]
    assert sorted(positions) == list(range(10))  # 5 steps x 2 groups, each once


def test_a_sigterm_and_resume_lose_no_group_and_train_none_twice(
    tmp_path, stopping_model_dir, monkeypatch
):
    from agentgrpo.learner.learner import Learner

    real_step, calls = Learner.train_step, {"n": 0}

    def sigterm_in_step_2(self, *a, **kw):
        metrics = real_step(self, *a, **kw)
        calls["n"] += 1
        if calls["n"] == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # from the learner's thread
            time.sleep(0.2)
        return metrics

    out = tmp_path / "run"
    monkeypatch.setattr(Learner, "train_step", sigterm_in_step_2)
    assert _train(out, stopping_model_dir, 5, *ASYNC) == 0
    monkeypatch.setattr(Learner, "train_step", real_step)
    assert [m["step"] for m in read_jsonl(out / "metrics.jsonl")] == [1, 2]
    manifest = json.loads((out / "checkpoints" / "step-000002" / "trainer.json").read_text())
    trained_before = {p for ps in _positions(out).values() for p in ps}
    pending = manifest["pending_positions"]
    assert pending and not set(pending) & trained_before  # in flight or ready, not trained
    assert manifest["data_position"] == len(trained_before) + len(pending)

    assert _train(out, stopping_model_dir, 5, *ASYNC) == 0
    by_step = _positions(out)
    assert sorted(by_step) == [1, 2, 3, 4, 5]
    positions = [p for ps in by_step.values() for p in ps]
    # what an uninterrupted run trains: positions 0..9, each once (the steps they land in and the
    # weights that sample them depend on timing, in an uninterrupted run too)
    assert sorted(positions) == list(range(10))
    assert all(0 <= m["policy_lag"] <= 2 for m in read_jsonl(out / "metrics.jsonl"))


def test_dynamic_sampling_evaluation_and_the_report_work_as_in_the_synchronous_loop(
    tmp_path, stopping_model_dir
):
    out = tmp_path / "run"
    assert (
        _train(
            out,
            stopping_model_dir,
            3,
            *ASYNC,
            "shaping.dynamic_sampling=true",
            "shaping.max_extra_rounds=2",
            "eval.every=2",
            "eval.num_tasks=2",
            "eval.samples_per_task=1",
        )
        == 0
    )
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert ["eval/reward_mean" in m for m in metrics] == [False, True, False]
    # every trained group carries signal: all-equal ones were replaced (or the step trained fewer)
    for group_id, rows in _rows_by_group(out).items():
        assert len({r["reward"] for r in rows}) > 1, group_id
    assert all(m["groups_sampled"] >= 1 for m in metrics)
    assert (out / "report.html").is_file()


def _rows_by_group(out):
    groups: dict[str, list[dict]] = {}
    for r in read_jsonl(out / "trajectories.jsonl"):
        groups.setdefault(r["group_id"], []).append(r)
    return groups
