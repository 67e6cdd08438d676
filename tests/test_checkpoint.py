"""Checkpoints: atomic, verified, the previous one used when the newest is damaged; a run killed
after its step-2 checkpoint and resumed equals an uninterrupted run."""

from __future__ import annotations

import json
import os
import random
import signal

import numpy as np
import pytest
import torch

from agentgrpo.run import checkpoint
from agentgrpo.run.log import read_jsonl
from tests.short_runs import by_step, train, train_exactly, weights


def _write(files: dict[str, bytes]):
    def write(d):
        for name, data in files.items():
            (d / name).write_bytes(data)

    return write


def _save(root, step, payload=b"weights"):
    return checkpoint.save(
        root,
        step,
        _write({"model.safetensors": payload, "learner.pt": b"opt" * step}),
        {"data_position": step * 4, "weight_version": str(step)},
        keep=3,
    )


def test_save_is_complete_and_verified(tmp_path):
    d = _save(tmp_path, 1)
    manifest = checkpoint.verify(d)
    assert manifest["step"] == 1 and manifest["data_position"] == 4
    assert set(manifest["files"]) == {"model.safetensors", "learner.pt"}
    assert not list(tmp_path.glob(".tmp-*"))


@pytest.mark.parametrize("damage", ["truncate", "flip", "no_manifest", "missing_file", "bad_json"])
def test_damaged_newest_checkpoint_falls_back_to_the_previous(tmp_path, damage):
    _save(tmp_path, 1)
    newest = _save(tmp_path, 2)
    target = newest / "model.safetensors"
    if damage == "truncate":
        target.write_bytes(target.read_bytes()[:3])
    elif damage == "flip":
        data = bytearray(target.read_bytes())
        data[0] ^= 1
        target.write_bytes(bytes(data))
    elif damage == "no_manifest":
        (newest / checkpoint.MANIFEST).unlink()
    elif damage == "missing_file":
        (newest / "learner.pt").unlink()
    else:
        (newest / checkpoint.MANIFEST).write_text("{not json")
    with pytest.warns(UserWarning, match="skipping checkpoint .*step-000002"):
        found = checkpoint.latest(tmp_path)
    assert found is not None and found[1]["step"] == 1


def test_leftover_temp_dirs_are_removed_and_old_ones_pruned(tmp_path):
    for step in (7, 9):  # saves killed half-way, of steps the resumed run never saves again
        (tmp_path / f".tmp-step-00000{step}").mkdir(parents=True)
        (tmp_path / f".tmp-step-00000{step}" / "model.safetensors").write_bytes(b"partial")
    assert checkpoint.latest(tmp_path) is None
    for s in range(1, 6):
        _save(tmp_path, s)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step-000003",
        "step-000004",
        "step-000005",
    ]
    assert checkpoint.latest(tmp_path)[1]["step"] == 5


def test_save_never_prunes_the_checkpoint_it_wrote(tmp_path):
    """Pruning keeps the new checkpoint and the `keep - 1` newest ones numbered below it, by number
    (step-1000000 is newer than step-999999, though its name sorts first); checkpoints numbered
    above it are set aside, not pruned and not resumed over it."""
    for s in (1, 2, 999_999):
        _save(tmp_path, s)
    write = _write({"model.safetensors": b"w"})
    checkpoint.save(tmp_path, 1_000_000, write, {"data_position": 0}, keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-1000000"]
    _save(tmp_path, 999_999)
    checkpoint.save(tmp_path, 500, write, {"data_position": 0}, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "rejected-step-1000000",
        "rejected-step-999999",
        "step-000500",
    ]
    assert checkpoint.latest(tmp_path)[1]["step"] == 500


def test_resuming_sets_newer_skipped_checkpoints_aside(tmp_path):
    """A resume that fell back from a bad step 20 to step 10 renames step 20 out of the run: the
    run's next save (step 15) survives even with keep=1, and a later resume returns to step 15,
    not to the step 20 that an earlier load only rejected transiently (kept as rejected-step-*)."""
    for s in (10, 20):
        _save(tmp_path, s)
    calls = []

    def flaky_load(d):
        calls.append(d.name)
        if len(calls) == 1:
            raise OSError("NFS hiccup")  # step 20 fails once, then would load

    with pytest.warns(UserWarning, match="step-000020: OSError: NFS hiccup"):
        d, manifest = checkpoint.restore(tmp_path, flaky_load)
    assert manifest["step"] == 10
    assert checkpoint.set_aside_newer(tmp_path, 10) == [tmp_path / "rejected-step-000020"]
    checkpoint.save(tmp_path, 15, _write({"learner.pt": b"15"}), {"data_position": 15}, keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rejected-step-000020", "step-000015"]
    assert checkpoint.restore(tmp_path, flaky_load)[1]["step"] == 15
    assert checkpoint.verify(tmp_path / "rejected-step-000020")["step"] == 20  # nothing lost
    _save(tmp_path, 20)  # the same number set aside twice gets its own name
    assert checkpoint.set_aside_newer(tmp_path, 15) == [tmp_path / "rejected-step-000020.2"]


def test_rejected_checkpoints_are_kept_under_the_keep_rule(tmp_path):
    """Issue 33: a rejected checkpoint (1.3 GB) was kept forever. Each save keeps the `keep`
    newest set-aside ones, by step then by the `.N` of a step set aside again."""
    for s in (10, 20, 30):
        _save(tmp_path, s)
    checkpoint.set_aside_newer(tmp_path, 10)  # 20 and 30 rejected
    _save(tmp_path, 20)
    _save(tmp_path, 30)
    checkpoint.set_aside_newer(
        tmp_path, 10
    )  # again: rejected-step-000020.2, rejected-step-000030.2
    assert [d.name for d in checkpoint.rejected_checkpoints(tmp_path)] == [
        "rejected-step-000020",
        "rejected-step-000020.2",
        "rejected-step-000030",
        "rejected-step-000030.2",
    ]
    _save(tmp_path, 11)  # keep=3
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "rejected-step-000020.2",
        "rejected-step-000030",
        "rejected-step-000030.2",
        "step-000010",
        "step-000011",
    ]
    checkpoint.save(tmp_path, 12, _write({"learner.pt": b"12"}), {"data_position": 12}, keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rejected-step-000030.2", "step-000012"]
    assert checkpoint.verify(tmp_path / "rejected-step-000030.2")["step"] == 30


def test_strict_restore_names_every_checkpoint_and_why_none_loads(tmp_path):
    _save(tmp_path, 1)
    (_save(tmp_path, 2) / "learner.pt").write_bytes(b"truncated")

    def load(d):
        raise ValueError("does not match the model")

    with pytest.warns(UserWarning), pytest.raises(checkpoint.NoUsableCheckpoint) as e:
        checkpoint.restore(tmp_path, load, strict=True)
    assert "step-000002: CorruptCheckpoint: learner.pt has 9 bytes" in str(e.value)
    assert "step-000001: ValueError: does not match the model" in str(e.value)
    assert list(e.value.reasons) == [tmp_path / "step-000002", tmp_path / "step-000001"]
    with pytest.warns(UserWarning):
        assert checkpoint.restore(tmp_path, load) is None  # not strict: None, as for no checkpoint
    assert checkpoint.restore(tmp_path / "none", load, strict=True) is None


def test_restore_skips_a_checkpoint_the_learner_rejects(tmp_path):
    _save(tmp_path, 1)
    _save(tmp_path, 2, payload=b"other model")
    loaded = []

    def load(d):
        if (d / "model.safetensors").read_bytes() != b"weights":
            raise ValueError("does not match the model")
        loaded.append(d.name)

    with pytest.warns(UserWarning, match="step-000002: ValueError: does not match"):
        d, manifest = checkpoint.restore(tmp_path, load)
    assert loaded == ["step-000001"] and manifest["step"] == 1
    assert checkpoint.restore(tmp_path / "none", load) is None


def test_restore_skips_what_another_rank_rejected_on_every_rank(tmp_path):
    """Many ranks: a checkpoint that another rank failed to load (the `all_ranks` vote) is skipped
    here too, and a rank that does not check checksums still sees the manifest."""
    _save(tmp_path, 1)
    newest = _save(tmp_path, 2)
    (newest / "model.safetensors").write_bytes(b"corrupt")  # only a checking rank would notice
    votes, loaded = (
        iter([True, False, True, True]),
        [],
    )  # step 2 verifies here, fails to load elsewhere
    with pytest.warns(UserWarning, match="step-000002: rejected on another rank"):
        d, manifest = checkpoint.restore(
            tmp_path,
            lambda d: loaded.append(d.name),
            check=False,
            all_ranks=lambda ok: ok and next(votes),
        )
    assert loaded == ["step-000002", "step-000001"] and manifest["step"] == 1


def test_rng_state_round_trip():
    state = checkpoint.rng_state()
    json.dumps(state)  # it goes into trainer.json
    draws = (random.random(), np.random.rand(), torch.rand(1).item())
    checkpoint.set_rng_state(state)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == draws


def test_stop_requested_turns_sigterm_into_a_flag():
    with checkpoint.StopRequested() as stop:
        assert not stop
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


# --- end to end: kill + resume == uninterrupted ------------------------------------------------


def test_four_steps_equal_two_steps_killed_and_resumed(tmp_path, stopping_model_dir, monkeypatch):
    tiny_model_dir = stopping_model_dir
    straight = tmp_path / "straight"
    assert train_exactly(straight, tiny_model_dir, 4, "train.save_every=2") == 0

    from agentgrpo.learner.learner import Learner

    calls = {"n": 0}
    real_step = Learner.train_step

    def dies_in_step_4(self, *a, **kw):
        calls["n"] += 1
        if calls["n"] == 4:
            raise RuntimeError(
                "killed"
            )  # the process dies in step 4: step 3 is logged, not checkpointed
        return real_step(self, *a, **kw)

    killed = tmp_path / "killed"
    monkeypatch.setattr(Learner, "train_step", dies_in_step_4)
    with pytest.raises(RuntimeError, match="killed"):
        train_exactly(killed, tiny_model_dir, 4, "train.save_every=2")
    monkeypatch.setattr(Learner, "train_step", real_step)
    assert [m["step"] for m in read_jsonl(killed / "metrics.jsonl")] == [1, 2, 3]
    step3 = [r for r in read_jsonl(killed / "trajectories.jsonl") if r["step"] == 3]
    assert train_exactly(killed, tiny_model_dir, 4, "train.save_every=2") == 0

    # step 3 trained again from the step-2 checkpoint: its first rows went aside, not twice in the
    # logs
    assert [m["step"] for m in read_jsonl(killed / "metrics.jsonl")] == [1, 2, 3, 4]
    assert [m["step"] for m in read_jsonl(killed / "metrics.after-step-2.jsonl")] == [3]
    assert read_jsonl(killed / "trajectories.after-step-2.jsonl") == step3 and step3
    a, b = by_step(straight), by_step(killed)
    assert a == b  # same tasks, same sampled tokens, same rewards in every step
    assert len({r for s in a.values() for (_, _, r) in s}) > 1  # rewards vary: weights really train
    wa, wb = weights(straight, 4), weights(killed, 4)
    assert not torch.equal(
        wa["model.embed_tokens.weight"], weights(straight, 2)["model.embed_tokens.weight"]
    )
    for name, t in wa.items():
        torch.testing.assert_close(wb[name], t, atol=1e-6, rtol=1e-5, msg=name)
    ma = read_jsonl(straight / "metrics.jsonl")
    mb = read_jsonl(killed / "metrics.jsonl")
    assert [m["loss"] for m in ma] == pytest.approx([m["loss"] for m in mb], abs=1e-6)


def test_resume_uses_the_previous_checkpoint_when_the_newest_is_truncated(tmp_path, tiny_model_dir):
    out = tmp_path / "run"
    assert train(out, tiny_model_dir, 2, "train.save_every=1") == 0
    newest = out / "checkpoints" / "step-000002" / "model.safetensors"
    newest.write_bytes(newest.read_bytes()[:100])
    with pytest.warns(UserWarning, match="step-000002"):
        assert train(out, tiny_model_dir, 3, "train.save_every=1") == 0
    assert [m["step"] for m in read_jsonl(out / "metrics.jsonl")] == [1, 2, 3]  # step 2 redone
    assert [m["step"] for m in read_jsonl(out / "metrics.after-step-1.jsonl")] == [
        2
    ]  # its first try
    # The skipped step 2 was set aside when the run resumed from step 1, not overwritten or pruned.
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "rejected-step-000002",
        "step-000002",
        "step-000003",
    ]


def test_a_run_whose_checkpoints_all_fail_to_load_stops_instead_of_restarting(
    tmp_path, tiny_model_dir, capsys
):
    out = tmp_path / "run"
    assert train(out, tiny_model_dir, 2, "train.save_every=1") == 0
    before = {
        f: (out / f).read_bytes() for f in ("metrics.jsonl", "trajectories.jsonl", "config.yaml")
    }
    with pytest.warns(
        UserWarning, match="skipping checkpoint"
    ):  # LoRA now: no full checkpoint fits
        assert train(out, tiny_model_dir, 4, "train.save_every=1", "learner.lora.r=4") == 2
    err = capsys.readouterr().err
    assert "error: no checkpoint under" in err and "config.yaml" in err
    for step in (2, 1):
        assert (
            f"step-00000{step}: FileNotFoundError: " in err
        )  # each one, with its reason (no adapter)
    assert {f: (out / f).read_bytes() for f in before} == before  # the run directory is untouched
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000001", "step-000002"]


def test_two_fresh_runs_with_one_seed_train_the_same_weights(tmp_path, stopping_model_dir):
    """Nothing reseeds torch's global RNG after the run's seed (the local engine has its own
    generator): LoRA dropout draws the same masks, so the adapters are equal, not only the
    tokens."""
    from safetensors.torch import load_file

    lora = ["learner.lora.r=4", "learner.lora.dropout=0.5", "learner.lr=1e-2", "loss.clip_high=100"]
    adapters = []
    for name in ("a", "b"):
        assert train_exactly(tmp_path / name, stopping_model_dir, 1, *lora) == 0
        adapters.append(
            load_file(tmp_path / name / "checkpoints" / "step-000001" / "adapter_model.safetensors")
        )
    assert by_step(tmp_path / "a") == by_step(tmp_path / "b")
    for k, t in adapters[0].items():
        assert torch.equal(adapters[1][k], t), k


def test_sigterm_saves_the_finished_step_and_exits(tmp_path, tiny_model_dir, monkeypatch):
    from agentgrpo.learner.learner import Learner

    real_step = Learner.train_step

    def preempted(self, *a, **kw):
        out = real_step(self, *a, **kw)
        if self.step == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # arrives while step 1 is in progress
        return out

    monkeypatch.setattr(Learner, "train_step", preempted)
    out = tmp_path / "run"
    assert train(out, tiny_model_dir, 4) == 0  # save_every=0: only the stop's checkpoint is written
    assert [m["step"] for m in read_jsonl(out / "metrics.jsonl")] == [1]
    assert checkpoint.latest(out / "checkpoints")[1]["step"] == 1


def test_a_lora_run_checkpoints_its_adapter_and_resumes(tmp_path, stopping_model_dir):
    out = tmp_path / "run"
    lora = ["learner.lora.r=4", "loss.kl_coef=0.1", "learner.lr=1e-2"]
    assert train(out, stopping_model_dir, 2, *lora) == 0
    files = {p.name for p in (out / "checkpoints" / "step-000002").iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json", "learner.pt"} <= files
    assert "model.safetensors" not in files  # the base weights come from model.path
    assert train(out, stopping_model_dir, 3, *lora) == 0  # every push verified the merged weights
    assert [m["step"] for m in read_jsonl(out / "metrics.jsonl")] == [1, 2, 3]


def test_time_based_checkpoints_and_overlap_never_crosses_one(tmp_path, stopping_model_dir):
    """train.save_every_s checkpoints after any step that starts training that long after the last
    checkpoint; with overlapped rollouts such a step samples nothing ahead (resume stays exact)."""
    out = tmp_path / "every-step"
    assert (
        train(
            out,
            stopping_model_dir,
            3,
            "train.save_every_s=0.001",
            "train.keep_checkpoints=5",
            "train.overlap_rollouts=true",
            "learner.old_logprobs=recompute",
            "loss.tis=token",
        )
        == 0
    )
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        f"step-00000{i}" for i in (1, 2, 3)
    ]
    assert [m["policy_lag"] for m in read_jsonl(out / "metrics.jsonl")] == [0.0, 0.0, 0.0]

    off = tmp_path / "off"
    assert (
        train(
            off,
            stopping_model_dir,
            3,
            "train.save_every_s=null",
            "train.keep_checkpoints=5",
            "train.overlap_rollouts=true",
            "learner.old_logprobs=recompute",
            "loss.tis=token",
        )
        == 0
    )
    assert sorted(p.name for p in (off / "checkpoints").iterdir()) == [
        "step-000003"
    ]  # at the end only
    assert [m["policy_lag"] for m in read_jsonl(off / "metrics.jsonl")] == [0.0, 1.0, 1.0]


def test_cuda_rng_states_are_restored_onto_the_devices_there_are(monkeypatch):
    # a checkpoint written on 4 GPUs, resumed where one is visible: torch's set_rng_state_all would
    # index a 2nd device that does not exist
    set_on: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, device: set_on.append(device))
    monkeypatch.setattr(
        torch.cuda, "get_rng_state_all", lambda: [torch.zeros(8, dtype=torch.uint8)] * 4
    )
    state = checkpoint.rng_state()
    assert len(state["cuda"]) == 4
    checkpoint.set_rng_state(state)
    assert set_on == [0]
