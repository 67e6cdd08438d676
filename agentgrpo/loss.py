"""Policy losses, KL estimators, loss aggregation and truncated importance sampling.

Pure functions over [B, T] tensors (B rows = trajectories, T = padded length). Only tokens with
`loss_mask_BT == 1` (sampled by the policy) count; every other position is replaced by 0 *before*
any arithmetic, so -inf or NaN logprobs at masked positions never reach a value or a gradient.

Semantics follow verl 0.9.1 `core_algos` unless a docstring says otherwise. Differences from TRL
(GRPOTrainer): TRL does not clamp the log-ratio or k3; its `dr_grpo` loss divides by all rows x
the max completion length (here: rows with a loss token x the configured `max_response_len`); it
adds beta * KL per token before aggregating (here: aggregated separately with the same mode and
normalisers, which is the same number for these linear aggregations and lets the KL be logged).

Micro-batches and ranks: every loss here returns its *share* of the optimizer step's loss. With
`num_tokens` / `num_seqs` set to the whole step's counts (all micro-batches, all ranks), the shares
add up to the loss of one call over the whole step, and so do their gradients. The learner
multiplies by the world size before `backward()` because DDP/FSDP average gradients over ranks.

Metrics returned next to a loss are Python floats: "*loss*" entries are shares (sum them over
micro-batches); the others are means over this call's loss tokens (average them weighted by
"loss_tokens").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
LOG_RATIO_CLAMP = 20.0  # verl: clamp log(pi/pi_old) before exp, so a ratio is at most e^20
GSPO_LOG_RATIO_CAP = 10.0  # verl: cap of the sequence log-ratio in GSPO
K3_CLAMP = 10.0  # verl: k3 values clamped to [-10, 10]
Normaliser = int | float | torch.Tensor | None


# --- aggregation ---------------------------------------------------------------------------------


def aggregate(
    loss_BT: torch.Tensor,
    loss_mask_BT: torch.Tensor,
    agg: str = "token-mean",
    *,
    max_response_len: int | None = None,
    num_tokens: Normaliser = None,
    num_seqs: Normaliser = None,
) -> torch.Tensor:
    """Reduce per-token losses to this call's share of the step loss. m = mask, l = loss.

    - token-mean:              sum_{i,t} l·m / num_tokens
    - seq-mean-token-mean:     sum_i (sum_t l·m / sum_t m) / num_seqs
    - seq-mean-token-sum-norm: sum_{i,t} l·m / (max_response_len · num_seqs)   (Dr. GRPO)

    num_tokens defaults to this call's loss tokens, num_seqs to this call's rows with at least one
    loss token; pass the whole step's counts when the step is split into micro-batches. Rows whose
    mask is all zero add nothing. With nothing to average the result is a 0 that is still attached
    to the graph of `loss_BT`.
    verl difference: verl's seq-mean-token-sum-norm divides by max_response_len only, not by the
    number of sequences; here it is a mean over sequences, as in the Dr. GRPO paper.
    """
    mask_BT = loss_mask_BT > 0
    masked_BT = torch.where(mask_BT, loss_BT, 0.0)
    tokens_B = mask_BT.sum(-1)
    if agg == "token-mean":
        denom = _normaliser(num_tokens, tokens_B.sum(), "num_tokens")
        return masked_BT.sum() / denom
    if agg == "seq-mean-token-mean":
        denom = _normaliser(num_seqs, (tokens_B > 0).sum(), "num_seqs")
        return (masked_BT.sum(-1) / tokens_B.clamp(min=1)).sum() / denom
    if agg == "seq-mean-token-sum-norm":
        if max_response_len is None or max_response_len <= 0:
            raise ValueError(
                "agg='seq-mean-token-sum-norm' needs max_response_len (a positive int)"
            )
        denom = _normaliser(num_seqs, (tokens_B > 0).sum(), "num_seqs")
        return masked_BT.sum() / (max_response_len * denom)
    raise ValueError(f"unknown agg {agg!r}; valid: {list(AGG_MODES)}")


def step_normalisers(loss_masks_BT: list[torch.Tensor]) -> tuple[int, int]:
    """(num_tokens, num_seqs) of an optimizer step from its micro-batches' loss masks, counted as
    the defaults count them: loss tokens, and rows with at least one loss token. Across ranks, the
    learner sums these over ranks (all-reduce) before passing them to every loss call."""
    num_tokens = sum(int((m > 0).sum()) for m in loss_masks_BT)
    num_seqs = sum(int(((m > 0).sum(-1) > 0).sum()) for m in loss_masks_BT)
    return num_tokens, num_seqs


def _normaliser(given: Normaliser, local: torch.Tensor, name: str) -> torch.Tensor | float:
    """The step-wide divisor; never below 1 so an empty call gives 0, not NaN."""
    if given is None:
        return local.clamp(min=1)  # an integer tensor: the quotient keeps the loss's dtype
    value = float(given)
    if value < float(local):
        raise ValueError(
            f"{name}={value:g} is smaller than this call's own count {int(local)}; "
            f"it must count the whole optimizer step"
        )
    return max(value, 1.0)


# --- policy losses -------------------------------------------------------------------------------


def ppo_clip_token_loss(
    log_ratio_BT: torch.Tensor,
    adv_BT: torch.Tensor,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO-clip per token, with ρ = exp(clamp(log_ratio, -20, 20)):

        l = max(-A·ρ, -A·clip(ρ, 1 - clip_low, 1 + clip_high))
        dual clip (A < 0 only): l = min(l, -A·c)

    Returns (loss_BT, clipped_BT, dual_clipped_BT). `clipped` marks tokens where the clip binds
    (-A·clip(ρ) > -A·ρ: ρ above 1+clip_high with A > 0, or below 1-clip_low with A < 0), as verl's
    `pg_clipfrac`; dual-clipped tokens are never in it (there ρ > c > 1 and A < 0).
    """
    ratio_BT = torch.exp(log_ratio_BT.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    unclipped_BT = -adv_BT * ratio_BT
    clipped_loss_BT = -adv_BT * ratio_BT.clamp(1 - clip_low, 1 + clip_high)
    loss_BT = torch.maximum(unclipped_BT, clipped_loss_BT)
    clipped_BT = clipped_loss_BT > unclipped_BT
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
    clip_high > clip_low (DAPO: 0.2 / 0.28). `tis_weights_BT` (from `token_tis_weights` /
    `sequence_tis_weights`, detached) multiply the per-token losses before aggregation, as verl's
    rollout importance weights. Metrics: clipfrac, clipfrac_dual, ppo_kl (mean of old - new logp),
    loss_tokens.
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
        l = max(-A·ρ, -A·clip(ρ, 1 - clip_low, 1 + clip_high))

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
    unclipped_BT = -adv_BT * rho_BT
    clipped_loss_BT = -adv_BT * rho_BT.clamp(1 - clip_low, 1 + clip_high)
    loss_BT = torch.maximum(unclipped_BT, clipped_loss_BT)
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
        "clipfrac": _masked_mean(clipped_loss_BT > unclipped_BT, mask_BT),
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


# --- KL to the reference -------------------------------------------------------------------------


def k1(logprobs_BT: torch.Tensor, ref_logprobs_BT: torch.Tensor) -> torch.Tensor:
    """k1 = logp - ref_logp (unbiased for KL(pi || ref), can be negative)."""
    return logprobs_BT - ref_logprobs_BT


def k2(logprobs_BT: torch.Tensor, ref_logprobs_BT: torch.Tensor) -> torch.Tensor:
    """k2 = 0.5 · (logp - ref_logp)^2."""
    return 0.5 * (logprobs_BT - ref_logprobs_BT).square()


def k3(logprobs_BT: torch.Tensor, ref_logprobs_BT: torch.Tensor) -> torch.Tensor:
    """k3 = exp(d) - d - 1 with d = clamp(ref_logp - logp, -20, 20), clamped to [-10, 10] (verl's
    low_var_kl; Schulman's estimator, >= 0, unbiased for KL(pi || ref)). TRL clamps neither."""
    d = (ref_logprobs_BT - logprobs_BT).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return (torch.exp(d) - d - 1).clamp(-K3_CLAMP, K3_CLAMP)


KL_ESTIMATORS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "k1": k1,
    "k2": k2,
    "k3": k3,
}


def kl_penalty(
    logprobs_BT: torch.Tensor, ref_logprobs_BT: torch.Tensor, kind: str = "k3"
) -> torch.Tensor:
    """Per-token KL estimate [B, T] of the policy to the reference: kind in k1 | k2 | k3."""
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {kind!r}; valid: {sorted(KL_ESTIMATORS)}")
    return KL_ESTIMATORS[kind](logprobs_BT, ref_logprobs_BT)


# --- truncated importance sampling (rollout engine vs learner) -----------------------------------


def token_tis_weights(
    old_logprobs_BT: torch.Tensor,
    rollout_logprobs_BT: torch.Tensor,
    loss_mask_BT: torch.Tensor,
    cap: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-level TIS: w_t = min(exp(clamp(old_logp_t - rollout_logp_t, -20, 20)), cap).

    Corrects for the engine sampling from a slightly different distribution (other kernels,
    precision) than the learner's pi_old. Weights are detached and 0 at masked positions. Metrics:
    tis/ratio_mean and tis/clipped_frac over loss tokens, plus `rollout_mismatch_metrics`.
    """
    mask_BT = loss_mask_BT > 0
    with torch.no_grad():
        d_BT = torch.where(mask_BT, old_logprobs_BT - rollout_logprobs_BT, 0.0)
        ratio_BT = torch.exp(d_BT.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        weights_BT = torch.where(mask_BT, ratio_BT.clamp(max=cap), 0.0)
        metrics = {
            "tis/ratio_mean": _masked_mean(ratio_BT, mask_BT),
            "tis/clipped_frac": _masked_mean(ratio_BT > cap, mask_BT),
            **rollout_mismatch_metrics(old_logprobs_BT, rollout_logprobs_BT, loss_mask_BT),
        }
    return weights_BT, metrics


def sequence_tis_weights(
    old_logprobs_BT: torch.Tensor,
    rollout_logprobs_BT: torch.Tensor,
    loss_mask_BT: torch.Tensor,
    cap: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Sequence-level TIS: w_i = min(exp(clamp(sum_t (old_logp - rollout_logp), -20, 20)), cap),
    the same weight on every loss token of row i. Unbiased for whole-trajectory rewards but higher
    variance than token level. Metrics are over rows with a loss token."""
    mask_BT = loss_mask_BT > 0
    with torch.no_grad():
        d_B = torch.where(mask_BT, old_logprobs_BT - rollout_logprobs_BT, 0.0).sum(-1)
        ratio_B = torch.exp(d_B.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        weights_BT = torch.where(mask_BT, ratio_B.clamp(max=cap).unsqueeze(-1), 0.0)
        rows_B = mask_BT.any(-1)
        metrics = {
            "tis/ratio_mean": _masked_mean(ratio_B, rows_B),
            "tis/clipped_frac": _masked_mean(ratio_B > cap, rows_B),
            **rollout_mismatch_metrics(old_logprobs_BT, rollout_logprobs_BT, loss_mask_BT),
        }
    return weights_BT, metrics


TIS_MODES = {"token": token_tis_weights, "sequence": sequence_tis_weights}


def rollout_mismatch_metrics(
    old_logprobs_BT: torch.Tensor, rollout_logprobs_BT: torch.Tensor, loss_mask_BT: torch.Tensor
) -> dict[str, float]:
    """How far the engine's sampling logprobs are from the learner's, over loss tokens. The tokens
    were sampled by the engine, so with d = rollout_logp - old_logp: mismatch/kl = mean(d) (k1) and
    mismatch/k3_kl = mean(exp(-d) + d - 1) both estimate KL(rollout || learner)."""
    mask_BT = loss_mask_BT > 0
    with torch.no_grad():
        d_BT = torch.where(mask_BT, rollout_logprobs_BT - old_logprobs_BT, 0.0).clamp(
            -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP
        )
        return {
            "mismatch/kl": _masked_mean(d_BT, mask_BT),
            "mismatch/k3_kl": _masked_mean(torch.exp(-d_BT) + d_BT - 1, mask_BT),
            "mismatch/max_abs_diff": float(d_BT.abs().max()) if d_BT.numel() else 0.0,
        }


# --- the learner's entry point -------------------------------------------------------------------

AggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
DEFAULT_AGG = {"ppo": "token-mean", "gspo": "seq-mean-token-mean"}


class LossConfig(BaseModel):
    """Which policy loss, how it is aggregated, and the KL, entropy and TIS terms added to it."""

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
        description="Dual-clip constant c (> 1) bounding the loss of A < 0 tokens at -A*c; ppo only.",
    )
    agg: AggMode | None = Field(
        None,
        description="Loss aggregation; None = the loss's default (ppo: token-mean, gspo: seq-mean-token-mean).",
    )
    max_response_len: int | None = Field(
        None,
        gt=0,
        description="Constant divisor of seq-mean-token-sum-norm (Dr. GRPO); required by that mode.",
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

    @property
    def needs_reference_model(self) -> bool:
        return self.kl_coef > 0


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

        loss = policy_loss · w_tis + kl_coef · agg(KL) - entropy_coef · agg(entropy)

    with one aggregation mode and the same step normalisers for all three terms. Inputs that the
    config needs are required (ref logprobs when kl_coef > 0, entropy when entropy_coef != 0,
    rollout logprobs when tis != none); inputs it does not use are still logged when given (kl,
    entropy, mismatch/*).
    """
    agg_kw = {
        "agg": cfg.effective_agg,
        "max_response_len": cfg.max_response_len,
        "num_tokens": num_tokens,
        "num_seqs": num_seqs,
    }
    mask_BT = loss_mask_BT > 0
    metrics: dict[str, float] = {}
    tis_weights_BT = None
    if cfg.tis != "none":
        if rollout_logprobs_BT is None:
            raise ValueError(f"tis={cfg.tis!r} needs rollout_logprobs_BT")
        tis_weights_BT, m = TIS_MODES[cfg.tis](
            old_logprobs_BT, rollout_logprobs_BT, mask_BT, cfg.tis_cap
        )
        metrics.update(m)
    elif rollout_logprobs_BT is not None:
        metrics.update(rollout_mismatch_metrics(old_logprobs_BT, rollout_logprobs_BT, mask_BT))

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
            f"{tuple(logprobs_BT.shape)}, {tuple(old_logprobs_BT.shape)}, {tuple(loss_mask_BT.shape)}"
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


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    n = int(mask.sum())
    return float(torch.where(mask, values.detach().float(), 0.0).sum() / n) if n else 0.0
