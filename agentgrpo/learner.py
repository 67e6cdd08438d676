"""The learner: policy (and optional reference) model, optimizer, one GRPO step.

torch + accelerate: the same code runs on one CPU, one GPU, or under `accelerate launch`.
Memory holds the policy and, only when `kl_coef > 0`, a frozen reference copy; nothing else (no
value model).

One `train_step`:
  1. micro-batches by token budget (`batch.make_micro_batches`);
  2. the step's normalisers (loss tokens, sequences with a loss token) are counted once over the
     whole step, so each micro-batch's loss is its share of the step loss and accumulated gradients
     equal one big batch;
  3. per micro-batch: policy logprobs at the rollout temperature, reference logprobs (no grad),
     `loss.compute_loss`, backward scaled by the world size (DDP/FSDP average over ranks);
  4. gradient clipping, optimizer step.
Old logprobs are the rollout's own (on-policy, one pass); the gap between rollout and learner
logprobs is logged (`logprob_gap_mean`, `logprob_gap_max`).
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from pydantic import BaseModel, ConfigDict, Field

from agentgrpo.batch import TrainBatch, make_micro_batches
from agentgrpo.loss import LossConfig, compute_loss
from agentgrpo.types import Trajectory


class LearnerConfig(BaseModel):
    """Optimizer and batching of the policy update."""

    model_config = ConfigDict(extra="forbid")

    lr: float = Field(1e-5, gt=0, description="AdamW learning rate")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas")
    grad_clip: float = Field(1.0, gt=0, description="max global gradient norm")
    micro_batch_tokens: int = Field(4096, ge=16, description="padded tokens per micro-batch")
    dtype: str = Field("float32", description="parameter dtype: float32 | bfloat16")


def token_logprobs(model: torch.nn.Module, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor,
                   temperature: float = 1.0) -> torch.Tensor:
    """logprobs_BT[b, t] = log p(input_ids[b, t] | input_ids[b, :t]) at `temperature`; 0 at t = 0.

    Temperature 0 (greedy sampling) scores with the plain distribution (T = 1).
    """
    logits = model(input_ids=input_ids_BT, attention_mask=attention_mask_BT).logits[:, :-1].float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    targets = input_ids_BT[:, 1:].unsqueeze(-1)
    lp = logits.gather(-1, targets).squeeze(-1) - torch.logsumexp(logits, dim=-1)  # [B, T-1]
    return torch.cat([torch.zeros_like(lp[:, :1]), lp], dim=1)


class Learner:
    """Owns the policy model and its optimizer.

    Example:
        >>> learner = Learner(model, LearnerConfig(lr=1e-6), LossConfig(), temperature=1.0)
        >>> metrics = learner.train_step(trajectories, advantages)
    """

    def __init__(self, model: torch.nn.Module, cfg: LearnerConfig, loss_cfg: LossConfig, *,
                 temperature: float = 1.0, pad_id: int = 0, accelerator: Accelerator | None = None) -> None:
        self.cfg, self.loss_cfg, self.temperature, self.pad_id = cfg, loss_cfg, temperature, pad_id
        self.accelerator = accelerator or Accelerator()
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(cfg.dtype)
        if dtype is None:
            raise ValueError(f"learner.dtype must be float32 or bfloat16, got {cfg.dtype!r}")
        model = model.to(dtype)
        # beta = 0 means no reference model at all (no memory, no forward passes).
        self.ref_model = None
        if loss_cfg.kl_coef > 0:
            self.ref_model = copy.deepcopy(model).eval().requires_grad_(False).to(self.accelerator.device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=cfg.betas,
                                      weight_decay=cfg.weight_decay)
        self.model, self.optimizer = self.accelerator.prepare(model, optimizer)
        self.model.train()
        self.step = 0

    @property
    def unwrapped(self) -> torch.nn.Module:
        return self.accelerator.unwrap_model(self.model)

    def train_step(self, trajs: Sequence[Trajectory], advantages: Sequence[float]) -> dict[str, float]:
        """One optimizer step on scorable trajectories (NaN advantages or rewards are skipped)."""
        keep = [i for i, t in enumerate(trajs)
                if t.num_sampled > 0 and math.isfinite(advantages[i]) and math.isfinite(t.reward)]
        trajs = [trajs[i] for i in keep]
        advantages = [float(advantages[i]) for i in keep]
        if not trajs:
            return {"loss": 0.0, "skipped": 1.0}
        t0 = time.perf_counter()
        batches = make_micro_batches(trajs, advantages, self.cfg.micro_batch_tokens, self.pad_id)
        num_tokens = sum(float(b.loss_mask_BT.sum()) for b in batches)
        num_seqs = float(sum(t.num_sampled > 0 for t in trajs))
        world = self.accelerator.num_processes
        sums: dict[str, float] = {}
        for mb in batches:
            metrics = self._micro_step(mb.to(self.accelerator.device), num_tokens, num_seqs, world)
            w = float(mb.loss_mask_BT.sum()) / max(num_tokens, 1.0)
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + (v if k == "loss" else v * w)
        grad_norm = self.accelerator.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        sums.update(grad_norm=float(grad_norm), lr=self.optimizer.param_groups[0]["lr"],
                    train_tokens=float(sum(b.num_tokens for b in batches)),
                    micro_batches=float(len(batches)), learner_s=time.perf_counter() - t0)
        return sums

    def _micro_step(self, mb: TrainBatch, num_tokens: float, num_seqs: float, world: int) -> dict[str, float]:
        logprobs_BT = token_logprobs(self.model, mb.input_ids_BT, mb.attention_mask_BT, self.temperature)
        ref_BT = None
        if self.ref_model is not None:
            with torch.no_grad():
                ref_BT = token_logprobs(self.ref_model, mb.input_ids_BT, mb.attention_mask_BT, self.temperature)
        old_BT = mb.rollout_logprobs_BT  # on-policy: the rollout's logprobs are the old policy's
        loss, metrics = compute_loss(self.loss_cfg, logprobs_BT, old_BT, mb.advantages_B, mb.loss_mask_BT,
                                     ref_logprobs_BT=ref_BT, num_tokens=num_tokens, num_seqs=num_seqs)
        self.accelerator.backward(loss * world)
        with torch.no_grad():
            m = mb.loss_mask_BT.bool()
            gap = (logprobs_BT.detach()[m] - old_BT[m]).abs()
        out = {k: float(v) for k, v in metrics.items()}
        out["loss"] = float(loss.detach())
        if gap.numel():
            out["logprob_gap_mean"] = float(gap.mean())
            out["logprob_gap_max"] = float(gap.max())
        return out

    # -- checkpoints ----------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(), "step": self.step}

    def save(self, directory: Path) -> None:
        self.unwrapped.save_pretrained(directory, safe_serialization=True)
        torch.save(self.state(), directory / "learner.pt")

    def load(self, directory: Path) -> None:
        from safetensors.torch import load_file

        weights = {}
        for f in sorted(directory.glob("*.safetensors")):
            weights.update(load_file(f))
        missing, unexpected = self.unwrapped.load_state_dict(weights, strict=False)
        # Tied embeddings (lm_head = embed_tokens) are saved once; anything else missing is corruption.
        missing = [k for k in missing if k != "lm_head.weight"]
        if missing or unexpected:
            raise ValueError(f"checkpoint {directory} does not match the model: missing {missing[:5]}, "
                             f"unexpected {unexpected[:5]}")
        st = torch.load(directory / "learner.pt", weights_only=True)
        self.optimizer.load_state_dict(st["optimizer"])
        self.step = int(st["step"])
