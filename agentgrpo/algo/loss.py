"""Policy losses (PPO-clip, GSPO) and the configured training loss (`LossConfig`, `compute_loss`).

Pure functions over [B, T] tensors (B rows = trajectories, T = padded length). Only tokens with
`loss_mask_BT == 1` count; every other position is replaced by 0 before any arithmetic, so -inf or
NaN logprobs at masked positions never reach a value or a gradient. Semantics follow verl 0.9.1's
`core_algos` unless a docstring says otherwise (TRL's differences: docs/learner.md, "The loss").

Every loss returns its share of the optimizer step's loss: with `num_tokens` / `num_seqs` counted
over the whole step, the shares of all micro-batches and ranks add up to one call over the step.
Metrics beside a loss are floats: "*loss*" entries are shares, the others means over this call's
loss tokens. Aggregations, KL estimators, TIS and MIS live in `loss_terms.py`, re-exported here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

# Every public name of loss_terms is re-exported: `agentgrpo.algo.loss` stays the one import for
# losses.
from agentgrpo.algo.loss_terms import (  # noqa: F401
    AGG_MODES,
    K3_CLAMP,
    KL_ESTIMATORS,
    LOG_RATIO_CLAMP,
    MIS_MODES,
    TIS_MODES,
    MISWeights,
    Normaliser,
    _masked_mean,
    aggregate,
    geometric_mis_weights,
    k1,
    k2,
    k3,
    kl_penalty,
    mis_weights,
    rollout_mismatch_metrics,
    sequence_mis_weights,
    sequence_tis_weights,
    token_mis_weights,
    token_tis_weights,
)

GSPO_LOG_RATIO_CAP = 10.0  # verl: cap of the sequence log-ratio in GSPO


# --- policy losses -------------------------------------------------------------------------------


def clipped_objective(
    ratio_BT: torch.Tensor, adv_BT: torch.Tensor, clip_low: float, clip_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The clipped surrogate both policy losses share, per token:

        l = max(-A·ρ, -A·clip(ρ, 1 - clip_low, 1 + clip_high))

    Returns (loss_BT, clipped_BT); `clipped` marks tokens where the clip binds (-A·clip(ρ) > -A·ρ).
    """
    unclipped_BT = -adv_BT * ratio_BT
    clipped_loss_BT = -adv_BT * ratio_BT.clamp(1 - clip_low, 1 + clip_high)
    return torch.maximum(unclipped_BT, clipped_loss_BT), clipped_loss_BT > unclipped_BT


def ppo_clip_token_loss(
    log_ratio_BT: torch.Tensor,
    adv_BT: torch.Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO-clip per token (`clipped_objective`), with ρ = exp(clamp(log_ratio, -20, 20)):

        l = max(-A·ρ, -A·clip(ρ, 1 - clip_low, 1 + clip_high))
        dual clip (A < 0 only): l = min(l, -A·c)

    Returns (loss_BT, clipped_BT, dual_clipped_BT). `clipped` marks tokens where the clip binds
    (-A·clip(ρ) > -A·ρ: ρ above 1+clip_high with A > 0, or below 1-clip_low with A < 0), as verl's
    `pg_clipfrac`; dual-clipped tokens are never in it (there ρ > c > 1 and A < 0).
    """
    ratio_BT = torch.exp(log_ratio_BT.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    loss_BT, clipped_BT = clipped_objective(ratio_BT, adv_BT, clip_low, clip_high)
    dual_BT = torch.zeros_like(clipped_BT)
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
        bound_BT = -adv_BT * dual_clip
        dual_BT = (adv_BT < 0) & (loss_BT > bound_BT)
        loss_BT = torch.where(adv_BT < 0, torch.minimum(loss_BT, bound_BT), loss_BT)
    return loss_BT, clipped_BT, dual_BT


def policy_loss(
    logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    advantages_B: torch.Tensor,
    loss_mask_BT: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    agg: str = "token-mean",
    max_response_len: int | None = None,
    num_tokens: Normaliser = None,
    num_seqs: Normaliser = None,
    tis_weights_BT: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clip policy loss (`ppo_clip_token_loss` per token, then `aggregate`).

    advantages_B is [B] (one per trajectory, broadcast over its tokens) or [B, T]. Clip-higher is
    clip_high > clip_low (DAPO: 0.2 / 0.28). `tis_weights_BT` (the rollout correction, detached:
    TIS or MIS weights, see `compute_loss`) multiply the per-token losses before aggregation, as
    verl's rollout importance weights and TRL's importance_sampling_ratio. Metrics: clipfrac,
    clipfrac_dual, ppo_kl (mean of old - new logp), loss_tokens.
    """
    mask_BT, logp_BT, old_BT, adv_BT = _prepare(
        logprobs_BT, old_logprobs_BT, advantages_B, loss_mask_BT
    )
    log_ratio_BT = logp_BT - old_BT
    loss_BT, clipped_BT, dual_BT = ppo_clip_token_loss(
        log_ratio_BT, adv_BT, clip_low, clip_high, dual_clip
    )
    if tis_weights_BT is not None:
        loss_BT = loss_BT * tis_weights_BT.detach()
    loss = aggregate(
        loss_BT,
        mask_BT,
        agg,
        max_response_len=max_response_len,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
    )
    metrics = {
        "pg_loss": loss.item(),
        "clipfrac": _masked_mean(clipped_BT, mask_BT),
        "clipfrac_dual": _masked_mean(dual_BT, mask_BT),
        "ppo_kl": _masked_mean(-log_ratio_BT.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), mask_BT),
        "loss_tokens": float(mask_BT.sum()),
    }
    return loss, metrics


def gspo_loss(
    logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    advantages_B: torch.Tensor,
    loss_mask_BT: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    agg: str = "seq-mean-token-mean",
    max_response_len: int | None = None,
    num_tokens: Normaliser = None,
    num_seqs: Normaliser = None,
    tis_weights_BT: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO: the PPO-clip objective with one importance ratio per sequence.

        s_i = mean over row i's loss tokens of (logp - old_logp)
        log ρ_{i,t} = min(sg[s_i] + logp_t - sg[logp_t], 10)      (value s_i, gradient of logp_t)
        l = max(-A·ρ, -A·clip(ρ, 1 - clip_low, 1 + clip_high))      (`clipped_objective`)

    No per-token log-ratio clamp and no dual clip: `dual_clip` is accepted for a uniform signature
    and ignored. verl always aggregates GSPO with seq-mean-token-mean; here `agg` is honoured and
    defaults to it. Metrics as `policy_loss` (clipfrac_dual is always 0).
    """
    mask_BT, logp_BT, old_BT, adv_BT = _prepare(
        logprobs_BT, old_logprobs_BT, advantages_B, loss_mask_BT
    )
    log_ratio_BT = logp_BT - old_BT
    seq_log_ratio_B = log_ratio_BT.sum(-1) / mask_BT.sum(-1).clamp(min=1)
    log_rho_BT = seq_log_ratio_B.detach().unsqueeze(-1) + logp_BT - logp_BT.detach()
    rho_BT = torch.exp(log_rho_BT.clamp(max=GSPO_LOG_RATIO_CAP))
    loss_BT, clipped_BT = clipped_objective(rho_BT, adv_BT, clip_low, clip_high)
    if tis_weights_BT is not None:
        loss_BT = loss_BT * tis_weights_BT.detach()
    loss = aggregate(
        loss_BT,
        mask_BT,
        agg,
        max_response_len=max_response_len,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
    )
    metrics = {
        "pg_loss": loss.item(),
        "clipfrac": _masked_mean(clipped_BT, mask_BT),
        "clipfrac_dual": 0.0,
        "ppo_kl": _masked_mean(-log_ratio_BT, mask_BT),
        "loss_tokens": float(mask_BT.sum()),
    }
    return loss, metrics


LossFn = Callable[..., tuple[torch.Tensor, dict[str, float]]]
LOSSES: dict[str, LossFn] = {"ppo": policy_loss, "gspo": gspo_loss}


def get_loss_fn(name: str) -> LossFn:
    """The policy loss registered under `name`; raises ValueError listing the valid names."""
    if name not in LOSSES:
        raise ValueError(f"unknown policy loss {name!r}; valid: {sorted(LOSSES)}")
    return LOSSES[name]


# --- the learner's entry point -------------------------------------------------------------------

AggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
DEFAULT_AGG = {"ppo": "token-mean", "gspo": "seq-mean-token-mean"}


class LossConfig(BaseModel):
    """Which policy loss, how it is aggregated, the KL and entropy terms added to it, and the
    correction for the rollout's sampling logprobs (TIS, MIS)."""

    model_config = ConfigDict(extra="forbid")

    loss: Literal["ppo", "gspo"] = Field(
        "ppo", description="ppo: per-token PPO-clip; gspo: sequence-level ratio."
    )
    clip_low: float = Field(0.2, ge=0, lt=1, description="Ratio lower clip: rho >= 1 - clip_low.")
    clip_high: float = Field(
        0.2, ge=0, description="Ratio upper clip: rho <= 1 + clip_high (DAPO clip-higher: 0.28)."
    )
    dual_clip: float | None = Field(
        None,
        gt=1,
        description="Dual-clip constant c (> 1) bounding the loss of A < 0 tokens at -A*c; ppo "
        "only.",
    )
    agg: AggMode | None = Field(
        None,
        description="Loss aggregation; None = the loss's default (ppo: token-mean, gspo: "
        "seq-mean-token-mean).",
    )
    max_response_len: int | None = Field(
        None,
        gt=0,
        description="Constant divisor of seq-mean-token-sum-norm (Dr. GRPO); required by that "
        "mode.",
    )
    kl_coef: float = Field(
        0.0, ge=0, description="beta of the KL-to-reference term; 0 loads no reference model."
    )
    kl_estimator: Literal["k1", "k2", "k3"] = Field(
        "k3", description="Per-token KL estimator of the KL term."
    )
    entropy_coef: float = Field(
        0.0, description="Weight of the entropy bonus (loss -= coef * aggregated entropy)."
    )
    tis: Literal["none", "token", "sequence"] = Field(
        "none", description="Truncated importance sampling against the rollout engine's logprobs."
    )
    tis_cap: float = Field(
        2.0, gt=0, description="Cap C of the TIS weight min(pi_old / pi_rollout, C)."
    )
    mis: Literal["none", "token", "sequence", "geometric"] = Field(
        "none",
        description="Masked importance sampling: weigh each token's policy loss by the ratio "
        "pi_old / pi_rollout and reject (weight 0) where it lies outside [mis_low, mis_high]; the "
        "ratio of each token (token), of each sequence as the product of its tokens' ratios "
        "(sequence), or as their geometric mean (geometric). With tis on as well, tis gives the "
        "weight and mis only the rejection.",
    )
    mis_low: float = Field(0.5, gt=0, le=1, description="Lower end of the MIS band (<= 1).")
    mis_high: float = Field(2.0, ge=1, description="Upper end of the MIS band (>= 1).")

    @model_validator(mode="after")
    def _check(self) -> LossConfig:
        if self.effective_agg == "seq-mean-token-sum-norm" and self.max_response_len is None:
            raise ValueError("max_response_len is required when agg='seq-mean-token-sum-norm'")
        if self.loss == "gspo" and self.dual_clip is not None:
            raise ValueError("dual_clip is not supported by loss='gspo'; leave dual_clip unset")
        return self

    @property
    def effective_agg(self) -> str:
        return self.agg or DEFAULT_AGG[self.loss]


def compute_loss(
    cfg: LossConfig,
    logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    advantages_B: torch.Tensor,
    loss_mask_BT: torch.Tensor,
    *,
    ref_logprobs_BT: torch.Tensor | None = None,
    entropy_BT: torch.Tensor | None = None,
    rollout_logprobs_BT: torch.Tensor | None = None,
    num_tokens: Normaliser = None,
    num_seqs: Normaliser = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The full training loss of one micro-batch, as configured:

        loss = agg(l_policy · w) + kl_coef · agg(KL) - entropy_coef · agg(entropy)

    with w the rollout correction (`_rollout_correction`; 1 without one), one aggregation mode and
    the same step normalisers for all three terms (tokens MIS rejects stay in the normalisers, as
    in TRL: they count as loss tokens whose policy loss is 0). Inputs that the
    config needs are required (ref logprobs when kl_coef > 0, entropy when entropy_coef != 0,
    rollout logprobs when tis or mis != none); inputs it does not use are still logged when given
    (kl, entropy, mismatch/*).
    """
    agg_kw = {
        "agg": cfg.effective_agg,
        "max_response_len": cfg.max_response_len,
        "num_tokens": num_tokens,
        "num_seqs": num_seqs,
    }
    mask_BT = loss_mask_BT > 0
    metrics: dict[str, float] = {}
    tis_weights_BT, m = _rollout_correction(cfg, old_logprobs_BT, rollout_logprobs_BT, mask_BT)
    metrics.update(m)

    loss_fn = get_loss_fn(cfg.loss)
    dual = cfg.dual_clip if cfg.loss == "ppo" else None
    loss, m = loss_fn(
        logprobs_BT,
        old_logprobs_BT,
        advantages_B,
        mask_BT,
        clip_low=cfg.clip_low,
        clip_high=cfg.clip_high,
        dual_clip=dual,
        tis_weights_BT=tis_weights_BT,
        **agg_kw,
    )
    metrics.update(m)

    if cfg.kl_coef > 0 and ref_logprobs_BT is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs_BT")
    if ref_logprobs_BT is not None:
        kl_BT = kl_penalty(*_masked(mask_BT, logprobs_BT, ref_logprobs_BT), kind=cfg.kl_estimator)
        kl_loss = aggregate(kl_BT, mask_BT, **agg_kw)
        metrics["kl_loss"] = kl_loss.item()
        metrics["kl"] = _masked_mean(kl_BT, mask_BT)
        if cfg.kl_coef > 0:
            loss = loss + cfg.kl_coef * kl_loss

    if cfg.entropy_coef != 0 and entropy_BT is None:
        raise ValueError("entropy_coef != 0 needs entropy_BT")
    if entropy_BT is not None:
        (entropy_BT,) = _masked(mask_BT, entropy_BT)
        entropy_loss = aggregate(entropy_BT, mask_BT, **agg_kw)
        metrics["entropy_loss"] = entropy_loss.item()
        metrics["entropy"] = _masked_mean(entropy_BT, mask_BT)
        if cfg.entropy_coef != 0:
            loss = loss - cfg.entropy_coef * entropy_loss

    metrics["loss"] = loss.item()
    return loss, metrics


# --- helpers -------------------------------------------------------------------------------------


def _rollout_correction(
    cfg: LossConfig,
    old_logprobs_BT: torch.Tensor,
    rollout_logprobs_BT: torch.Tensor | None,
    mask_BT: torch.Tensor,
) -> tuple[torch.Tensor | None, dict[str, float]]:
    """The per-token factor on the policy loss (None: no correction) and its metrics: TIS's
    capped ratio, MIS's ratio inside its band (0 outside), or with both on TIS's weight times
    MIS's band test (verl's importance weights with rejection sampling), so that the ratio is
    applied once."""
    for name, mode in (("tis", cfg.tis), ("mis", cfg.mis)):
        if mode != "none" and rollout_logprobs_BT is None:
            raise ValueError(f"{name}={mode!r} needs rollout_logprobs_BT")
    if rollout_logprobs_BT is None:
        return None, {}
    metrics: dict[str, float] = {}
    weights_BT = None
    if cfg.tis != "none":
        weights_BT, m = TIS_MODES[cfg.tis](
            old_logprobs_BT, rollout_logprobs_BT, mask_BT, cfg.tis_cap
        )
        metrics.update(m)
    if cfg.mis != "none":
        mis = mis_weights(
            cfg.mis, old_logprobs_BT, rollout_logprobs_BT, mask_BT, cfg.mis_low, cfg.mis_high
        )
        weights_BT = mis.weights_BT if weights_BT is None else weights_BT * mis.keep_BT
        metrics.update(mis.metrics)
    if weights_BT is None:
        metrics.update(rollout_mismatch_metrics(old_logprobs_BT, rollout_logprobs_BT, mask_BT))
    return weights_BT, metrics


def _prepare(
    logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    advantages_B: torch.Tensor,
    loss_mask_BT: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Check shapes, turn the mask into bool, zero every input at masked positions, broadcast A."""
    if (
        logprobs_BT.dim() != 2
        or logprobs_BT.shape != old_logprobs_BT.shape
        or logprobs_BT.shape != loss_mask_BT.shape
    ):
        raise ValueError(
            f"logprobs_BT, old_logprobs_BT and loss_mask_BT must share one [B, T] shape, got "
            f"{tuple(logprobs_BT.shape)}, {tuple(old_logprobs_BT.shape)}, "
            f"{tuple(loss_mask_BT.shape)}"
        )
    if advantages_B.dim() == 1:
        advantages_B = advantages_B.unsqueeze(-1)
    adv_BT = advantages_B.detach().to(logprobs_BT.dtype).expand_as(logprobs_BT)
    mask_BT = loss_mask_BT > 0
    logp_BT, old_BT, adv_BT = _masked(mask_BT, logprobs_BT, old_logprobs_BT.detach(), adv_BT)
    return mask_BT, logp_BT, old_BT, adv_BT


def _masked(mask_BT: torch.Tensor, *tensors_BT: torch.Tensor) -> tuple[torch.Tensor, ...]:
    # torch.where, not multiplication: 0 * inf is NaN, and where's backward sends exactly 0 there.
    return tuple(torch.where(mask_BT, t, 0.0) for t in tensors_BT)
