"""The training loop on its one scheduler with `train.max_staleness` >= 1, end to end on the tiny
model: no sample trained beyond k, none lost or trained twice across a stop and resume, no
checkpoint crossed by a collection, two ranks, dynamic sampling, evaluation and the report.
(k = 0 runs through the same scheduler in test_train_e2e.py, test_checkpoint.py and
test_distributed.py.)"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time

import pytest

from agentgrpo.run.config import load_config
from agentgrpo.run.log import read_jsonl
from agentgrpo.run.train import policy_lag
from agentgrpo.types import StopReason, Trajectory
from tests.short_runs import VariedRewardEnv, train


class SlowTaskEnv(VariedRewardEnv):
    """Every third task's episode starts 1.5 s late: long-tailed groups."""

    def reset(self, *, seed=None, options=None):
        task = options["task"]
        if int(task.id.rsplit("-", 1)[-1]) % 3 == 0:
            time.sleep(1.5)
        return super().reset(seed=seed, options=options)


# stale samples need an importance correction (RunConfig._off_policy_is_corrected)
CORRECTED = ("learner.old_logprobs=recompute", "loss.tis=token")
ASYNC = ("train.max_staleness=2", "env.name=tests.test_async_train:SlowTaskEnv", *CORRECTED)
ONE = ("train.max_staleness=1", *CORRECTED)


def _positions(out):
    """step -> sorted positions of the groups it trained (group ids are p<position>:<task>)."""
    by_step: dict[int, set[int]] = {}
    for r in read_jsonl(out / "trajectories.jsonl"):
        by_step.setdefault(r["step"], set()).add(int(r["group_id"].split(":")[0][1:]))
    return {s: sorted(ps) for s, ps in by_step.items()}


def _lags(out):
    return [m["policy_lag"] for m in read_jsonl(out / "metrics.jsonl")]


def _groups(out):
    """group id -> (weight versions, [(token ids, reward)] of its trajectories)."""
    groups: dict[str, tuple[set, list]] = {}
    for r in read_jsonl(out / "trajectories.jsonl"):
        versions, rows = groups.setdefault(r["group_id"], (set(), []))
        versions.update(r["weight_versions"])
        rows.append((r["token_ids"], r["reward"]))
    return {g: (v, sorted(rows)) for g, (v, rows) in groups.items()}


def test_k_1_samples_the_next_step_with_the_weights_before_the_update(tmp_path, stopping_model_dir):
    """Step 1 trains groups of the first weights; steps 2 and 3 groups sampled while the step
    before them trained, one update behind, by one version each (the push waits for them). A
    group sampled by the same weights is the one the synchronous loop samples: its task and seeds
    follow from its position."""
    out, plain = tmp_path / "run", tmp_path / "plain"
    assert train(out, stopping_model_dir, 3, *ONE) == 0
    metrics = read_jsonl(out / "metrics.jsonl")
    assert [m["policy_lag"] for m in metrics] == [0.0, 1.0, 1.0]
    assert all("phase_s/train+rollout" in m for m in metrics)
    by_step = _positions(out)
    assert sorted(by_step[1] + by_step[2]) == [0, 1, 2, 3]  # admitted with the first weights
    assert by_step[3] == [4, 5]  # admitted once the learner was at 1
    versions: dict[int, set[tuple[int, ...]]] = {}
    for r in read_jsonl(out / "trajectories.jsonl"):
        versions.setdefault(r["step"], set()).add(tuple(r["weight_versions"]))
    assert versions == {1: {(0,)}, 2: {(0,)}, 3: {(1,)}}
    assert train(plain, stopping_model_dir, 3) == 0
    assert _lags(plain) == [0.0, 0.0, 0.0]
    assert _positions(plain) == {1: [0, 1], 2: [2, 3], 3: [4, 5]}
    a, b = _groups(out), _groups(plain)
    first = [g for g in a if g.startswith(("p0:", "p1:"))]  # sampled by the first weights in both
    assert len(first) == 2 and all(a[g] == b[g] for g in first)


def test_k_1_never_crosses_a_checkpoint_and_a_resume_continues_from_it(
    tmp_path, stopping_model_dir
):
    """With a checkpoint every 2 steps nothing is sampled ahead during a checkpoint's step (lag 0
    after it, nothing pending in it). A copy of the run resumed from its step-2 checkpoint samples
    the groups the run sampled after it, token for token (the checkpoint's weights sample all of
    them: the push waits for them); only which of steps 3 and 4 a group lands in may differ."""
    run, copy = tmp_path / "run", tmp_path / "copy"
    assert train(run, stopping_model_dir, 4, "train.save_every=2", *ONE) == 0
    assert _lags(run) == [0.0, 1.0, 0.0, 1.0]
    manifest = json.loads((run / "checkpoints" / "step-000002" / "trainer.json").read_text())
    assert manifest["data_position"] == 4 and manifest["pending_positions"] == []
    shutil.copytree(run, copy)
    shutil.rmtree(copy / "checkpoints" / "step-000004")  # as if killed in step 4
    assert train(copy, stopping_model_dir, 4, "train.save_every=2", *ONE) == 0
    assert _lags(copy) == [0.0, 1.0, 0.0, 1.0]
    a, b = _positions(run), _positions(copy)
    assert sorted(a[3] + a[4]) == sorted(b[3] + b[4]) == [4, 5, 6, 7]
    ga, gb = _groups(run), _groups(copy)
    assert ga == gb and sum(v == {2} for v, _ in ga.values()) == 4


def test_a_stop_while_sampling_ahead_keeps_the_groups_for_after_the_resume(
    tmp_path, stopping_model_dir, monkeypatch
):
    """A SIGTERM in step 1 of a k = 1 run: the checkpoint lists the groups admitted and not
    trained; the resumed run samples them first, and every position is trained once."""
    from agentgrpo.learner.learner import Learner

    real_step = Learner.train_step

    def sigterm_in_the_first_step(self, *a, **kw):
        metrics = real_step(self, *a, **kw)
        os.kill(os.getpid(), signal.SIGTERM)  # from the learner's thread; the handler: main's
        time.sleep(0.2)
        return metrics

    out = tmp_path / "run"
    monkeypatch.setattr(Learner, "train_step", sigterm_in_the_first_step)
    assert train(out, stopping_model_dir, 3, *ONE) == 0
    monkeypatch.setattr(Learner, "train_step", real_step)
    manifest = json.loads((out / "checkpoints" / "step-000001" / "trainer.json").read_text())
    trained = _positions(out)[1]
    assert (
        len(trained) == 2 and [r["step"] for r in read_jsonl(out / "trajectories.jsonl")] == [1] * 4
    )
    assert sorted(trained + manifest["pending_positions"]) == list(range(manifest["data_position"]))

    assert train(out, stopping_model_dir, 3, *ONE) == 0
    positions = [p for ps in _positions(out).values() for p in ps]
    assert sorted(positions) == list(range(6))


@pytest.mark.parametrize("partial", [False, True])
def test_no_step_trains_a_sample_beyond_max_staleness(tmp_path, stopping_model_dir, partial):
    """Also with partial rollouts (a push lands between two decode steps of running requests)."""
    out = tmp_path / "run"
    assert train(out, stopping_model_dir, 5, *ASYNC, f"engine.partial_rollouts={partial}") == 0
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
    assert train(out, stopping_model_dir, 5, *ASYNC) == 0
    monkeypatch.setattr(Learner, "train_step", real_step)
    assert [m["step"] for m in read_jsonl(out / "metrics.jsonl")] == [1, 2]
    manifest = json.loads((out / "checkpoints" / "step-000002" / "trainer.json").read_text())
    trained_before = {p for ps in _positions(out).values() for p in ps}
    pending = manifest["pending_positions"]
    assert pending and not set(pending) & trained_before  # in flight or ready, not trained
    assert manifest["data_position"] == len(trained_before) + len(pending)

    assert train(out, stopping_model_dir, 5, *ASYNC) == 0
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
        train(
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
    for m in metrics:
        assert m["groups_sampled"] >= m["dynamic/groups_kept"] >= 1
        assert 0 <= m["dynamic/extra_rounds"] <= 2
    assert (out / "report.html").is_file()


def _rows_by_group(out):
    groups: dict[str, list[dict]] = {}
    for r in read_jsonl(out / "trajectories.jsonl"):
        groups.setdefault(r["group_id"], []).append(r)
    return groups


def test_two_ranks_with_k_1(tmp_path, stopping_model_dir):
    """Rank 0 trains in its training thread while its event loop samples; rank 1 trains in its
    main thread: the collectives still meet, the bound holds and every group is trained once."""
    from tests.ranks import spawn_gloo
    from tests.test_distributed import HANG, _train_on_rank

    two = tmp_path / "two"
    # (_train_on_rank checkpoints every 2 steps, which fences the sampling ahead; 3 lets it run.)
    spawn_gloo(
        _train_on_rank, str(two), str(stopping_model_dir), 3, *ONE, HANG, "train.save_every=3"
    )
    assert _lags(two) == [0.0, 1.0, 1.0]
    assert sorted(p for ps in _positions(two).values() for p in ps) == list(range(6))


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


def test_staleness_with_recomputed_old_logprobs_needs_a_correction():
    """Also under the old name, which stays an alias of max_staleness: 1."""
    for k in ("train.max_staleness=1", "train.overlap_rollouts=true"):
        with pytest.raises(Exception, match="loss.tis"):
            load_config("examples/calculator.yaml", [k, "learner.old_logprobs=recompute"])
        cfg = load_config("examples/calculator.yaml", [k, *CORRECTED])
        assert cfg.train.max_staleness == 1
