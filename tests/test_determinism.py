"""`deterministic: true`: two runs and a SIGTERM-and-resume run of the default config (the embedded
model, precision auto, which is bf16 autocast on a CPU with native bf16) have the same tokens,
losses and weights, bit for bit; and without it, the bound docs/learner.md states for a default
run ("Reproducible runs"). Each run is a subprocess: bf16 needs AGENTGRPO_CPU_BF16=1 (the suite sets
0, tests/conftest.py), and torch's deterministic mode is process-wide."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from agentgrpo.run.log import read_jsonl
from tests.short_runs import VARIED_REWARD

ROOT = Path(__file__).resolve().parent.parent
# The default config, shortened: 3 steps of 2 tasks x 4 trajectories (the default: 10 x 2 x 8),
# with a reward that varies with the answer's length: the calculator's own gave every group one
# reward on a CI machine (all three losses 0, nothing to compare).
SHORT = (
    *VARIED_REWARD,
    "train.steps=3",
    "rollout.group_size=4",
    "rollout.tasks_per_step=2",
    "log.progress=false",
    "log.tensorboard=false",
    "train.save_every_s=null",
)
# Runs the CLI; SIGTERM (as `kill` sends it) once the learner has trained step K, if K is given.
RUNNER = """
import os, signal, sys
from agentgrpo.cli import main  # first: it sets the thread environment before torch loads
from agentgrpo.learner.learner import Learner
stop_after, real, calls = int(sys.argv[1]), Learner.train_step, []
def train_step(self, *a, **kw):
    metrics = real(self, *a, **kw)
    calls.append(1)
    if len(calls) == stop_after:
        os.kill(os.getpid(), signal.SIGTERM)
    return metrics
Learner.train_step = train_step
sys.exit(main(sys.argv[2:]))
"""


def _native_bf16() -> tuple[bool, str]:
    from agentgrpo.models.hardware import FORCE_ENV, cpu_native_bf16

    forced = os.environ.pop(FORCE_ENV, None)  # the CPU's own answer, not the suite's
    try:
        return cpu_native_bf16()
    finally:
        if forced is not None:
            os.environ[FORCE_ENV] = forced


NATIVE, WHY = _native_bf16()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not NATIVE,
        reason=f"needs a CPU with native bf16, where precision auto picks bf16 autocast ({WHY})",
    ),
]


def _train(out: Path, *extra: str, stop_after: int = 0) -> None:
    argv = ["train", "examples/calculator.yaml", f"output_dir={out}", *SHORT, *extra]
    env = {**os.environ, "AGENTGRPO_CPU_BF16": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", RUNNER, str(stop_after), *argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "precision: learner bf16 autocast" in done.stdout, done.stdout[-3000:]


def _losses(out: Path) -> list[float]:
    return [m["loss"] for m in read_jsonl(out / "metrics.jsonl")]


def _samples(out: Path) -> list[tuple]:
    rows = read_jsonl(out / "trajectories.jsonl")
    return sorted(
        (r["step"], r["group_id"], r["token_ids"], r["logprobs"], r["reward"]) for r in rows
    )


def _weights(out: Path, step: int) -> dict:
    from safetensors.torch import load_file

    return load_file(out / "checkpoints" / f"step-{step:06d}" / "model.safetensors")


def test_deterministic_runs_and_a_resumed_run_are_bit_identical(tmp_path):
    first, second, resumed = tmp_path / "first", tmp_path / "second", tmp_path / "resumed"
    _train(first, "deterministic=true")
    _train(second, "deterministic=true")
    _train(resumed, "deterministic=true", stop_after=2)  # SIGTERM in step 2: it saves and exits
    assert [m["step"] for m in read_jsonl(resumed / "metrics.jsonl")] == [1, 2]
    _train(resumed, "deterministic=true")  # resumes from step 2's checkpoint
    losses = _losses(first)
    assert len(losses) == 3 and any(loss != 0 for loss in losses)  # something to compare
    assert _losses(second) == losses
    assert _losses(resumed) == losses
    assert _samples(second) == _samples(first) == _samples(resumed)
    weights = _weights(first, 3)
    for other in (second, resumed):
        got = _weights(other, 3)
        assert got.keys() == weights.keys()
        assert all(torch.equal(got[k], w) for k, w in weights.items()), other.name


def test_without_it_the_first_step_agrees_to_the_documented_bound(tmp_path):
    """Without `deterministic` the learner is bit-identical on the same rollouts, but the local
    engine batches rows as they arrive and a row's logits change in their last bits with its
    companions: the first step samples the same tokens (a flip needs a sampling draw within ~1e-6
    of a boundary) with logprobs within 1e-4, and its loss agrees within 1e-6."""
    runs = [tmp_path / "a", tmp_path / "b"]
    for out in runs:
        _train(out, "train.steps=1")
    (a, b) = (_samples(out) for out in runs)
    assert [(s, g, t, r) for s, g, t, _, r in a] == [(s, g, t, r) for s, g, t, _, r in b]
    gap = max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra[3], rb[3]))
    assert gap <= 1e-4
    (loss_a,), (loss_b,) = (_losses(out) for out in runs)
    assert abs(loss_a - loss_b) <= 1e-6
