"""Group advantages: one per trajectory (outcome-only) or one per turn (turn-level).

Outcome-only estimators (`ESTIMATORS`: grpo, dr_grpo, rloo) give a trajectory one number, which
the loss broadcasts to its sampled tokens; turn-level ones (`TURN_ESTIMATORS`: turn_grpo) also read
`Trajectory.turn_rewards` and give each turn its own. Groups are named by an id per row, never by
position. For every estimator (`compute_advantages`): a NaN reward (unscorable) is left out of its
group's statistics and gets 0; a group with fewer than two scorable rewards, or all of them exactly
equal (checked as max == min), gets exactly 0; an infinite reward raises. Statistics run in
float64. The formulas and the turn term's rules: docs/learner.md ("Advantages").
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Sequence
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

GroupIds = torch.Tensor | Sequence[Hashable]
Estimator = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
# (rewards_B, turn_rewards_BK, num_turns_B, group_index_B, eps, gamma, turn_weight) -> [B, K]
TurnEstimator = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, float, float], torch.Tensor
]


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


def discounted_returns(turn_rewards_BK: torch.Tensor, gamma: float) -> torch.Tensor:
    """[B, K] return-to-go of every turn: R_k = r_k + gamma * R_{k+1}, R_{K-1} = r_{K-1}, in
    float64. A NaN reward makes its own and every earlier turn's return NaN (what it would have
    added is unknown). Pad turns a row does not have with 0, not NaN."""
    r_BK = turn_rewards_BK.double()
    out_BK = torch.empty_like(r_BK)
    acc_B = r_BK.new_zeros(r_BK.shape[0])
    for k in reversed(range(r_BK.shape[1])):
        acc_B = r_BK[:, k] + gamma * acc_B
        out_BK[:, k] = acc_B
    return out_BK


def turn_grpo_advantages(
    rewards_B: torch.Tensor,
    turn_rewards_BK: torch.Tensor,
    num_turns_B: torch.Tensor,
    group_index_B: torch.Tensor,
    eps: float,
    gamma: float,
    turn_weight: float,
) -> torch.Tensor:
    """Turn-level GRPO: A_{i,k} = A_i + turn_weight * (R_{i,k} - mean_k) / (std_k + eps).

    A_i is the grpo advantage of trajectory i's reward (edge cases as `compute_advantages`).
    R_{i,k} = sum_{j >= k} gamma^(j - k) r_{i,j} is its return-to-go from turn k over its turn
    rewards; mean_k and std_k (Bessel) are over the members of i's group that have a turn k and a
    scorable return there, so turn k of one member is compared with turn k of the others (as
    MT-GRPO compares turn-level rewards across a group). The turn term is exactly 0 where fewer
    than two members have turn k, where their returns are all equal, and for a member whose
    return at k is NaN; a member whose reward is NaN (unscorable) gets 0 at every turn and is in
    no turn's statistics. Entries k >= num_turns_B[i] are NaN (no such turn).
    """
    B, K = turn_rewards_BK.shape
    num_groups = int(group_index_B.max().item()) + 1 if B else 0
    outcome_B = compute_advantages(rewards_B.double(), group_index_B, "grpo", eps)
    has_BK = torch.arange(K, device=rewards_B.device)[None, :] < num_turns_B[:, None]
    scorable_B = ~torch.isnan(rewards_B.double())
    padded_BK = torch.where(has_BK, turn_rewards_BK.double(), 0.0)
    returns_BK = discounted_returns(padded_BK, gamma)
    turn_BK = torch.zeros_like(returns_BK)
    for k in range(K):
        present_B = has_BK[:, k] & scorable_B
        r_B = torch.where(present_B, returns_BK[:, k], math.nan)
        s = GroupStats(r_B, group_index_B, num_groups)
        keep_B = s.scorable_B & s.informative_G[group_index_B]
        z_B = (r_B - s.mean_G[group_index_B]) / (s.std_G[group_index_B] + eps)
        turn_BK[:, k] = torch.where(keep_B, z_B, 0.0)
    adv_BK = outcome_B[:, None] + turn_weight * turn_BK
    return torch.where(has_BK, adv_BK, math.nan)


TURN_ESTIMATORS: dict[str, TurnEstimator] = {"turn_grpo": turn_grpo_advantages}


def estimator_names() -> list[str]:
    """Every name `advantage.estimator` accepts: outcome-only, then turn-level."""
    return [*ESTIMATORS, *TURN_ESTIMATORS]


def is_turn_level(name: str) -> bool:
    """Whether `name` is a turn-level estimator (one advantage per turn; see the module doc)."""
    return name in TURN_ESTIMATORS


def get_estimator(name: str) -> Estimator:
    """The outcome-only estimator registered under `name`; raises ValueError listing the valid
    names (a turn-level name is refused here: it needs turn rewards, `compute_turn_advantages`)."""
    if is_turn_level(name):
        raise ValueError(
            f"advantage estimator {name!r} is turn-level: it needs turn rewards "
            f"(compute_turn_advantages); outcome-only: {sorted(ESTIMATORS)}"
        )
    if name not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; valid: {sorted(ESTIMATORS)}")
    return ESTIMATORS[name]


def get_turn_estimator(name: str) -> TurnEstimator:
    """The turn-level estimator registered under `name`; raises ValueError listing the valid
    names."""
    if name not in TURN_ESTIMATORS:
        raise ValueError(
            f"unknown turn-level advantage estimator {name!r}; valid: {list(TURN_ESTIMATORS)}"
        )
    return TURN_ESTIMATORS[name]


def compute_turn_advantages(
    rewards_B: torch.Tensor,
    turn_rewards: Sequence[Sequence[float]],
    group_ids_B: GroupIds,
    estimator: str = "turn_grpo",
    eps: float = 1e-6,
    *,
    gamma: float = 1.0,
    turn_weight: float = 1.0,
) -> list[list[float]]:
    """One advantage per turn per row (see `turn_grpo_advantages` for the formula and edge cases).

    Args:
        rewards_B: [B] outcome rewards (what the outcome term normalises), NaN where unscorable.
        turn_rewards: per row, the reward of each of its turns, in order; rows may have different
            numbers of turns (a turn the env never answered earned 0: the caller pads it).
        group_ids_B: [B] group id per row, as `compute_advantages`.
        estimator: a name in `TURN_ESTIMATORS`.
        eps: added to each std before dividing.
        gamma: discount of later turns' rewards in a turn's return, in (0, 1].
        turn_weight: weight of the turn term against the outcome term, >= 0.

    Returns:
        Per row, a list as long as its `turn_rewards` entry: that turn's advantage (a Python
        float, computed in float64); exactly the outcome advantage where the turn term is 0.

    Example (both answered right, only the first used the tool right: its first turn gets the
    credit; the answer turns' returns are equal, so they keep the outcome advantage alone):
        >>> import torch
        >>> from agentgrpo.algo.advantage import compute_turn_advantages
        >>> adv = compute_turn_advantages(
        ...     torch.tensor([1.5, 1.0]), [[0.5, 1.0], [0.0, 1.0]], [0, 0], eps=0.0
        ... )
        >>> [[round(a, 4) for a in row] for row in adv]
        [[1.4142, 0.7071], [-1.4142, -0.7071]]
    """
    fn = get_turn_estimator(estimator)
    if not 0.0 < gamma <= 1.0:
        raise ValueError(f"gamma must be in (0, 1], got {gamma}")
    if not turn_weight >= 0.0:
        raise ValueError(f"turn_weight must be >= 0, got {turn_weight}")
    rewards_B = _check_rewards(rewards_B)
    if len(turn_rewards) != len(rewards_B):
        raise ValueError(f"{len(turn_rewards)} turn-reward lists but {len(rewards_B)} rewards")
    group_index_B, _ = group_index(group_ids_B, len(rewards_B), rewards_B.device)
    num_turns_B = torch.tensor([len(r) for r in turn_rewards], dtype=torch.long)
    K = int(num_turns_B.max()) if len(turn_rewards) else 0
    turn_rewards_BK = torch.zeros(len(turn_rewards), K, dtype=torch.float64)
    for i, r in enumerate(turn_rewards):
        turn_rewards_BK[i, : len(r)] = torch.tensor([float(x) for x in r], dtype=torch.float64)
    if torch.isinf(turn_rewards_BK).any():
        raise ValueError("turn_rewards contain inf; an unscorable turn reward must be NaN")
    with torch.no_grad():
        adv_BK = fn(rewards_B, turn_rewards_BK, num_turns_B, group_index_B, eps, gamma, turn_weight)
    return [adv_BK[i, :n].tolist() for i, n in enumerate(num_turns_B.tolist())]


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

    Example (group "b" has one member: no signal, so 0):
        >>> import torch
        >>> from agentgrpo.algo.advantage import compute_advantages
        >>> compute_advantages(torch.tensor([1.0, 0.0, 0.0, 5.0]), ["a", "a", "a", "b"], "rloo")
        tensor([ 1.0000, -0.5000, -0.5000,  0.0000])
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

    estimator: Literal["grpo", "dr_grpo", "rloo", "turn_grpo"] = Field(
        "grpo",
        description="grpo: (r - group mean) / (group std + eps); dr_grpo: r - group mean; "
        "rloo: r - mean of the other members of the group; turn_grpo (turn-level): grpo of r "
        "plus turn_weight x the grpo-normalised return-to-go of each turn, per turn's tokens.",
    )
    eps: float = Field(
        1e-6, ge=0, description="Added to the std before dividing (verl: 1e-6, TRL: 1e-4)."
    )
    batch_std: bool = Field(
        False,
        description="Divide group-centered advantages by the std of the whole batch's rewards "
        "instead of each group's (TRL scale_rewards='batch').",
    )
    gamma: float = Field(
        1.0,
        gt=0,
        le=1,
        description="turn_grpo: discount of later turns' rewards in a turn's return-to-go "
        "(1 = undiscounted).",
    )
    turn_weight: float = Field(
        1.0, ge=0, description="turn_grpo: weight of the per-turn term against the outcome term."
    )

    @model_validator(mode="after")
    def _turn_fields_need_a_turn_estimator(self) -> AdvantageConfig:
        if is_turn_level(self.estimator):
            if self.batch_std:
                raise ValueError(
                    f"batch_std is not supported by the turn-level estimator {self.estimator!r}"
                )
        elif self.gamma != 1.0 or self.turn_weight != 1.0:
            raise ValueError(
                f"gamma and turn_weight apply only to a turn-level estimator "
                f"({list(TURN_ESTIMATORS)}); estimator {self.estimator!r} is outcome-only"
            )
        return self
