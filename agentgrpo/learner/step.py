"""One GRPO step of the learner on its training rows: mini-batches packed per rank, a scoring
pass, then the optimisation passes (`train_step`; the order and the normalisers: docs/learner.md).
Functions of a `Learner`, which its method `train_step` calls (as `state` holds its checkpoints)."""

from __future__ import annotations

import contextlib
import resource
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from agentgrpo.algo.loss import compute_loss
from agentgrpo.learner.batch import TrainBatch, balanced_parts, make_micro_batches
from agentgrpo.learner.dist import total_norm
from agentgrpo.learner.logprobs import to_loss_layout
from agentgrpo.learner.metrics import Metrics, over_ranks, step_metrics
from agentgrpo.types import TrainingRow

if TYPE_CHECKING:
    from agentgrpo.learner.learner import Learner


@dataclass
class MiniBatch:
    """One optimizer step's data on this rank: micro-batches (None: empty, to keep ranks in step),
    the whole mini-batch's normalisers (all ranks), scored old / reference logprobs (None: not
    needed)."""

    batches: list[TrainBatch | None]
    num_tokens: float
    num_seqs: float
    olds: list[torch.Tensor | None] = field(default_factory=list)
    refs: list[torch.Tensor | None] = field(default_factory=list)


def train_step(learner: Learner, rows: Sequence[TrainingRow]) -> dict[str, float]:
    """`Learner.train_step` under its TF32 setting: the step's passes over its mini-batches, one
    optimizer step each; returns the step's metrics."""
    if not rows:
        return {"loss": 0.0, "skipped": 1.0}
    t0 = time.perf_counter()
    acc = learner.accelerator
    if acc.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(acc.device)
    packed_mini_batches = [
        pack(learner, [rows[i] for i in part])
        for part in balanced_parts(rows, learner.cfg.mini_batches)
    ]
    for mini_batch, n in zip(
        packed_mini_batches,
        max_over_ranks(learner, [len(m.batches) for m in packed_mini_batches]),
        strict=True,
    ):
        mini_batch.batches += [None] * (n - len(mini_batch.batches))
    score(learner, packed_mini_batches)
    # Each mini-batch's loss shares are of its own loss; scaled by its part of the batch's
    # normaliser they add up to the batch's loss in the logged metrics (see learner_metrics).
    by_tokens = learner.loss_cfg.effective_agg == "token-mean"
    norm = [m.num_tokens if by_tokens else m.num_seqs for m in packed_mini_batches]
    opt_step_metrics = [[Metrics() for _ in packed_mini_batches] for _ in range(learner.cfg.passes)]
    optim: list[list[dict[str, float]]] = [[] for _ in range(learner.cfg.passes)]
    for p in range(learner.cfg.passes):
        for j, mini_batch in enumerate(packed_mini_batches):  # one optimizer step each
            for k, mb in enumerate(mini_batch.batches):
                # gradients are all-reduced once per optimizer step
                sync = k == len(mini_batch.batches) - 1
                with contextlib.nullcontext() if sync else acc.no_sync(learner.model):
                    m = micro_step(learner, mb, mini_batch, k, measure_gap=p == 0 and j == 0)
                if mb is not None:
                    opt_step_metrics[p][j].add(m, float(mb.loss_mask_BT.sum()))
            grad_norm = acc.clip_grad_norm_(learner.model.parameters(), learner.cfg.grad_clip)
            lr = learner.scheduler.get_last_lr()[0]
            learner.optimizer.step()
            learner.scheduler.step()
            learner.optimizer.zero_grad(set_to_none=True)
            optim[p].append({"grad_norm": total_norm(grad_norm), "lr": lr})
    learner.step += 1
    out = step_metrics(over_ranks(opt_step_metrics, acc), [n / sum(norm) for n in norm], optim)
    batches = [b for m in packed_mini_batches for b in m.batches]
    real = sum(b.num_real_tokens for b in batches if b is not None)
    slots = sum(b.num_tokens for b in batches if b is not None)
    out.update(
        train_tokens=float(sum(len(r.token_ids) for r in rows)),
        packed_tokens=float(real),
        padding_frac=1 - real / max(slots, 1),
        micro_batches=float(len(batches)),
        row_tokens=float(
            max((b.input_ids_RS.shape[1] for b in batches if b is not None), default=0)
        ),
        learner_s=time.perf_counter() - t0,
        **peak_memory(learner),
    )
    return out


def pack(learner: Learner, rows: list[TrainingRow]) -> MiniBatch:
    """One mini-batch as a step of its size: normalisers over all ranks, this rank's shard
    packed."""
    acc = learner.accelerator
    idx = balanced_parts(rows, acc.num_processes, exactly_k=True)[acc.process_index]
    batches: list[TrainBatch | None] = [
        b.to(acc.device)
        for b in make_micro_batches(
            [rows[i] for i in idx],
            learner.cfg.micro_batch_tokens,
            learner.pad_id,
            mode=learner.packing,
            one_row=learner.flash,
            row_tokens=learner.cfg.row_tokens,
            pair_cost=learner.pair_cost,
        )
    ]
    return MiniBatch(batches, float(sum(r.num_sampled for r in rows)), float(len(rows)))


def score(learner: Learner, packed_mini_batches: list[MiniBatch]) -> None:
    """No-grad pass before any update (later mini-batches are then off-policy, as they should
    be): recomputed old logprobs and reference logprobs, [B, T] per micro-batch."""
    recompute, kl = learner.cfg.old_logprobs == "recompute", learner.loss_cfg.kl_coef > 0
    for mini_batch in packed_mini_batches:
        mini_batch.olds, mini_batch.refs = (
            [None] * len(mini_batch.batches),
            [None] * len(mini_batch.batches),
        )
    if not (recompute or kl):
        return
    if learner.ref is not None and learner.cfg.ref_offload:
        learner.ref.to(learner.accelerator.device)
    with torch.no_grad():
        for mini_batch in packed_mini_batches:
            if recompute:
                mini_batch.olds = [
                    forward_layout(learner, learner.model, mb) for mb in mini_batch.batches
                ]
            if kl and learner.ref is not None:
                mini_batch.refs = [
                    forward_layout(learner, learner.ref, mb) for mb in mini_batch.batches
                ]
            elif kl:  # LoRA: the reference is the base model, adapter off
                mini_batch.refs = [
                    forward_layout(learner, learner.model, mb, disable_adapter=True)
                    for mb in mini_batch.batches
                ]
    if learner.ref is not None and learner.cfg.ref_offload:
        learner.ref.to("cpu")


def forward_layout(learner: Learner, module, mb: TrainBatch | None, **kw) -> torch.Tensor | None:
    lp_M, _ = module(
        mb or TrainBatch.empty(learner.pad_id, learner.accelerator.device),
        learner.temperature,
        **kw,
    )
    return None if mb is None else to_loss_layout(lp_M, mb)


def micro_step(
    learner: Learner, mb: TrainBatch | None, mini_batch: MiniBatch, k: int, *, measure_gap: bool
) -> dict[str, float]:
    """Forward and backward of micro-batch `mb` (number `k` of `mini`); `measure_gap`: log the
    rollout/learner logprob gap (only before the first update, so it measures the engine)."""
    world = learner.accelerator.num_processes
    entropy_in_loss = learner.loss_cfg.entropy_coef != 0
    lp_M, ent_M = learner.model(
        mb or TrainBatch.empty(learner.pad_id, learner.accelerator.device),
        learner.temperature,
        entropy_grad=entropy_in_loss,
    )
    if mb is None:  # this rank has no data left: a zero loss that still reaches every parameter
        learner.accelerator.backward(lp_M.sum() * 0.0)
        return {}
    lp_BT = to_loss_layout(lp_M, mb)
    rollout_BT, mask_BT = mb.rollout_logprobs_BT, mb.loss_mask_BT
    old_BT = rollout_BT if mini_batch.olds[k] is None else mini_batch.olds[k]
    loss, metrics = compute_loss(
        learner.loss_cfg,
        lp_BT,
        old_BT,
        mb.loss_advantages,
        mask_BT,
        ref_logprobs_BT=mini_batch.refs[k],
        entropy_BT=to_loss_layout(ent_M, mb) if entropy_in_loss else None,
        rollout_logprobs_BT=rollout_BT if learner.cfg.old_logprobs == "recompute" else None,
        num_tokens=mini_batch.num_tokens,
        num_seqs=mini_batch.num_seqs,
    )
    learner.accelerator.backward(loss * world)
    with torch.no_grad():
        m = mask_BT > 0
        lp, old = lp_BT.detach()[m], old_BT[m]
        ratio = torch.exp((lp - old).clamp(-20, 20))
        out = dict(
            metrics,
            ratio_mean=float(ratio.mean()),
            ratio_min=float(ratio.min()),
            ratio_max=float(ratio.max()),
        )
        if not entropy_in_loss:
            out["entropy"] = float(ent_M.detach().mean())
        if measure_gap:
            gap = (lp - rollout_BT[m]).abs()
            out.update(logprob_gap_mean=float(gap.mean()), logprob_gap_max=float(gap.max()))
    return out


def max_over_ranks(learner: Learner, ns: list[int]) -> list[int]:
    if learner.accelerator.num_processes == 1:
        return ns
    t = torch.tensor(ns, device=learner.accelerator.device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return [int(n) for n in t.tolist()]


def peak_memory(learner: Learner) -> dict[str, float]:
    device = learner.accelerator.device
    if device.type == "cuda":
        return {"mem/peak_gb": torch.cuda.max_memory_allocated(device) / 2**30}
    # CPU: the process's peak resident size so far (Linux reports KiB); not reset per step.
    return {"mem/rss_peak_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
