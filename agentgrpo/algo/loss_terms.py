"""The terms around the policy loss: aggregation modes, KL estimators, truncated and masked
importance sampling.

Pure functions over [B, T] tensors with the conventions of `agentgrpo.algo.loss` (read its
docstring: masking before arithmetic, step-wide normalisers, metrics as Python floats). The named
modes sit in small registries (`AGG_MODES`, `KL_ESTIMATORS`, `TIS_MODES`, `MIS_MODES`); `aggregate`,
`kl_penalty` and `mis_weights` raise with the list of valid names.

Why a module of its own: none of these terms depends on which policy loss is used. `loss.py` keeps
the PPO-clip / GSPO formulas and the configured entry point (`LossConfig`, `compute_loss`) that
combines them with these terms; it re-exports every public name here, so
`from agentgrpo.algo.loss import aggregate, kl_penalty, ...` keeps working.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal, NamedTuple

import torch

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
LOG_RATIO_CLAMP = 20.0  # verl: clamp log(pi/pi_old) before exp, so a ratio is at most e^20
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
    variance than token level. Metrics are over loss tokens, each carrying its row's ratio: the
    learner pools micro-batches' metrics by loss tokens, so a mean over rows would change with the
    micro-batch split."""
    mask_BT = loss_mask_BT > 0
    with torch.no_grad():
        d_B = torch.where(mask_BT, old_logprobs_BT - rollout_logprobs_BT, 0.0).sum(-1)
        ratio_B = torch.exp(d_B.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        weights_BT = torch.where(mask_BT, ratio_B.clamp(max=cap).unsqueeze(-1), 0.0)
        metrics = {
            "tis/ratio_mean": _masked_mean(ratio_B.unsqueeze(-1).expand_as(mask_BT), mask_BT),
            "tis/clipped_frac": _masked_mean(
                (ratio_B > cap).unsqueeze(-1).expand_as(mask_BT), mask_BT
            ),
            **rollout_mismatch_metrics(old_logprobs_BT, rollout_logprobs_BT, loss_mask_BT),
        }
    return weights_BT, metrics


TIS_MODES = {"token": token_tis_weights, "sequence": sequence_tis_weights}


# --- masked importance sampling (rollout engine vs learner) --------------------------------------


class MISWeights(NamedTuple):
    """What a masked importance sampling variant gives the loss: `weights_BT`, the ratio where it
    lies in the band and 0 elsewhere (what MIS alone multiplies the policy loss by), `keep_BT`,
    the 0/1 band test alone (what MIS multiplies TIS's weights by when both are on), both float,
    detached and 0 at masked positions; and metrics over loss tokens."""

    weights_BT: torch.Tensor
    keep_BT: torch.Tensor
    metrics: dict[str, float]


def token_mis_weights(
    old_logprobs_BT: torch.Tensor,
    rollout_logprobs_BT: torch.Tensor,
    loss_mask_BT: torch.Tensor,
    low: float,
    high: float,
) -> MISWeights:
    """Token-level MIS: w_t = r_t if low <= r_t <= high else 0, with
    r_t = exp(clamp(old_logp_t - rollout_logp_t, -20, 20)) (TRL's `token_mask`, verl's
    `rollout_is_level: token` with `rollout_is_mode: mask`).

    Where TIS caps a large ratio, MIS rejects the token: one whose behaviour probability is far from
    pi_old (sampled by weights several updates old, or by an engine whose numbers went wrong) gives
    no gradient at all, and the others are importance-weighted by their ratio, uncapped inside the
    band."""
    return _mis(old_logprobs_BT, rollout_logprobs_BT, loss_mask_BT, low, high, None)


def sequence_mis_weights(
    old_logprobs_BT: torch.Tensor,
    rollout_logprobs_BT: torch.Tensor,
    loss_mask_BT: torch.Tensor,
    low: float,
    high: float,
) -> MISWeights:
    """Sequence-level MIS on the product of the ratios: R_i = exp(clamp(sum_t log r_t, -20, 20))
    over row i's loss tokens, and every loss token of row i weighs R_i if low <= R_i <= high, else
    0 (TRL's `sequence_mask`, verl's `rollout_is_level: sequence` with `mask`). R_i is the
    importance weight of the whole sequence, what a whole-trajectory reward calls for; the product
    of n ratios drifts with n, so long sequences leave a fixed band sooner (`geometric_mis_weights`
    tests a per-token gap instead)."""
    return _mis(old_logprobs_BT, rollout_logprobs_BT, loss_mask_BT, low, high, "sum")


def geometric_mis_weights(
    old_logprobs_BT: torch.Tensor,
    rollout_logprobs_BT: torch.Tensor,
    loss_mask_BT: torch.Tensor,
    low: float,
    high: float,
) -> MISWeights:
    """Sequence-level MIS on the geometric mean of the ratios: R_i = exp(mean_t log r_t) over row
    i's loss tokens, weighing and tested as in `sequence_mis_weights` (verl's
    `rollout_is_level: geometric` with `mask`). The mean log-ratio is per token, like GSPO's
    sequence ratio, so the band means the same at every length: a gap of 0.002 nats a token is
    R = 1.002 at 10 tokens and at 1000, where the product would be 1.02 and 7.4."""
    return _mis(old_logprobs_BT, rollout_logprobs_BT, loss_mask_BT, low, high, "mean")


MISFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float, float], MISWeights]
MIS_MODES: dict[str, MISFn] = {
    "token": token_mis_weights,
    "sequence": sequence_mis_weights,
    "geometric": geometric_mis_weights,
}


def mis_weights(
    kind: str,
    old_logprobs_BT: torch.Tensor,
    rollout_logprobs_BT: torch.Tensor,
    loss_mask_BT: torch.Tensor,
    low: float,
    high: float,
) -> MISWeights:
    """The MIS variant named `kind` (token | sequence | geometric); ValueError naming the valid
    ones otherwise."""
    if kind not in MIS_MODES:
        raise ValueError(f"unknown MIS variant {kind!r}; valid: {sorted(MIS_MODES)}")
    return MIS_MODES[kind](old_logprobs_BT, rollout_logprobs_BT, loss_mask_BT, low, high)


def _mis(
    old_logprobs_BT: torch.Tensor,
    rollout_logprobs_BT: torch.Tensor,
    loss_mask_BT: torch.Tensor,
    low: float,
    high: float,
    per_row: Literal["sum", "mean"] | None,
) -> MISWeights:
    """The three variants: the log-ratio per token (`per_row` None) or per row (its sum or mean
    over the row's loss tokens, on every token of the row), clamped to [-20, 20], then tested
    against the band in log space and exponentiated. Metrics over loss tokens, each carrying its
    row's value for the row variants (the learner pools micro-batches by loss tokens):
    mis/masked_frac (the share rejected), mis/ratio_mean (the ratio the band tested),
    mis/weight_mean (what the loss was multiplied by), plus `rollout_mismatch_metrics`."""
    mask_BT = loss_mask_BT > 0
    with torch.no_grad():
        d_BT = torch.where(mask_BT, old_logprobs_BT - rollout_logprobs_BT, 0.0)
        if per_row == "sum":
            d_BT = d_BT.sum(-1, keepdim=True).expand_as(d_BT)
        elif per_row == "mean":
            rows = d_BT.sum(-1, keepdim=True) / mask_BT.sum(-1, keepdim=True).clamp(min=1)
            d_BT = rows.expand_as(d_BT)
        d_BT = d_BT.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        keep_BT = mask_BT & _in_band(d_BT, low, high)
        ratio_BT = torch.exp(d_BT)
        weights_BT = torch.where(keep_BT, ratio_BT, 0.0)
        metrics = {
            "mis/masked_frac": _masked_mean(~keep_BT, mask_BT),
            "mis/ratio_mean": _masked_mean(ratio_BT, mask_BT),
            "mis/weight_mean": _masked_mean(weights_BT, mask_BT),
            **rollout_mismatch_metrics(old_logprobs_BT, rollout_logprobs_BT, loss_mask_BT),
        }
    return MISWeights(weights_BT, keep_BT.to(weights_BT.dtype), metrics)


def _in_band(log_ratio: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """low <= exp(log_ratio) <= high, compared as logs (no overflow for far-off ratios)."""
    if not 0 < low <= 1 <= high:
        raise ValueError(f"MIS band must satisfy 0 < low <= 1 <= high, got [{low}, {high}]")
    return (log_ratio >= math.log(low)) & (log_ratio <= math.log(high))


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


# --- helpers -------------------------------------------------------------------------------------


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    n = int(mask.sum())
    return float(torch.where(mask, values.detach().float(), 0.0).sum() / n) if n else 0.0
