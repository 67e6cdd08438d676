"""The learner: policy (and at most one reference), optimizer, LR schedule, one GRPO step.

torch + accelerate: the same code runs on one CPU, one GPU, or under `accelerate launch` (DDP or
FSDP2). Memory holds the policy and, only when `kl_coef > 0`, a frozen reference (with LoRA: the
same weights with the adapter off); there is no value model. The step itself is `step.py`, the
checkpoints `state.py`; this class chooses the attention path and owns what they share.

Multi-process contract: every rank calls `train_step` with the same list of rows (rank 0's
rollouts, broadcast), and `export_model`, `save` and `load` are collective; rank 0 gets the model
to push and writes the files. Weights and optimizer state are saved keyed by parameter name, so a
checkpoint does not depend on the number of ranks. DeepSpeed and FSDP1 are refused; ranks other
than 0 may pass a model without weights under RAM-efficient loading. The step's order and
normalisers: docs/learner.md ("One step"); ranks, FSDP and loading: docs/many-gpus.md.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, InitProcessGroupKwargs, broadcast_object_list

from agentgrpo.algo.loss import LossConfig
from agentgrpo.learner import state as learner_state
from agentgrpo.learner import step as learner_step
from agentgrpo.learner.attention import (
    AUTO_MIN_SHARE,
    CHECK_TOLERANCE,
    AttentionChoice,
    choose_attention,
    probe_rows,
    use_segments,
    use_varlen,
)
from agentgrpo.learner.batch import (
    PackingMode,
    attention_pair_cost,
    make_micro_batches,
)
from agentgrpo.learner.config import LearnerConfig, _lr_lambda
from agentgrpo.learner.dist import check_launch, reshard, shard_reference
from agentgrpo.learner.logprobs import (
    PolicyForward,
    attention_gap,
    attn_implementation,
    causal_lm,
    sliding_window_of,
    tf32_matmuls,
    token_logprobs,
    uses_flash,
    wants_tf32,
)
from agentgrpo.learner.lora import MergedModel, apply_lora, merged_state_dict
from agentgrpo.models.hardware import choose_bf16
from agentgrpo.types import TrainingRow

__all__ = ["Learner", "LearnerConfig", "token_logprobs"]


class Learner:
    """Owns the policy, its optimizer and schedule, and the reference when the loss needs one.

    Args:
        model: a transformers causal LM (fp32 weights are cast to `cfg.dtype`).
        temperature: the rollout temperature; logprobs are computed at it.
        pad_id: token id of row-tail padding (its value never reaches a loss).
        total_steps: `train_step` calls of the run; needed by decaying LR schedules.

    Example (one step's update and push; the inputs come from the run: `agentgrpo.run.train`):
        ```python
        from agentgrpo.algo.loss import LossConfig
        from agentgrpo.engine.weight_sync import WeightSync
        from agentgrpo.learner.batch import training_rows
        from agentgrpo.learner.config import LearnerConfig
        from agentgrpo.learner.learner import Learner
        from agentgrpo.models.embedded import default_model_path, load_policy

        learner = Learner(load_policy(default_model_path()), LearnerConfig(lr=1e-6), LossConfig(),
                          temperature=1.0)
        # trajectories: the step's (agentgrpo.rollout.group.run_group); advantages: {trajectory
        # id: Advantage} from their groups' rewards (agentgrpo.run.train.assign_advantages)
        metrics = learner.train_step(training_rows(trajectories, advantages))
        sync = WeightSync(engine)  # the engine that sampled them
        await sync.push(learner.export_model(), step)  # merged weights with LoRA
        ```
    """

    def __init__(
        self,
        model: torch.nn.Module,
        cfg: LearnerConfig,
        loss_cfg: LossConfig,
        *,
        temperature: float = 1.0,
        pad_id: int = 0,
        accelerator: Accelerator | None = None,
        total_steps: int | None = None,
    ) -> None:
        if cfg.lr_schedule != "constant" and not total_steps:
            raise ValueError(f"lr_schedule={cfg.lr_schedule!r} needs total_steps (the run's steps)")
        self.cfg, self.loss_cfg, self.temperature, self.pad_id = cfg, loss_cfg, temperature, pad_id
        # Without cpu=True accelerate treats a GPU-less multi-process launch as one process (each
        # rank would silently train alone); the timeout covers ranks waiting for rank 0's rollouts.
        self.accelerator = accelerator or Accelerator(
            cpu=not torch.cuda.is_available(),
            kwargs_handlers=[
                InitProcessGroupKwargs(timeout=timedelta(seconds=cfg.collective_timeout_s))
            ],
        )
        check_launch(self.accelerator)
        self.sharded = self.accelerator.distributed_type == DistributedType.FSDP
        if any(p.is_meta for p in model.parameters()) and (
            self.is_main
            or not (self.sharded and self.accelerator.state.fsdp_plugin.cpu_ram_efficient_loading)
        ):
            raise ValueError(
                "the model has no weights (meta tensors): only ranks other than 0 under FSDP "
                "with cpu_ram_efficient_loading may pass one (rank 0's weights fill it)"
            )
        model = model.to(getattr(torch, cfg.dtype))
        if cfg.attn_implementation:
            model.set_attn_implementation(cfg.attn_implementation)
        # the attention path is switched before the reference is copied from the model, so that
        # the reference gets it too
        self._choose_attention(model)
        if cfg.gradient_checkpointing:
            if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x's name
                model.activation_checkpointing_enable({"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(
                    gradient_checkpointing_kwargs={"use_reentrant": False}
                )
        self.tf32 = wants_tf32(cfg.tf32, self.accelerator.device, self.precision.bf16)
        # kl_coef = 0 means no reference at all (no memory, no forward passes).
        self.ref: PolicyForward | None = (
            self._make_reference(model) if loss_cfg.kl_coef > 0 and cfg.lora is None else None
        )
        # FSDP: rank 0 keeps an unsharded CPU copy of the plain model for weight sync to load the
        # gathered weights into (the engine's probe check needs a model that runs on one process).
        self._export_copy = copy.deepcopy(model).cpu() if self.sharded and self.is_main else None
        self._prepare(model, total_steps)
        self._check_attention()
        self.model.train()
        self.step = 0

    def _choose_attention(self, model: torch.nn.Module) -> None:
        """The attention path (`learner.attention`), the packing it allows, and the cost model's
        price of a cross-sequence pair; switches `model` to the segment or varlen kernel."""
        cfg, device = self.cfg, self.accelerator.device
        self.flash = uses_flash(model)
        self._kernel = attn_implementation(model)  # what a failed start-up check goes back to
        # flex_attention gets each micro-batch's layout as a BlockMask
        # (agentgrpo.learner.attention.flex_block_mask)
        flex = attn_implementation(model) == "flex_attention"
        self.precision = choose_bf16(cfg.autocast, device)
        self.attention = choose_attention(
            cfg.attention,
            device_type=device.type,
            capability=torch.cuda.get_device_capability(device) if device.type == "cuda" else None,
            dtype=torch.bfloat16 if self.precision.bf16 else getattr(torch, cfg.dtype),
            config=getattr(model, "config", None),
            kernel=attn_implementation(model),
            sliding_window=sliding_window_of(getattr(model, "config", None)),
        )
        if flex and device.type == "cpu":
            raise ValueError(
                "learner.attn_implementation=flex_attention: torch has no flex-attention "
                "backward on the CPU; use the default (sdpa) there"
            )
        if self.attention.path == "segments":
            use_segments(model)
        elif self.attention.path == "varlen":
            use_varlen(model)
        # auto: segments only on micro-batches whose rows are long enough for them to pay.
        self.segment_min_share = AUTO_MIN_SHARE if cfg.attention == "auto" else 0.0
        self.packing: PackingMode = (
            "packed" if self.flash and cfg.packing == "shared_prefix" else cfg.packing
        )
        if cfg.row_tokens != "auto" and self.flash:
            raise ValueError(
                f"learner.row_tokens={cfg.row_tokens} caps shared-prefix rows, but flash "
                "attention takes no mask and packs without sharing: leave it 'auto'"
            )
        # Segment and varlen attention compute no pair across sequences, so splitting a group only
        # adds prompt copies: the cost model then never splits (pair cost 0). Flex skips such pairs
        # by the block (128 x 128): taken as the same (whole groups under flex: 1.08x the mask's
        # speed on an H200).
        no_cross_pairs = flex or self.attention.path in ("segments", "varlen")
        self.pair_cost = (
            0.0 if no_cross_pairs else attention_pair_cost(getattr(model, "config", None))
        )

    def _check_attention(self) -> None:
        """`attention: auto`'s pick (varlen on CUDA, segments on the CPU) checked once, before the
        first step: on a probe batch packed as the learner packs (`attention.probe_rows`)
        it must lie within `CHECK_TOLERANCE` of the 4D mask (`logprobs.attention_gap`) for the
        dtype attention runs in. Otherwise, or when it raises, the policy and the reference go back
        to the mask and `self.attention` says why (the start-up line prints it). A path the config
        asked for by name is not second-guessed. Collective: every rank runs the probe, and all
        fall back when one fails."""
        path = self.attention.path
        if self.cfg.attention != "auto" or path not in ("segments", "varlen"):
            return
        lm = causal_lm(self.unwrapped)
        dtype = torch.bfloat16 if self.precision.bf16 else next(lm.parameters()).dtype
        tolerance = CHECK_TOLERANCE.get(dtype, CHECK_TOLERANCE[torch.bfloat16])
        rows = probe_rows(lm.config.vocab_size)
        (probe,) = make_micro_batches(rows, 4096, self.pad_id, mode=self.packing)
        self.model.eval()  # no dropout in either pass
        try:
            with tf32_matmuls(self.tf32):
                gap = attention_gap(self.model, probe.to(self.accelerator.device), self.temperature)
            failure = None
            if not gap <= tolerance:
                failure = (
                    f"on a probe batch its logprobs lie {gap:.3g} from the 4D mask's on average "
                    f"(tolerance {tolerance:g} in {str(dtype).removeprefix('torch.')})"
                )
        except RuntimeError as e:  # a kernel meeting this GPU for the first time may just fail
            failure = f"it raised on a probe batch: {type(e).__name__}: {e}"
        finally:
            self.model.train()
            reshard(self.model)  # no backward follows the probe
        if self.all_ranks(failure is None):
            checked = f"checked against the 4D mask on a probe batch: {gap:.2g} <= {tolerance:g}"
            self.attention = AttentionChoice(path, f"{self.attention.reason}; {checked}")
            return
        self._fall_back_to_mask(f"{path} failed its start-up check: {failure or 'on another rank'}")

    def _fall_back_to_mask(self, why: str) -> None:
        """Put the policy and the reference back on the model's own kernel under the 4D mask."""
        for module in (self.unwrapped, None if self.ref is None else self.ref.model):
            if module is not None:
                causal_lm(module).set_attn_implementation(self._kernel)
        self.pair_cost = attention_pair_cost(causal_lm(self.unwrapped).config)
        self.attention = AttentionChoice("mask", f"auto: {why}; the 4D mask instead")

    def _make_reference(self, model: torch.nn.Module) -> PolicyForward:
        """The frozen reference policy for the KL term: a copy of `model` as it starts (sharded
        like the policy under FSDP; on the CPU with `ref_offload`)."""
        bf16 = self.precision.bf16
        if self.sharded:  # a full copy per rank would undo what FSDP saves on the policy
            if self.cfg.ref_offload:
                raise ValueError(
                    "learner.ref_offload with FSDP: the reference is sharded like the "
                    "policy instead; turn ref_offload off"
                )
            ref = shard_reference(model, bf16, from_main=self.is_main)
        else:
            ref = (
                PolicyForward(copy.deepcopy(model), autocast_bf16=bf16).eval().requires_grad_(False)
            )
            ref = ref.to("cpu" if self.cfg.ref_offload else self.accelerator.device)
        ref.head_chunk_tokens = self.cfg.head_chunk_tokens
        ref.segment_min_share = self.segment_min_share
        return ref

    def _prepare(self, model: torch.nn.Module, total_steps: int | None) -> None:
        """LoRA (if any), AdamW over the trainable parameters and its schedule, and the policy
        prepared by accelerate (`self.model`, `self.optimizer`, `self.scheduler`)."""
        cfg = self.cfg
        if cfg.lora is not None:
            model = apply_lora(model, cfg.lora)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(
            params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay
        )
        per_step = cfg.passes * cfg.mini_batches  # optimizer steps per train_step
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, _lr_lambda(cfg, None if total_steps is None else total_steps * per_step)
        )
        policy = PolicyForward(
            model,
            autocast_bf16=self.precision.bf16,
            head_chunk_tokens=cfg.head_chunk_tokens,
            segment_min_share=self.segment_min_share,
        )
        # accelerate's RAM-efficient FSDP2 preparation moves the model to meta, which unties
        # lm_head from the embeddings, and re-ties it through this method of the module it
        # prepares; untied, the two would train as separate matrices.
        if hasattr(model, "tie_weights"):
            policy.tie_weights = model.tie_weights
        self.model, self.optimizer = self.accelerator.prepare(policy, optimizer)
        # accelerate maps the optimizer to the shards by data pointer, 0 for every meta tensor (a
        # rank without weights, RAM-efficient loading); the order of `params` is the map.
        if self.sharded:
            optimizer.param_groups[0]["params"] = [
                p for p in self.model.parameters() if p.requires_grad
            ]

    @property
    def unwrapped(self) -> torch.nn.Module:
        """The trained model itself: the transformers model, or the peft model around it."""
        return self.accelerator.unwrap_model(self.model).model

    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank (pickled; the rollouts of a step: the loop generates them on
        rank 0 only and every rank then calls `train_step` with the same list)."""
        if self.accelerator.num_processes == 1:
            return obj
        return broadcast_object_list([obj], from_process=0)[0]

    def all_ranks(self, flag: bool) -> bool:
        """True when `flag` is true on every rank (so that all ranks take the same branch)."""
        if self.accelerator.num_processes == 1:
            return flag
        t = torch.tensor([int(flag)], device=self.accelerator.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
        return bool(t.item())

    def any_rank(self, flag: bool) -> bool:
        """True when `flag` is true on some rank (a stop signal that reached one process)."""
        return not self.all_ranks(not flag)

    def close(self) -> None:
        """End a multi-process run: wait for every rank, then destroy the process group (a rank
        that exits with the group alive can abort at exit, failing a finished run)."""
        if self.accelerator.num_processes > 1:
            self.accelerator.wait_for_everyone()
            self.accelerator.end_training()

    def export_model(self) -> torch.nn.Module | None:
        """The model to hand to `WeightSync.push` on rank 0: plain transformers names, LoRA merged
        in.

        Collective under FSDP: every rank calls it, the full weights are gathered into rank 0's CPU
        copy of the model, and other ranks get None. Otherwise the live model itself (no copy)."""
        if not self.sharded:
            return MergedModel(self.unwrapped) if self.cfg.lora else self.unwrapped
        sd = self.export_state_dict()
        if self._export_copy is None:
            return None
        self._export_copy.load_state_dict(sd)
        return self._export_copy

    def export_state_dict(self) -> dict[str, torch.Tensor]:
        """Full weights under the base model's names, on the CPU, adapters merged. Collective under
        FSDP (the shards are gathered to rank 0; other ranks get an empty dict)."""
        sd = {
            k.removeprefix("model."): v for k, v in learner_state.full_weights(self.model).items()
        }
        if self.cfg.lora is None or not sd:
            return sd
        sd = {k.removeprefix("base_model.model."): v for k, v in sd.items()}
        return merged_state_dict(self.unwrapped, sd)

    # -- one step ----------------------------------------------------------------------------------

    def train_step(self, rows: Sequence[TrainingRow]) -> dict[str, float]:
        """Optimisation passes on one step's training rows (`batch.training_rows`: the segments
        of the trajectories trained on, each with its advantage); returns metrics. A step without
        rows skips the update."""
        with tf32_matmuls(self.tf32):
            return learner_step.train_step(self, rows)

    # -- checkpoints (formats: agentgrpo.learner.state) -----------------------------------------

    def save(self, directory: Path) -> None:
        """Write a checkpoint into `directory` (the same path on every rank; collective). Returns
        on every rank once rank 0 has written its files: a rank that loads it right after (a
        resume, a test) never reads a file still being written."""
        learner_state.save(self, directory)
        self.accelerator.wait_for_everyone()

    def load(self, directory: Path) -> None:
        """Restore what `save` wrote, in either format (collective); ValueError if it does not
        fit."""
        learner_state.load(self, directory)
