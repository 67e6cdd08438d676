"""The learner under many processes: the launches it refuses, the FSDP2-sharded KL reference, and
resharding after a forward no backward follows."""

from __future__ import annotations

import copy
import os

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import FSDPModule, fully_shard

from agentgrpo.learner.logprobs import PolicyForward


def shard_reference(
    model: torch.nn.Module, autocast_bf16: bool, *, from_main: bool
) -> PolicyForward:
    """The frozen KL reference under FSDP2, sharded like accelerate shards the policy (one unit per
    decoder layer, the model's `_no_split_modules`, then the root; accelerate's own preparation
    wants an optimizer, which a frozen model has no use for).

    Built on the meta device, so no rank holds a second full copy, then filled from rank 0's `model`
    (torch's `set_model_state_dict`, broadcast from rank 0): with RAM-efficient loading
    (`cpu_ram_efficient_loading`) the other ranks' `model` has no weights. Its forwards are
    collective: every rank runs the same reference forwards (`train_step` pads ranks with empty
    batches)."""
    # Parameters on meta; buffers copied (the non-persistent ones, e.g. rotary frequencies, are in
    # no state dict; fully_shard moves them to the device).
    memo = {
        id(p): torch.nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
        for p in model.parameters()
    }
    ref = (
        PolicyForward(copy.deepcopy(model, memo), autocast_bf16=autocast_bf16)
        .eval()
        .requires_grad_(False)
    )
    layers = set(getattr(model, "_no_split_modules", None) or [])
    for module in ref.modules():
        if type(module).__name__ in layers:
            fully_shard(module)
    fully_shard(ref)
    full = {f"model.{k}": v for k, v in model.state_dict().items()} if from_main else {}
    set_model_state_dict(
        ref, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    )
    return ref


def check_launch(acc: Accelerator) -> None:
    """Refuse a launch the learner would get silently wrong."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != acc.num_processes:
        raise ValueError(
            f"WORLD_SIZE={world} but accelerate runs {acc.num_processes} process(es): each "
            "rank would train alone. Without GPUs, launch with torchrun (the learner then "
            "uses gloo) or pass Accelerator(cpu=True)."
        )
    if acc.distributed_type == DistributedType.DEEPSPEED:
        raise ValueError(
            "DeepSpeed is not supported by the learner: its optimizer state and gathered "
            "weights live in DeepSpeed's engine, which checkpoints and weight sync do not "
            "reach. Use FSDP (`accelerate config` -> FSDP)."
        )
    if (
        acc.distributed_type == DistributedType.FSDP
        and (v := acc.state.fsdp_plugin.fsdp_version) != 2
    ):
        # accelerate's default is FSDP1; the learner relies on FSDP2 (DTensor parameters,
        # `fully_shard` for the reference, torch.distributed.checkpoint state dicts), and FSDP1
        # cannot run on a CPU to be tested here.
        raise ValueError(
            f"FSDP version {v}: the learner supports FSDP2 only. Set `fsdp_version: 2` under "
            "`fsdp_config` in the accelerate config file (examples/gpu/accelerate_fsdp2.yml "
            "has it), or export FSDP_VERSION=2."
        )


def total_norm(norm: torch.Tensor) -> float:
    """The gradient norm `clip_grad_norm_` returned, as a number every rank agrees on. Under FSDP2
    it is a DTensor: replicated from torch 2.10 on, but on 2.9 still partial over the shards
    (`_NormPartial`), and its float() is then this rank's own part (2 CPU ranks: 0.54 and 0.53 for a
    norm of 0.76), so rank 0 logged its shard's norm. The clipping itself used the whole norm; only
    the reading was partial. `full_tensor()` reduces it (a no-op once replicated)."""
    full = getattr(norm, "full_tensor", None)
    return float(full() if full is not None else norm)


def reshard(module: torch.nn.Module) -> None:
    """Free the unsharded parameters an FSDP2 forward left behind (the root module keeps them
    gathered after forward, for the backward it expects), when no backward follows: a no-grad
    probe. Does nothing without FSDP."""
    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.reshard()
