"""train.overlap_rollouts: the next step is sampled while this one trains (one step off-policy);
resuming stays exact, a failing or stopped step cancels the sampling, nothing is lost."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import pytest
import torch

from agentgrpo.run.config import load_config
from agentgrpo.run.log import read_jsonl
from agentgrpo.run.overlap import train_while_collecting
from agentgrpo.run.train import policy_lag
from agentgrpo.types import StopReason, Trajectory
from tests.test_checkpoint import _by_step, _train, _weights

# one step off-policy needs an importance correction (RunConfig._off_policy_is_corrected)
OVERLAP = ("train.overlap_rollouts=true", "learner.old_logprobs=recompute", "loss.tis=token")


def test_overlapped_rollouts_come_from_the_weights_before_the_update(tmp_path, stopping_model_dir):
    out = tmp_path / "run"
    assert _train(out, stopping_model_dir, 3, *OVERLAP) == 0
    metrics = read_jsonl(out / "metrics.jsonl")
    # Step 1 is sampled before any update; steps 2 and 3 while the step before them trained, so the
    # engine reports the version before that update (the push waits for the sampling to finish).
    assert [m["policy_lag"] for m in metrics] == [0.0, 1.0, 1.0]
    assert ["phase_s/train+rollout" in m for m in metrics] == [True, True, False]
    versions: dict[int, set[tuple[int, ...]]] = {}
    for r in read_jsonl(out / "trajectories.jsonl"):
        versions.setdefault(r["step"], set()).add(tuple(r["weight_versions"]))
    assert versions == {1: {(0,)}, 2: {(0,)}, 3: {(1,)}}

    plain = tmp_path / "plain"
    assert _train(plain, stopping_model_dir, 3) == 0
    assert [m["policy_lag"] for m in read_jsonl(plain / "metrics.jsonl")] == [0.0, 0.0, 0.0]
    a, b = _by_step(out), _by_step(plain)
    assert a[1] == b[1]  # the same first step; afterwards the same tasks and seeds, older weights
    assert [sorted(g for g, _, _ in a[s]) for s in (2, 3)] == [
        sorted(g for g, _, _ in b[s]) for s in (2, 3)
    ]
    assert a[3] != b[3]


def test_overlapped_run_killed_and_resumed_equals_uninterrupted(
    tmp_path, stopping_model_dir, monkeypatch
):
    straight = tmp_path / "straight"
    assert _train(straight, stopping_model_dir, 4, "train.save_every=2", *OVERLAP) == 0

    from agentgrpo.learner.learner import Learner

    calls, real_step = {"n": 0}, Learner.train_step
    sampled_meanwhile = []

    def dies_in_step_3(self, *a, **kw):
        calls["n"] += 1
        if calls["n"] == 3:  # step 3 overlaps step 4's sampling, which the failure must cancel
            time.sleep(0.5)
            sampled_meanwhile.append(True)
            raise RuntimeError("killed")
        return real_step(self, *a, **kw)

    killed = tmp_path / "killed"
    monkeypatch.setattr(Learner, "train_step", dies_in_step_3)
    with pytest.raises(RuntimeError, match="killed"):
        _train(killed, stopping_model_dir, 4, "train.save_every=2", *OVERLAP)
    monkeypatch.setattr(Learner, "train_step", real_step)
    assert sampled_meanwhile and [m["step"] for m in read_jsonl(killed / "metrics.jsonl")] == [1, 2]
    assert _train(killed, stopping_model_dir, 4, "train.save_every=2", *OVERLAP) == 0

    assert [m["policy_lag"] for m in read_jsonl(straight / "metrics.jsonl")] == [0.0, 1.0, 0.0, 1.0]
    assert _by_step(straight) == _by_step(killed)
    for name, t in _weights(straight, 4).items():
        torch.testing.assert_close(_weights(killed, 4)[name], t, msg=name)


def test_a_stop_during_overlapped_sampling_cancels_it_and_rewinds_the_data(
    tmp_path, stopping_model_dir, monkeypatch
):
    from agentgrpo.learner.learner import Learner

    real_step = Learner.train_step

    def sigterm_in_the_first_step(self, *a, **kw):
        metrics = real_step(self, *a, **kw)
        os.kill(
            os.getpid(), signal.SIGTERM
        )  # from the learner's thread; the handler runs in the main one
        time.sleep(0.2)
        return metrics

    out = tmp_path / "run"
    monkeypatch.setattr(Learner, "train_step", sigterm_in_the_first_step)
    assert _train(out, stopping_model_dir, 3, *OVERLAP) == 0
    monkeypatch.setattr(Learner, "train_step", real_step)
    manifest = json.loads((out / "checkpoints" / "step-000001" / "trainer.json").read_text())
    assert (
        manifest["data_position"] == 2
    )  # step 1's 2 tasks; step 2's were sampled, never trained on
    assert [r["step"] for r in read_jsonl(out / "trajectories.jsonl")] == [1] * 4

    assert _train(out, stopping_model_dir, 3, *OVERLAP) == 0
    plain = tmp_path / "plain"
    assert _train(plain, stopping_model_dir, 3) == 0
    groups = {s: sorted(g for g, _, _ in rows) for s, rows in _by_step(out).items()}
    assert groups == {s: sorted(g for g, _, _ in rows) for s, rows in _by_step(plain).items()}


def test_a_failing_train_step_cancels_the_collection():
    cancelled = []

    async def collecting():
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    def fails():
        time.sleep(0.05)
        raise ValueError("bad batch")

    async def main():
        with pytest.raises(ValueError, match="bad batch"):
            await train_while_collecting(fails, collecting(), abandon=lambda: False)
        metrics, result = await train_while_collecting(
            lambda: {"loss": 1.0}, collecting(), abandon=lambda: True
        )
        assert (metrics, result) == ({"loss": 1.0}, None)

    asyncio.run(asyncio.wait_for(main(), 10))
    assert cancelled == [True, True]


def test_policy_lag_reads_the_engines_versions():
    def traj(version):
        return Trajectory(
            task_id="t",
            token_ids=[1, 2],
            loss_mask=[0, 1],
            logprobs=[0.0, -1.0],
            prompt_len=1,
            messages=[],
            stop_reason=StopReason.COMPLETED,
            weight_versions=version,
        )

    assert policy_lag([traj((3,)), traj((2, 3))], 3) == 1.0
    assert policy_lag([traj(())], 3) != policy_lag([traj(())], 3)  # NaN: nothing to read


def test_overlap_with_recomputed_old_logprobs_needs_tis():
    with pytest.raises(Exception, match="loss.tis"):
        load_config("examples/calculator.yaml", [OVERLAP[0], "learner.old_logprobs=recompute"])
    load_config("examples/calculator.yaml", list(OVERLAP))


def test_two_ranks_overlap_like_one_process(tmp_path, stopping_model_dir):
    """Rank 0 trains in a worker thread while it samples; rank 1 trains in its main thread: the
    collectives still meet, and the run equals one process's."""
    from tests.ranks import spawn_gloo
    from tests.test_distributed import HANG, _train_on_rank

    one, two = tmp_path / "one", tmp_path / "two"
    assert _train(one, stopping_model_dir, 3, *OVERLAP) == 0
    # (_train_on_rank checkpoints every 2 steps, where overlapping pauses; 3 lets step 3 overlap.)
    spawn_gloo(
        _train_on_rank, str(two), str(stopping_model_dir), 3, *OVERLAP, HANG, "train.save_every=3"
    )
    assert _by_step(one) == _by_step(two)
    m1, m2 = read_jsonl(one / "metrics.jsonl"), read_jsonl(two / "metrics.jsonl")
    assert [m["policy_lag"] for m in m2] == [0.0, 1.0, 1.0]
    # Step 3's loss is computed on weights two ranks summed in another order (see test_distributed).
    assert [m["loss"] for m in m2] == pytest.approx([m["loss"] for m in m1], rel=1e-3)
