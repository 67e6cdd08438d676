"""The learner's config: optimizer, LR schedule, batching, attention and precision of the policy
update (`LearnerConfig`), and the schedule's factor per optimizer step."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from agentgrpo.learner.batch import PackingMode
from agentgrpo.learner.lora import LoraConfig


class LearnerConfig(BaseModel):
    """Optimizer, schedule, batching and precision of the policy update."""

    model_config = ConfigDict(extra="forbid")

    lr: float = Field(1e-5, gt=0, description="AdamW peak learning rate")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas")
    grad_clip: float = Field(1.0, gt=0, description="max global gradient norm")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant",
        description="after warm-up: constant, or linear / cosine decay to min_lr_ratio * lr "
        "over the run's optimizer steps",
    )
    warmup_steps: int = Field(0, ge=0, description="optimizer steps of linear warm-up from 0 to lr")
    min_lr_ratio: float = Field(
        0.0, ge=0, le=1, description="final lr / peak lr of a decaying schedule"
    )
    micro_batch_tokens: int = Field(
        4096, ge=16, description="token slots (padding included) per micro-batch"
    )
    packing: PackingMode = Field(
        "shared_prefix",
        description="shared_prefix: pack sequences, a group's common prompt computed "
        "once; packed: pack sequences; padded: one sequence per row (see agentgrpo.learner.batch)",
    )
    row_tokens: Literal["auto"] | int = Field(
        "auto",
        description="shared_prefix: the longest a group's row may be before the group is split "
        "(each piece with its own copy of the prompt). Under a mask attention costs the square of "
        "the row; auto = the cap the packer's cost model finds cheapest (batch.make_micro_batches; "
        "under segment attention never a split); an int caps it (micro_batch_tokens = no cap: a "
        "whole group per row)",
    )
    old_logprobs: Literal["rollout", "recompute"] = Field(
        "rollout",
        description="pi_old of the ratio: the engine's sampling logprobs, or the learner's own "
        "recomputed before the first pass (one extra no-grad forward)",
    )
    passes: int = Field(
        1, ge=1, description="passes over each batch (mini_batches optimizer steps each)"
    )
    mini_batches: int = Field(
        1,
        ge=1,
        description="optimizer steps per pass: the step's groups are split into this many "
        "mini-batches (whole groups, balanced by tokens; fewer when the step has fewer groups), "
        "each normalised as a step of its own",
    )
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="parameter dtype")
    autocast: Literal["auto", "bf16", "none"] = Field(
        "auto",
        description="bf16 autocast of the decoder; auto = on where bf16 is native: CUDA, "
        "and CPUs with AVX512-BF16 or AMX (models/hardware.py); none = fp32, what CPUs without "
        "them run fastest",
    )
    gradient_checkpointing: bool = Field(False, description="recompute activations in backward")
    tf32: Literal["auto"] | bool = Field(
        "auto",
        description="CUDA: fp32 matmuls (the LM head under bf16 "
        "autocast) on TF32 tensor cores; auto = under bf16 autocast "
        "(agentgrpo.learner.logprobs.wants_tf32)",
    )
    head_chunk_tokens: int | None = Field(
        None,
        ge=1,
        description="run the LM head over chunks of this many loss tokens, each recomputed "
        "in backward, so only one chunk's [chunk, vocab] logits are alive (learner/logprobs.py); "
        "None: all of a micro-batch's loss tokens at once",
    )
    attn_implementation: str | None = Field(
        None,
        description="set the model's attention kernel (sdpa, eager, flash_attention_2, "
        "flex_attention, ...); flash kernels pack by position ids (varlen) instead of a mask, "
        "flex_attention gets a block mask that skips the blocks across sequences (GPU only)",
    )
    attention: Literal["auto", "varlen", "segments", "mask"] = Field(
        "auto",
        description="how packed rows keep sequences apart (not with flash or flex kernels, which "
        "do it themselves: by position ids, by a block mask): varlen = variable-length flash "
        "attention (torch.nn.attention.varlen, torch >= 2.10, CUDA, bf16/fp16): each sequence "
        "attends to its prompt and itself from cumulative offsets, no mask; segments = the same "
        "pairs, sequences of similar size batched into padded sdpa calls (learner/attention.py); "
        "mask = one call per row under a 4D mask (every pair of the row computed); auto = varlen "
        "where it runs, else on the CPU segments for micro-batches whose rows are long enough to "
        "pay (agentgrpo.learner.attention.AUTO_MIN_SHARE) and the mask for the others, the mask on "
        "other GPUs (segments measured slower there: docs/performance.md); auto's varlen or "
        "segments pick is checked against the mask on a probe batch at start-up and replaced by "
        "the mask where it disagrees",
    )
    ref_offload: bool = Field(
        False,
        description="keep the reference model on the CPU between steps "
        "(not with FSDP, which shards the reference like the policy)",
    )
    checkpoint_format: Literal["full", "sharded"] = Field(
        "full",
        description="full: HF safetensors + the whole optimizer state, gathered and written by "
        "rank 0 (loads anywhere, needs the full state in rank 0's CPU memory); sharded: "
        "torch.distributed.checkpoint, every rank writes its own shards in parallel (loads into "
        "any number of ranks; no HF weights file). Resuming reads either format.",
    )
    collective_timeout_s: float = Field(
        3600.0,
        gt=0,
        description="many processes: how long a rank waits in a collective (other ranks "
        "wait for rank 0's rollouts in one) before the run fails instead of hanging",
    )
    lora: LoraConfig | None = Field(
        None, description="train LoRA adapters (peft) instead of all weights"
    )

    @field_validator("row_tokens")
    @classmethod
    def _row_tokens_positive(cls, v: str | int) -> str | int:
        if v != "auto" and v < 16:
            raise ValueError(f"row_tokens must be 'auto' or an int >= 16, got {v}")
        return v

    @model_validator(mode="after")
    def _row_tokens_need_shared_prefix(self) -> LearnerConfig:
        if self.row_tokens != "auto" and self.packing != "shared_prefix":
            raise ValueError(
                f"row_tokens={self.row_tokens} caps shared-prefix rows, but packing is "
                f"{self.packing!r}: leave row_tokens 'auto'"
            )
        return self


def _lr_lambda(cfg: LearnerConfig, total: int | None):
    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.lr_schedule == "constant":
            return 1.0
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps))
        decay = (
            1 - progress
            if cfg.lr_schedule == "linear"
            else 0.5 * (1 + math.cos(math.pi * progress))
        )
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * decay

    return f
