"""Trajectories -> micro-batches of tensors for the learner.

A micro-batch holds whole trajectories whose padded size (rows x longest row) stays within a token
budget; trajectories are sorted by length first so rows of similar length share a micro-batch and
padding stays small. Every tensor is [B, T] with right padding; `loss_mask_BT` is 0 on padding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from agentgrpo.types import Trajectory


@dataclass
class TrainBatch:
    input_ids_BT: torch.Tensor  # [B, T] long
    attention_mask_BT: torch.Tensor  # [B, T] long, 1 on real tokens
    loss_mask_BT: torch.Tensor  # [B, T] float, 1 on sampled tokens
    rollout_logprobs_BT: torch.Tensor  # [B, T] float, the engine's sampling logprobs (0 elsewhere)
    advantages_B: torch.Tensor  # [B] float
    rows: list[int]  # index of each row in the step's trajectory list

    @property
    def num_tokens(self) -> int:
        return int(self.attention_mask_BT.sum())

    def to(self, device: torch.device | str) -> TrainBatch:
        return TrainBatch(*(t.to(device) for t in (self.input_ids_BT, self.attention_mask_BT, self.loss_mask_BT,
                                                   self.rollout_logprobs_BT, self.advantages_B)), self.rows)


def pad_batch(trajs: Sequence[Trajectory], advantages: Sequence[float], rows: list[int],
              pad_id: int = 0) -> TrainBatch:
    T = max(len(t.token_ids) for t in trajs)
    B = len(trajs)
    ids = torch.full((B, T), pad_id, dtype=torch.long)
    attn = torch.zeros((B, T), dtype=torch.long)
    mask = torch.zeros((B, T), dtype=torch.float32)
    lps = torch.zeros((B, T), dtype=torch.float32)
    for i, t in enumerate(trajs):
        n = len(t.token_ids)
        ids[i, :n] = torch.tensor(t.token_ids)
        attn[i, :n] = 1
        mask[i, :n] = torch.tensor(t.loss_mask, dtype=torch.float32)
        lps[i, :n] = torch.tensor(t.logprobs, dtype=torch.float32)
    return TrainBatch(ids, attn, mask, lps, torch.tensor(list(advantages), dtype=torch.float32), rows)


def make_micro_batches(trajs: Sequence[Trajectory], advantages: Sequence[float],
                       token_budget: int, pad_id: int = 0) -> list[TrainBatch]:
    """Split one step's trajectories into micro-batches of at most `token_budget` padded tokens
    (a single trajectory longer than the budget gets a micro-batch of its own)."""
    if len(trajs) != len(advantages):
        raise ValueError(f"{len(trajs)} trajectories but {len(advantages)} advantages")
    order = sorted(range(len(trajs)), key=lambda i: len(trajs[i].token_ids))
    batches: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        longest = len(trajs[i].token_ids)  # sorted ascending: the newest row is the longest
        if cur and (len(cur) + 1) * longest > token_budget:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return [pad_batch([trajs[i] for i in b], [advantages[i] for i in b], b, pad_id) for b in batches]
