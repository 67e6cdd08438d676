"""Tiny random models and trajectories for the learner tests (fast on a shared 2-core CPU)."""

from __future__ import annotations

import itertools
import math
import random

import torch

from agentgrpo.learner.batch import training_rows
from agentgrpo.types import Advantage, StopReason, TrainingRow, Trajectory

V = 97


def tiny_llama(attn: str = "sdpa", seed: int = 0, **config):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        attn_implementation=attn,
        **config,
    )
    return LlamaForCausalLM(cfg).eval()


_numbers = itertools.count()


def traj(ids, mask, group="g", reward=0.0, lp=-1.0) -> Trajectory:
    prompt_len = mask.index(1)
    return Trajectory(
        id=f"{group}/{next(_numbers)}",
        task_id=group,
        token_ids=list(ids),
        loss_mask=list(mask),
        logprobs=[lp if m else 0.0 for m in mask],
        prompt_len=prompt_len,
        messages=[],
        stop_reason=StopReason.COMPLETED,
        group_id=group,
        reward=reward,
    )


def groups_of_trajectories(n_groups=3, size=4, seed=0) -> list[Trajectory]:
    """Multi-turn shaped: prompt, response, tool output (mask 0), second response."""
    rng = random.Random(seed)
    out = []
    for g in range(n_groups):
        prompt = [rng.randrange(V) for _ in range(rng.randint(5, 20))]
        for k in range(size):
            parts = [
                (prompt, 0),
                ([rng.randrange(V) for _ in range(rng.randint(1, 15))], 1),
                ([rng.randrange(V) for _ in range(rng.randint(0, 5))], 0),
                ([rng.randrange(V) for _ in range(rng.randint(0, 5))], 1),
            ]
            ids = [t for p, _ in parts for t in p]
            mask = [m for p, m in parts for _ in p]
            out.append(traj(ids, mask, group=f"g{g}", reward=float(k % 2), lp=-0.5 - k))
    return out


def rows(trajs, advantages, per_turn=None) -> list[TrainingRow]:
    """What the loop trains `trajs` on, `advantages[i]` each (NaN: not trained on, so no row) and
    `per_turn[i]` (one advantage per sampled turn) when given: `training_rows`."""
    joined = {
        t.id: Advantage(t.id, a, None if per_turn is None else per_turn[i])
        for i, (t, a) in enumerate(zip(trajs, advantages, strict=True))
        if math.isfinite(a)
    }
    return training_rows(trajs, joined)
