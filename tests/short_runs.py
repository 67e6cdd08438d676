"""Short training runs for tests: the calculator config (or another) cut to a few tiny steps on a
test model, a reward that varies so the weights really move, and readers of what a run wrote.
Imported by the tests that train end to end (checkpoint, resume, mixture, determinism, ...)."""

from __future__ import annotations

from fractions import Fraction

import torch

from agentgrpo.cli import main
from agentgrpo.run.log import read_jsonl
from envs.calculator import CalculatorEnv


class VariedRewardEnv(CalculatorEnv):
    """The calculator env with a reward that varies with the (random) answer, so a tiny random model
    gets non-zero advantages and its weights really move."""

    def reward(self, task, messages) -> float:
        return float(Fraction(len(messages[-1].content) % 3, 2))


VARIED_REWARD = (
    "env.name=tests.short_runs:VariedRewardEnv",
    "env.audit.reward_hacks=skip",  # a toy verifier: not what these tests check
)


# A learning rate at which a tiny model's weights move in a step, and no TensorBoard files.
MOVING = ("log.tensorboard=false", "learner.lr=1e-3")


def train_short(out, model_dir, steps, *extra, config="examples/calculator.yaml"):
    """`agentgrpo train CONFIG` for `steps` steps of 2 tasks x 2 trajectories of at most 12 new
    tokens on `model_dir`, the config's other settings kept; `extra` overrides come last. Returns
    the exit code."""
    return main(
        [
            "train",
            config,
            f"output_dir={out}",
            f"train.steps={steps}",
            f"model.path={model_dir}",
            "rollout.group_size=2",
            "rollout.tasks_per_step=2",
            "rollout.max_new_tokens=12",
            "rollout.max_tokens=40",
            "log.progress=false",
            *extra,
        ]
    )


def train(out, model_dir, steps, *extra):
    """`train_short` on the calculator with `VariedRewardEnv` and `MOVING`."""
    return train_short(out, model_dir, steps, *VARIED_REWARD, *MOVING, *extra)


def train_exactly(out, model_dir, steps, *extra):
    """`train` with `deterministic=true`, for tests that compare two runs' weights bit for bit
    (the engine's batching changes a logprob's last bits otherwise, and the weights with it: seen
    under load); torch's process-wide setting is put back for the tests that follow."""
    try:
        return train(out, model_dir, steps, *extra, "deterministic=true")
    finally:
        torch.use_deterministic_algorithms(False)


def by_step(out) -> dict:
    """Each step's trajectories as sorted (group, token ids, reward) triples (equal runs: equal)."""
    rows = read_jsonl(out / "trajectories.jsonl")
    return {
        s: sorted((r["group_id"], r["token_ids"], r["reward"]) for r in rows if r["step"] == s)
        for s in {r["step"] for r in rows}
    }


def weights(out, step) -> dict[str, torch.Tensor]:
    """The model weights of the run's step-`step` checkpoint."""
    from safetensors.torch import load_file

    return load_file(out / "checkpoints" / f"step-{step:06d}" / "model.safetensors")
