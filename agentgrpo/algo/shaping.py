"""DAPO's reward shaping and sample filters, as pure functions, and the start-up algorithm summary.

- Overlong reward shaping: a linear penalty over the last `buffer_len` tokens before the length
  limit, added to the reward (`overlong_penalty`).
- Overlong filtering: trajectories cut off by the length limit (`truncated_rows`) can be left out
  of the loss (`mask_truncated`: the loop gives them a NaN advantage, which the learner drops),
  since their reward judges an unfinished answer.
- Dynamic sampling: groups whose scorable rewards are all equal give zero advantage and only dilute
  the batch; `keep_informative_groups` says which groups to keep. The training loop's scheduler
  replaces the dropped ones, at most `max_extra_rounds` steps' worth a step (run/pipeline.py).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field

from agentgrpo.algo.advantage import AdvantageConfig, is_turn_level, is_zero_variance
from agentgrpo.algo.loss import LossConfig
from agentgrpo.types import StopReason, Trajectory

# Which stop reasons count as "truncated" for overlong filtering: the token budget ran out mid-
# answer. MAX_TURNS is kept: running out of turns is the agent's own behaviour, judged fairly.
TRUNCATION_REASONS: frozenset[StopReason] = frozenset({StopReason.MAX_TOKENS})


class ShapingConfig(BaseModel):
    """DAPO-style reward shaping and sample filtering."""

    model_config = ConfigDict(extra="forbid")

    dynamic_sampling: bool = Field(
        False,
        description="Drop groups whose rewards are all equal and sample more tasks to refill the "
        "batch.",
    )
    max_extra_rounds: int = Field(
        3,
        ge=0,
        description="With dynamic_sampling: a step replaces at most this many times "
        "rollout.tasks_per_step dropped groups (extra rounds' worth); past that it trains fewer.",
    )
    overlong_buffer_len: int | None = Field(
        None,
        gt=0,
        description="Overlong shaping: penalise the last this-many tokens before the length limit "
        "(None: off).",
    )
    overlong_penalty_factor: float = Field(
        1.0, ge=0, description="Overlong shaping: the penalty reached at the length limit."
    )
    mask_truncated: bool = Field(
        False,
        description="Leave trajectories that hit the token limit out of the loss (DAPO overlong "
        "filtering).",
    )


def overlong_penalty(
    lengths_B: torch.Tensor, max_len: int, buffer_len: int, penalty_factor: float = 1.0
) -> torch.Tensor:
    """DAPO soft overlong punishment, added to the reward: with e = len - (max_len - buffer_len),

        penalty = 0                                   if e <= 0
                = -penalty_factor · e / buffer_len    if 0 < e <= buffer_len
                = -penalty_factor                     if len > max_len

    verl computes min(-e / buffer_len · factor, 0) without the last clamp; a length past max_len
    cannot occur there and agrees with the DAPO paper's -1 here. `lengths_B` counts the tokens the
    limit counts (for an agent: the trajectory's token budget, tool output included if it is).
    """
    if not 0 < buffer_len <= max_len:
        raise ValueError(f"overlong buffer_len must be in (0, max_len={max_len}], got {buffer_len}")
    exceed_B = lengths_B.double() - (max_len - buffer_len)
    penalty_B = (-exceed_B / buffer_len * penalty_factor).clamp(min=-penalty_factor, max=0.0)
    return penalty_B.float()


def shaped_rewards(
    trajs: Sequence[Trajectory], rewards: Sequence[float], cfg: ShapingConfig, max_tokens: int
) -> torch.Tensor:
    """[B] `rewards` (the trajectories' scores) after the overlong shaping `cfg` asks for (none:
    the rewards); NaN stays NaN. The length is the trajectory's tokens after its prompt (summed
    over a step-wise trajectory's segments, each after its own prompt), what `rollout.max_tokens`
    limits."""
    if len(rewards) != len(trajs):
        raise ValueError(f"{len(trajs)} trajectories but {len(rewards)} rewards")
    rewards_B = torch.tensor(list(rewards), dtype=torch.float32)
    if cfg.overlong_buffer_len:
        lengths = [sum(len(s.token_ids) - s.prompt_len for s in t.segments) for t in trajs]
        lengths_B = torch.tensor(lengths, dtype=torch.float32)
        rewards_B = rewards_B + overlong_penalty(
            lengths_B, max_tokens, cfg.overlong_buffer_len, cfg.overlong_penalty_factor
        )
    return rewards_B


def truncated_rows(
    stop_reasons: Iterable[StopReason | str], reasons: Collection[StopReason] = TRUNCATION_REASONS
) -> torch.Tensor:
    """[B] bool: which trajectories ended for one of `reasons` (default: the token limit)."""
    return torch.tensor([StopReason(s) in reasons for s in stop_reasons], dtype=torch.bool)


def keep_informative_groups(rewards_per_group: Sequence[Sequence[float]]) -> list[bool]:
    """Dynamic sampling's filter: keep a group iff at least two of its scorable (non-NaN) rewards
    differ (exact comparison), the same rule under which `compute_advantages` gives non-zero
    advantages. `Group.rewards` is one entry."""
    return [not is_zero_variance(rewards) for rewards in rewards_per_group]


def describe_algorithm(
    adv_cfg: AdvantageConfig, loss_cfg: LossConfig, shaping_cfg: ShapingConfig
) -> str:
    """The block printed at start-up that names the effective algorithm."""
    c = loss_cfg
    kl = (
        f"{c.kl_estimator}, beta = {c.kl_coef:g} (reference model loaded)"
        if c.kl_coef > 0
        else "off (no reference model)"
    )
    rows = [
        ("advantage", _describe_advantage(adv_cfg)),
        ("loss", _describe_loss(c)),
        ("aggregation", _describe_aggregation(c)),
        ("kl", kl),
        ("entropy", f"coef {c.entropy_coef:g}" if c.entropy_coef else "off"),
        ("tis", f"{c.tis}-level, cap {c.tis_cap:g}" if c.tis != "none" else "off"),
        ("mis", _describe_mis(c)),
        ("filters", _describe_filters(shaping_cfg)),
    ]
    return "algorithm:\n" + "\n".join(f"  {k:<13}{v}" for k, v in rows)


def _describe_advantage(a: AdvantageConfig) -> str:
    """The estimator's formula, and where it gives 0."""
    grpo = f"(r - group mean) / (group std + {a.eps:g})"
    discount = "" if a.gamma == 1.0 else f"{a.gamma:g}^(j-k) "
    est = {
        "grpo": f"grpo  A = {grpo}",
        "dr_grpo": "dr_grpo  A = r - group mean",
        "rloo": "rloo  A = r - mean of the other group members",
        "turn_grpo": f"turn_grpo  A_k = {grpo} + {a.turn_weight:g} * (R_k - mean_k) / "
        f"(std_k + {a.eps:g}) on turn k's tokens; R_k = sum_(j>=k) {discount}r_j over turn "
        "rewards, mean_k, std_k over the group's members with a turn k (turn term 0 where NaN, "
        "alone or equal at k)",
    }[a.estimator]
    if a.batch_std:
        centre = "mean of the other group members" if a.estimator == "rloo" else "group mean"
        est = f"{a.estimator}  A = (r - {centre}) / (batch std + {a.eps:g})"
    if is_turn_level(a.estimator):
        est += "; A_k = 0 for NaN (unscorable) rewards; outcome term 0 for singletons and "
        est += "equal-reward groups"
    else:
        est += "; A = 0 for NaN (unscorable) rewards, singletons and equal-reward groups"
    return est


def _describe_loss(c: LossConfig) -> str:
    """The policy loss and its clip."""
    if c.loss == "ppo":
        loss = (
            f"ppo-clip  rho in [{1 - c.clip_low:g}, {1 + c.clip_high:g}], log-ratio clamped to +-20"
        )
        return loss + (
            f", dual clip c = {c.dual_clip:g}" if c.dual_clip is not None else ", no dual clip"
        )
    return (
        f"gspo  sequence ratio in [{1 - c.clip_low:g}, {1 + c.clip_high:g}], log-ratio capped at 10"
    )


def _describe_aggregation(c: LossConfig) -> str:
    agg = c.effective_agg
    if agg == "seq-mean-token-sum-norm":
        agg += f"  (token sums / {c.max_response_len} / sequences)"
    return agg


def _describe_mis(c: LossConfig) -> str:
    """Masked importance sampling: which ratio, its band, and the weight it leaves."""
    if c.mis == "none":
        return "off"
    ratio = {
        "token": "token ratio",
        "sequence": "product of each sequence's token ratios",
        "geometric": "geometric mean of each sequence's token ratios",
    }[c.mis]
    band = f"[{c.mis_low:g}, {c.mis_high:g}]"
    if c.tis != "none":
        return f"{c.mis}: 0 where the {ratio} is outside {band}, else the tis weight"
    return f"{c.mis}: weight = the {ratio}, 0 outside {band}"


def _describe_filters(s: ShapingConfig) -> str:
    """Dynamic sampling, the overlong penalty and truncation masking, in that order."""
    filters = [
        f"dynamic sampling (<= {s.max_extra_rounds} extra rounds)"
        if s.dynamic_sampling
        else "no dynamic sampling"
    ]
    if s.overlong_buffer_len is not None:
        filters.append(
            f"overlong penalty over the last {s.overlong_buffer_len} tokens "
            f"(up to -{s.overlong_penalty_factor:g})"
        )
    filters.append(
        "truncated trajectories masked" if s.mask_truncated else "truncated trajectories trained on"
    )
    return "; ".join(filters)
