"""The terms around the policy loss: aggregation modes, KL estimators, truncated and masked
importance sampling.

Pure functions over [B, T] tensors with the conventions of `agentgrpo.algo.loss` (read its
docstring: masking before arithmetic, step-wide normalisers, metrics as Python floats). The named
modes sit in small registries (`AGG_MODES`, `KL_ESTIMATORS`, `TIS_MODES`, `MIS_MODES`); `aggregate`
and `kl_penalty` raise with the list of valid names.

Why a module of its own: none of these terms depends on which policy loss is used. `loss.py` keeps
the PPO-clip / GSPO formulas and the configured entry point (`LossConfig`, `compute_loss`) that
combines them with these terms; it re-exports every public name here, so
`from agentgrpo.algo.loss import aggregate, kl_penalty, ...` keeps working.
"""

from __future__ import annotations

import math
from collections.abc import Callable

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


def token_mis_mask(
    old_logprobs_BT: torch.Tensor,
    rollout_logprobs_BT: torch.Tensor,
    loss_mask_BT: torch.Tensor,
    low: float,
    high: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-level MIS: keep_t = 1 if low <= r_t <= high else 0, r_t = exp(old_logp_t -
    rollout_logp_t) (the log-ratio clamped to [-20, 20], compared in log space).

    Where TIS caps a large ratio, MIS drops the token: a token whose behaviour probability is far
    from pi_old (sampled by weights several updates old, or by an engine whose numbers went wrong)
    gives no gradient at all, instead of a bounded but biased one. Returns the keep mask (float,
    detached, 0 at masked positions) and metrics over loss tokens: mis/masked_frac (the share
    dropped), mis/ratio_mean, plus `rollout_mismatch_metrics`.
    """
    mask_BT = loss_mask_BT > 0
    with torch.no_grad():
        d_BT = torch.where(mask_BT, old_logprobs_BT - rollout_logprobs_BT, 0.0)
        d_BT = d_BT.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        keep_BT = mask_BT & _in_band(d_BT, low, high)
        metrics = {
            "mis/masked_frac": _masked_mean(~keep_BT, mask_BT),
            "mis/ratio_mean": _masked_mean(torch.exp(d_BT), mask_BT),
            **rollout_mismatch_metrics(old_logprobs_BT, rollout_logprobs_BT, loss_mask_BT),
        }
    return keep_BT.to(old_logprobs_BT.dtype), metrics


def sequence_mis_mask(
    old_logprobs_BT: torch.Tensor,
    rollout_logprobs_BT: torch.Tensor,
    loss_mask_BT: torch.Tensor,
    low: float,
    high: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Sequence-level MIS: row i is kept whole or dropped whole, by the geometric mean of its
    token ratios, r_i = exp(mean over its loss tokens of (old_logp - rollout_logp)):
    keep_i = 1 if low <= r_i <= high else 0.

    The geometric mean, not the product exp(sum): the product of n ratios drifts with n (a mismatch
    of 0.002 nats a token is a ratio of e^2 = 7.4 over 1000 tokens and 1.02 over 10), so one band
    would drop long sequences for a per-token gap it lets short ones keep. The mean log-ratio is
    per token, as GSPO's sequence ratio, so the band means the same at every length. Metrics as
    `token_mis_mask`, over loss tokens each carrying its row's decision and ratio (the learner
    pools micro-batches by loss tokens).
    """
    mask_BT = loss_mask_BT > 0
    with torch.no_grad():
        d_BT = torch.where(mask_BT, old_logprobs_BT - rollout_logprobs_BT, 0.0)
        mean_B = d_BT.sum(-1) / mask_BT.sum(-1).clamp(min=1)
        mean_B = mean_B.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        keep_BT = mask_BT & _in_band(mean_B, low, high).unsqueeze(-1)
        metrics = {
            "mis/masked_frac": _masked_mean(~keep_BT, mask_BT),
            "mis/ratio_mean": _masked_mean(
                torch.exp(mean_B).unsqueeze(-1).expand_as(mask_BT), mask_BT
            ),
            **rollout_mismatch_metrics(old_logprobs_BT, rollout_logprobs_BT, loss_mask_BT),
        }
    return keep_BT.to(old_logprobs_BT.dtype), metrics


MIS_MODES = {"token": token_mis_mask, "sequence": sequence_mis_mask}


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
