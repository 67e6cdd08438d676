"""Group advantages: one scalar per trajectory from the rewards of its group.

Every estimator here is outcome-only: a trajectory's reward is one number, and its advantage is
broadcast to its sampled tokens by the loss. Groups are named by an explicit id per row (an int
tensor or a list of any hashable labels), never by position, so rows may come in any order, groups
may have unequal sizes and need not be contiguous.

Edge cases (the same for every estimator, applied once in `compute_advantages`):
- A NaN reward means "could not be scored" (an infrastructure failure). The row is left out of its
  group's statistics and gets advantage 0.
- A group with fewer than two scorable rewards, or whose scorable rewards are all exactly equal,
  carries no learning signal: all its rows get advantage exactly 0. Equality is checked explicitly
  (max == min) because a float formula alone leaves residues such as 1e-17 / (0 + eps) that are
  not zero and, with a small eps, not small.
- An infinite reward is a bug in a verifier, not a score: it raises.

Statistics are computed in float64 and the result is cast back to the rewards' dtype (float32 for
integer rewards).

Example:
    >>> import torch
    >>> compute_advantages(torch.tensor([1.0, 0.0, 0.0, 5.0]), ["a", "a", "a", "b"], "rloo")
    tensor([ 1.0000, -0.5000, -0.5000,  0.0000])
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

GroupIds = torch.Tensor | Sequence[Hashable]
Estimator = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]


class GroupStats:
    """Per-group statistics of the scorable (non-NaN) rewards, in float64. `G` = number of
    groups."""

    def __init__(self, rewards_B: torch.Tensor, group_index_B: torch.Tensor, num_groups: int):
        r = rewards_B.double()
        self.scorable_B = ~torch.isnan(r)
        r0_B = torch.where(self.scorable_B, r, 0.0)
        zeros_G = torch.zeros(num_groups, dtype=torch.float64, device=r.device)
        self.count_G = zeros_G.index_add(0, group_index_B, self.scorable_B.double())
        self.sum_G = zeros_G.index_add(0, group_index_B, r0_B)
        self.mean_G = self.sum_G / self.count_G.clamp(min=1)
        dev_B = torch.where(self.scorable_B, r0_B - self.mean_G[group_index_B], 0.0)
        ss_G = zeros_G.index_add(0, group_index_B, dev_B.square())
        # Bessel's correction (n - 1), as torch.std, numpy ddof=1, verl and TRL.
        self.std_G = (ss_G / (self.count_G - 1).clamp(min=1)).sqrt()
        idx_S, r_S = group_index_B[self.scorable_B], r[self.scorable_B]
        self.max_G = torch.full_like(zeros_G, -math.inf).scatter_reduce(0, idx_S, r_S, "amax")
        self.min_G = torch.full_like(zeros_G, math.inf).scatter_reduce(0, idx_S, r_S, "amin")
        # The exact-equality check: a group is informative only if two scorable rewards differ.
        self.informative_G = (self.count_G >= 2) & (self.max_G > self.min_G)


def grpo_advantages(
    rewards_B: torch.Tensor, group_index_B: torch.Tensor, eps: float
) -> torch.Tensor:
    """GRPO: A_i = (r_i - mean_g) / (std_g + eps), std with Bessel's correction, eps = 1e-6.

    Same as verl's `grpo` (eps 1e-6). TRL uses eps 1e-4 and also has `scale_rewards="batch"`,
    which is `compute_advantages(..., batch_std=True)` here.
    """
    s = _stats(rewards_B, group_index_B)
    return (rewards_B.double() - s.mean_G[group_index_B]) / (s.std_G[group_index_B] + eps)


def dr_grpo_advantages(
    rewards_B: torch.Tensor, group_index_B: torch.Tensor, eps: float
) -> torch.Tensor:
    """Dr. GRPO: A_i = r_i - mean_g (no division by the std, which favours easy and hard prompts).

    verl: `grpo` with `norm_adv_by_std_in_grpo=False`; TRL: `scale_rewards="none"`. The other half
    of Dr. GRPO, the constant-length loss normaliser, is `agg="seq-mean-token-sum-norm"` in loss.py.
    """
    s = _stats(rewards_B, group_index_B)
    return rewards_B.double() - s.mean_G[group_index_B]


def rloo_advantages(
    rewards_B: torch.Tensor, group_index_B: torch.Tensor, eps: float
) -> torch.Tensor:
    """RLOO: A_i = r_i - mean of the other n - 1 scorable members = n / (n - 1) * (r_i - mean_g).

    Same as verl's `rloo`. n counts only scorable members, so a NaN reward neither enters the
    baseline of the others nor the factor n / (n - 1).
    """
    s = _stats(rewards_B, group_index_B)
    n_B = s.count_G[group_index_B]
    return n_B / (n_B - 1).clamp(min=1) * (rewards_B.double() - s.mean_G[group_index_B])


ESTIMATORS: dict[str, Estimator] = {
    "grpo": grpo_advantages,
    "dr_grpo": dr_grpo_advantages,
    "rloo": rloo_advantages,
}


def get_estimator(name: str) -> Estimator:
    """The estimator registered under `name`; raises ValueError listing the valid names."""
    if name not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; valid: {sorted(ESTIMATORS)}")
    return ESTIMATORS[name]


def compute_advantages(
    rewards_B: torch.Tensor,
    group_ids_B: GroupIds,
    estimator: str = "grpo",
    eps: float = 1e-6,
    *,
    batch_std: bool = False,
) -> torch.Tensor:
    """One advantage per row from the rewards of its group (see the module docstring for edge
    cases).

    Args:
        rewards_B: [B] rewards, NaN where a trajectory could not be scored.
        group_ids_B: [B] group id per row: an integer tensor, or a list of any hashable labels.
        estimator: "grpo" | "dr_grpo" | "rloo".
        eps: added to the std before dividing (grpo and batch_std only).
        batch_std: center per group, then divide by (std of all scorable rewards of this call,
            Bessel) + eps ("group mean, batch std", TRL `scale_rewards="batch"`). With grpo it
            replaces the per-group std, so grpo and dr_grpo coincide under it; with rloo it scales.

    Returns:
        [B] advantages, no grad, the rewards' floating dtype: exactly 0 for unscorable rows and
        for every row of a group with no learning signal.
    """
    rewards_B = _check_rewards(rewards_B)
    group_index_B, num_groups = group_index(group_ids_B, len(rewards_B), rewards_B.device)
    if batch_std and estimator == "grpo":
        estimator = "dr_grpo"  # group mean here, batch std below
    fn = get_estimator(estimator)
    with torch.no_grad():
        adv_B = fn(rewards_B, group_index_B, eps)
        if batch_std:
            adv_B = adv_B / (batch_reward_std(rewards_B) + eps)
        s = _stats(rewards_B, group_index_B, num_groups)
        keep_B = s.scorable_B & s.informative_G[group_index_B]
        adv_B = torch.where(keep_B, adv_B, 0.0)
    return adv_B.to(rewards_B.dtype)


def batch_reward_std(rewards_B: torch.Tensor) -> torch.Tensor:
    """Std (Bessel) of the scorable rewards of the whole call; 0 when fewer than two are
    scorable."""
    r = rewards_B.double()
    r = r[~torch.isnan(r)]
    return r.std() if r.numel() >= 2 else r.new_zeros(())


def is_zero_variance(rewards: Sequence[float] | torch.Tensor) -> bool:
    """True when a group carries no learning signal: fewer than two scorable (non-NaN) rewards, or
    all of them exactly equal. The same rule decides advantage 0 here and dynamic sampling's
    filter."""
    vals = [float(x) for x in (rewards.tolist() if isinstance(rewards, torch.Tensor) else rewards)]
    vals = [x for x in vals if not math.isnan(x)]
    return len(vals) < 2 or max(vals) == min(vals)


def group_index(group_ids_B: GroupIds, n: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """Map arbitrary group ids to 0..G-1 in order of first appearance: ([B] long tensor, G).

    Labels are compared with `==`/hash, so 3, -3, 2**62, "task-7" and ("t", 0) are all fine; an
    integer tensor is read through `.tolist()` so huge int64 ids stay exact.
    """
    if isinstance(group_ids_B, torch.Tensor):
        if group_ids_B.dim() != 1:
            raise ValueError(f"group_ids_B must be 1-D, got shape {tuple(group_ids_B.shape)}")
        labels = group_ids_B.tolist()
    else:
        labels = list(group_ids_B)
    if len(labels) != n:
        raise ValueError(f"group_ids_B has {len(labels)} entries but rewards_B has {n}")
    index: dict[Hashable, int] = {}
    idx = [index.setdefault(label, len(index)) for label in labels]
    return torch.tensor(idx, dtype=torch.long, device=device), len(index)


def _check_rewards(rewards_B: torch.Tensor) -> torch.Tensor:
    if not isinstance(rewards_B, torch.Tensor):
        rewards_B = torch.as_tensor(rewards_B)
    if rewards_B.dim() != 1:
        raise ValueError(f"rewards_B must be 1-D [B], got shape {tuple(rewards_B.shape)}")
    if not rewards_B.is_floating_point():
        rewards_B = rewards_B.float()
    if torch.isinf(rewards_B).any():
        raise ValueError("rewards_B contains inf; an unscorable trajectory must have reward NaN")
    return rewards_B.detach()


def _stats(
    rewards_B: torch.Tensor, group_index_B: torch.Tensor, num_groups: int | None = None
) -> GroupStats:
    if num_groups is None:
        num_groups = int(group_index_B.max().item()) + 1 if group_index_B.numel() else 0
    return GroupStats(rewards_B, group_index_B, num_groups)


class AdvantageConfig(BaseModel):
    """How trajectory rewards become advantages (`compute_advantages`)."""

    model_config = ConfigDict(extra="forbid")

    estimator: Literal["grpo", "dr_grpo", "rloo"] = Field(
        "grpo",
        description="grpo: (r - group mean) / (group std + eps); dr_grpo: r - group mean; "
        "rloo: r - mean of the other members of the group.",
    )
    eps: float = Field(
        1e-6, ge=0, description="Added to the std before dividing (verl: 1e-6, TRL: 1e-4)."
    )
    batch_std: bool = Field(
        False,
        description="Divide group-centered advantages by the std of the whole batch's rewards "
        "instead of each group's (TRL scale_rewards='batch').",
    )
