"""The learner's metrics: micro-batch metrics -> optimizer-step metrics -> one train step's metrics.

Its own concern (bookkeeping, not optimisation), with rules that follow what `loss.py` returns
beside a loss: names ending in "loss" are shares of their optimizer step's loss (summed over its
micro-batches and ranks); `*_max` / `*_min` (and `*max_abs_diff`) are extremes; everything else is
a mean over loss tokens (weighted by each micro-batch's), and counts such as `loss_tokens` add up.

A step's `passes x mini_batches` optimizer steps are a grid `[pass][mini-batch]` of `Metrics`. A
pass's metrics are those of one big step over its whole batch: each mini-batch's loss shares are
scaled by its share of the batch's normaliser, so with lr = 0 they equal `mini_batches = 1`'s. The
step's metrics are means over passes (docs/learner.md, "What to watch").
"""

from __future__ import annotations

import math

from accelerate import Accelerator
from accelerate.utils import gather_object

# Per-optimizer-step entries logged per pass (`pass{i}/...`) and per mini-batch (`mb{j}/...`).
STALENESS_KEYS = ("loss", "clipfrac", "ppo_kl", "ratio_mean", "ratio_max")


def _is_share(key: str) -> bool:
    return key.endswith("loss")


class Metrics:
    """The metrics of the micro-batches of one optimizer step on one rank (or pooled over
    several)."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.weighted: dict[str, float] = {}
        self.weights: dict[
            str, float
        ] = {}  # per key: a key may be logged by some micro-batches only
        self.extremes: dict[str, float] = {}

    def add(self, m: dict[str, float], weight: float) -> None:
        """One micro-batch's metrics; `weight` = its loss tokens."""
        for k, v in m.items():
            if "loss" in k:
                self.sums[k] = self.sums.get(k, 0.0) + v
            elif k.endswith(("_max", "max_abs_diff")):
                self.extremes[k] = max(self.extremes.get(k, -math.inf), v)
            elif k.endswith("_min"):
                self.extremes[k] = min(self.extremes.get(k, math.inf), v)
            else:
                self.weighted[k] = self.weighted.get(k, 0.0) + v * weight
                self.weights[k] = self.weights.get(k, 0.0) + weight

    def merge(self, other: Metrics, share: float = 1.0) -> None:
        """Pool `other` (another rank's, or another mini-batch's with its loss shares x `share`)."""
        for k, v in other.sums.items():
            self.sums[k] = self.sums.get(k, 0.0) + (v * share if _is_share(k) else v)
        for k, v in other.weighted.items():
            self.weighted[k] = self.weighted.get(k, 0.0) + v
            self.weights[k] = self.weights.get(k, 0.0) + other.weights[k]
        for k, v in other.extremes.items():
            pick = min if k.endswith("_min") else max
            self.extremes[k] = pick(self.extremes.get(k, v), v)

    def result(self) -> dict[str, float]:
        means = {k: v / max(self.weights[k], 1.0) for k, v in self.weighted.items()}
        return self.sums | means | self.extremes


def over_ranks(opt_step_metrics: list[list[Metrics]], acc: Accelerator) -> list[list[Metrics]]:
    """Every rank's grid of optimizer-step metrics pooled entry by entry (one collective for the
    whole step)."""
    if acc.num_processes == 1:
        parts = [opt_step_metrics]
    else:
        parts = gather_object([opt_step_metrics])
    pooled = [[Metrics() for _ in row] for row in opt_step_metrics]
    for grid in parts:
        for row, prow in zip(pooled, grid, strict=True):
            for total, opt_step in zip(row, prow, strict=True):
                total.merge(opt_step)
    return pooled


def step_metrics(
    opt_step_metrics: list[list[Metrics]], shares: list[float], optim: list[list[dict[str, float]]]
) -> dict[str, float]:
    """A train step's metrics from its pooled optimizer steps `[pass][mini-batch]`, each
    mini-batch's loss share of the batch (`shares`), and per optimizer step `grad_norm` and `lr`
    (`optim`, same grid; averaged over the step's optimizer steps)."""
    passes = []
    for row, orow in zip(opt_step_metrics, optim, strict=True):
        total = Metrics()
        for opt_step, share in zip(row, shares, strict=True):
            total.merge(opt_step, share)
        per_opt = {k: sum(o[k] for o in orow) / len(orow) for k in orow[0]}
        passes.append(total.result() | per_opt)
    out = over_passes(passes)
    if len(passes) > 1:
        for i, p in enumerate(passes, 1):
            out.update({f"pass{i}/{k}": p[k] for k in STALENESS_KEYS if k in p})
    if len(shares) > 1:  # how far each later mini-batch is from the policy that sampled it
        for j in range(len(shares)):
            mb = over_passes([row[j].result() for row in opt_step_metrics])
            out.update({f"mb{j + 1}/{k}": mb[k] for k in STALENESS_KEYS if k in mb})
    out["optimizer_steps"] = float(len(opt_step_metrics) * len(shares))
    return out


def over_passes(passes: list[dict[str, float]]) -> dict[str, float]:
    """Means over passes (extremes: extremes)."""
    out: dict[str, float] = {}
    for k in passes[0]:
        vals = [p[k] for p in passes if k in p]
        out[k] = (
            max(vals)
            if k.endswith(("_max", "max_abs_diff"))
            else (min(vals) if k.endswith("_min") else sum(vals) / len(vals))
        )
    return out
