"""Tiny random models and trajectories for the learner tests (fast on a shared 2-core CPU)."""

from __future__ import annotations

import random

import torch

from agentgrpo.types import StopReason, Trajectory

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


def traj(ids, mask, group="g", reward=0.0, lp=-1.0) -> Trajectory:
    prompt_len = mask.index(1)
    return Trajectory(
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
