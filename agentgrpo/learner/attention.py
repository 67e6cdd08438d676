"""How packed rows keep their sequences apart: the attention path, its wiring and its check.

Paths (`learner.attention`): `segments` (`segments.py`: each sequence on its own, sdpa, any
device), `varlen` (here: torch's variable-length flash attention from the flat tokens and their
sequences' offsets, no mask; CUDA, torch >= 2.10), or the 4D mask. `choose_attention` picks one
(`auto`: varlen where `varlen_blocker` finds nothing against it, segments on long CPU rows, else
the mask) and says why; `probe_rows` and `CHECK_TOLERANCE` are the start-up check of that pick.

Wiring: `use_segments` / `use_varlen` register the path with transformers' `AttentionInterface`
and switch the model to it; `PolicyForward` passes the micro-batch's layout (`Segments` /
`Varlen`) through the decoder's kwargs. A call without it (a weight-sync probe, a plain
`model(...)`) gets transformers' sdpa with its own mask, and a layer that never saw the layout
makes `PolicyForward` raise rather than attend across sequences. Soft-capping and attention sinks
are refused by name. Why, and what each path costs: docs/learner.md ("Packing").
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from agentgrpo.learner.batch import TrainBatch, training_rows
from agentgrpo.learner.segments import (
    SEGMENTS,
    Segments,
    _refuse_unsupported,
    segment_attention,
    take_rows,
)
from agentgrpo.types import Advantage, StopReason, TrainingRow, Trajectory

__all__ = [
    "AUTO_MIN_SHARE",
    "AttentionChoice",
    "AttentionUnavailable",
    "CHECK_TOLERANCE",
    "SEGMENTS",
    "Segments",
    "VARLEN",
    "VARLEN_KERNEL",
    "Varlen",
    "causal_varlen",
    "choose_attention",
    "flex_block_mask",
    "probe_rows",
    "probe_trajectories",
    "register",
    "segment_attention",
    "take_rows",
    "use_segments",
    "use_varlen",
    "varlen_attention",
    "varlen_blocker",
]

# `attention: auto` runs segments on a micro-batch only where its rows' masked attention would cost
# at least this share of their matmuls (r x T, `batch.attention_pair_cost`); 0.4 = 1229 tokens for
# SmolLM2-135M (r = 1/3072). Chosen from CPU measurements (docs/performance.md): segments lost at a
# share of 0.22, were even at 0.28 and won from 0.5.
AUTO_MIN_SHARE = 0.4


def flex_block_mask(batch: TrainBatch):
    """The row layout as a flex-attention `BlockMask`, for models running transformers'
    `flex_attention`: `TrainBatch.attention_mask_B1TT`'s rule (a key at or before the query, in its
    segment or in the prefix it continues) as a mask_mod, so the kernel skips every 128 x 128 block
    that no query of it may see (across sequences, above the diagonal): varlen attention without
    flash-attn, shared prompts included. Built once per micro-batch, shared by every layer.
    torch has no flex backward on the CPU (the learner refuses it there); forward runs compiled."""
    from torch.nn.attention.flex_attention import create_block_mask

    seg_RS, vis_RS = batch.segment_ids_RS, batch.visible_ids_RS

    def sees(b, h, q, kv):
        return (kv <= q) & ((seg_RS[b, kv] == seg_RS[b, q]) | (seg_RS[b, kv] == vis_RS[b, q]))

    R, S = seg_RS.shape
    return create_block_mask(sees, R, None, S, S, device=seg_RS.device)


def register() -> None:
    """Make `SEGMENTS` and `VARLEN` transformers attention implementations (idempotent). Their
    mask function is sdpa's, so calls without `segments` / `varlen` get the mask sdpa would."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    for name, fn in ((SEGMENTS, segment_attention), (VARLEN, varlen_attention)):
        AttentionInterface.register(name, fn)
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, sdpa_mask)


def use_segments(model: torch.nn.Module) -> None:
    """Switch `model` (a transformers PreTrainedModel) to segment attention; ValueError when it
    cannot (its attention does not go through transformers' AttentionInterface)."""
    _switch(model, SEGMENTS)


def _switch(model: torch.nn.Module, name: str) -> None:
    register()
    model.set_attn_implementation(name)
    got = getattr(model.config, "_attn_implementation", None)
    if got != name:
        raise ValueError(
            f"{type(model).__name__} kept attention {got!r}: it does not dispatch through "
            "transformers' AttentionInterface; set learner.attention: mask"
        )


VARLEN = "agentgrpo_varlen"


def _torch_varlen_attn() -> Callable | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch < 2.10
        return None
    return varlen_attn


# The kernel `varlen_attention` calls: torch's varlen_attn (CUDA only), None where torch lacks it.
# Tests put a per-sequence sdpa reference of the same contract here to check the wiring on a CPU.
VARLEN_KERNEL: Callable | None = _torch_varlen_attn()


@dataclass
class Varlen:
    """A micro-batch's row layout as variable-length attention takes it (docs/learner.md, "Varlen"):
    the flat [R*S] tokens cut into N runs, run i's queries at [cu_seq_q[i], cu_seq_q[i+1]) and its
    keys at [cu_seq_k[i], cu_seq_k[i+1]) of the flat keys, which are the tokens themselves
    (`k_idx` None) or, with shared prompts, the tokens at `k_idx`: each run's prompt, then itself.
    Built once per micro-batch, shared by every layer; each call counts itself in `calls`."""

    cu_seq_q: torch.Tensor  # [N + 1] int32
    cu_seq_k: torch.Tensor  # [N + 1] int32
    max_q: int
    max_k: int
    k_idx: torch.Tensor | None  # [cu_seq_k[-1]] long, flat positions of the keys
    calls: int = field(default=0)

    @classmethod
    def of(cls, batch: TrainBatch) -> Varlen:
        seg_RS = batch.segment_ids_RS.cpu().numpy()
        vis_RS = batch.visible_ids_RS.cpu().numpy()
        R, S = seg_RS.shape
        seg, vis = seg_RS.reshape(-1), vis_RS.reshape(-1)
        new = np.ones(R * S, dtype=bool)  # where a run starts: a row's start or a new segment
        new[1:] = seg[1:] != seg[:-1]
        new[::S] = True
        starts = np.flatnonzero(new)
        ends = np.append(starts[1:], R * S)
        run_of = {(s // S, int(seg[s])): (s, e) for s, e in zip(starts, ends, strict=True)}
        prefix = [  # (start, end) of the prompt a run continues, or an empty one
            run_of[(s // S, int(vis[s]))] if vis[s] != seg[s] else (s, s) for s in starts
        ]
        own = ends - starts
        keys = own + np.array([pe - ps for ps, pe in prefix])
        k_idx = None
        if (keys != own).any():
            k_idx = np.concatenate(
                [np.r_[ps:pe, s:e] for (ps, pe), s, e in zip(prefix, starts, ends, strict=True)]
            )
        device = batch.segment_ids_RS.device

        def offsets(lengths: np.ndarray) -> torch.Tensor:
            cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
            return torch.from_numpy(cu).to(device)

        return cls(
            offsets(own),
            offsets(keys),
            int(own.max()),
            int(keys.max()),
            None if k_idx is None else torch.from_numpy(k_idx).to(device),
        )


def varlen_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    varlen: Varlen | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: query [R, H, S, D], key/value [R, KV, S, D] ->
    ([R, S, H, D], None), each run of `varlen` attending causally to its keys in one
    `VARLEN_KERNEL` call. Without `varlen`, transformers' sdpa with the mask it was given."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if varlen is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    _refuse_unsupported("varlen", kwargs)
    if dropout:
        raise ValueError(
            f"varlen attention has no dropout (this model's attention dropout is {dropout}): "
            "set learner.attention: mask"
        )
    varlen.calls += 1
    R, H, S, D = query.shape
    KV = key.shape[1]
    # Under autocast sdpa would run in the autocast dtype; the kernel is no autocast op, and
    # rotary embeddings in fp32 turn bf16 queries and keys into fp32 ones: cast as sdpa would.
    kind = query.device.type
    dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else query.dtype
    q = query.transpose(1, 2).reshape(R * S, H, D).to(dtype)  # [R*S, H, D]
    k, v = (x.transpose(1, 2).reshape(R * S, KV, D).to(dtype) for x in (key, value))
    if varlen.k_idx is not None:  # each run's prompt, then itself
        k, v = take_rows(k, varlen.k_idx), take_rows(v, varlen.k_idx)
    out = causal_varlen(
        q, k, v, varlen.cu_seq_q, varlen.cu_seq_k, varlen.max_q, varlen.max_k, scale=scaling
    )
    return out.view(R, S, H, D), None


def causal_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor,
    max_q: int,
    max_k: int,
    scale: float | None = None,
) -> torch.Tensor:
    """`VARLEN_KERNEL`'s causal attention (aligned to the bottom right: a sequence's last query sees
    all its keys, so a continuation sees its whole prompt), q [T_q, H, D], k/v [T_k, KV, D] ->
    [T_q, H, D], through whichever signature this torch's varlen_attn has."""
    H, KV, D = q.shape[1], k.shape[1], q.shape[2]
    params = _kernel_params(VARLEN_KERNEL)
    kw: dict = {}
    if "window_size" in params:  # torch >= 2.11
        kw["window_size"] = (-1, 0)
    else:  # torch 2.10
        kw["is_causal"] = True
    if H != KV:
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        else:  # every query head gets its own copy of its key/value head
            k, v = (x.repeat_interleave(H // KV, dim=1) for x in (k, v))
    if "scale" in params:
        kw["scale"] = scale
    elif scale is not None and not math.isclose(scale, D**-0.5):
        raise ValueError(
            f"this torch's varlen_attn takes no scale, and this model scales attention by "
            f"{scale}, not 1/sqrt(head dim): set learner.attention: mask"
        )
    return VARLEN_KERNEL(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, **kw)


@functools.lru_cache(maxsize=4)
def _kernel_params(kernel: Callable) -> frozenset[str]:
    """The keyword arguments `kernel` takes: torch 2.10's varlen_attn takes `is_causal` only, 2.11
    and later a causal `window_size`; `scale` and `enable_gqa` are read where present."""
    return frozenset(inspect.signature(kernel).parameters)


# flash attention's limits, as torch's varlen_attn checks them (torch/nn/attention/varlen.py
# calls aten's flash kernel; it runs on sm_80 and later, in bf16 or fp16, head dim <= 256).
_VARLEN_DTYPES = (torch.bfloat16, torch.float16)


def varlen_blocker(
    device_type: str,
    capability: tuple[int, int] | None,
    dtype: torch.dtype,
    config: object,
    sliding_window: int | None,
) -> str | None:
    """Why variable-length flash attention cannot run the model here, or None when it can.
    `capability`: the CUDA GPU's (major, minor); `dtype`: what attention runs in (bf16 under
    autocast, else the parameters'); `sliding_window`: the model's window
    (`logprobs.sliding_window_of`)."""
    if VARLEN_KERNEL is None:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen (torch 2.10 and later)"
    if device_type != "cuda":
        return f"the learner runs on {device_type}, and varlen_attn is a CUDA kernel"
    if capability is not None and capability < (8, 0):
        sm = f"sm_{capability[0]}{capability[1]}"
        return f"flash attention needs a GPU of sm_80 or later, this one is {sm}"
    if dtype not in _VARLEN_DTYPES:
        return (
            f"attention runs in {str(dtype).removeprefix('torch.')} (learner.autocast off and "
            "learner.dtype float32), and flash attention takes bf16 or fp16 only"
        )
    heads = getattr(config, "num_attention_heads", None)
    head_dim = getattr(config, "head_dim", None) or (
        getattr(config, "hidden_size", 0) // heads if heads else None
    )
    if head_dim and (head_dim > 256 or head_dim % 8):
        return f"head dim {head_dim}: flash attention takes multiples of 8 up to 256"
    if getattr(config, "attn_logit_softcapping", None):
        return "the model soft-caps its attention logits, which varlen_attn does not"
    if sliding_window is not None:
        return f"the model has sliding-window layers ({sliding_window} tokens)"
    if getattr(config, "attention_dropout", 0.0):
        return "the model has attention dropout, which varlen_attn does not"
    return None


class AttentionUnavailable(ValueError):
    """`learner.attention` (or its pairing with `attn_implementation`) cannot run on this machine
    or model: a setting to change, which the run reports as a config error."""


@dataclass(frozen=True)
class AttentionChoice:
    """How packed rows keep sequences apart, and why (printed once at start-up): `path` is
    `varlen`, `segments`, `mask`, or the model's own kernel (flash_attention_2, flex_attention),
    which packs by itself."""

    path: str
    reason: str


def choose_attention(
    setting: Literal["auto", "varlen", "segments", "mask"],
    *,
    device_type: str,
    capability: tuple[int, int] | None,
    dtype: torch.dtype,
    config: object,
    kernel: str,
    sliding_window: int | None = None,
) -> AttentionChoice:
    """`learner.attention` on this device for this model (`kernel`: its attn_implementation).
    auto: varlen where `varlen_blocker` finds nothing against it (CUDA); on the CPU segment
    attention on rows long enough to pay (`AUTO_MIN_SHARE`), else the 4D mask; the mask on a GPU
    without varlen (segments measured slower there: docs/performance.md). Asking for varlen where
    it cannot run is an AttentionUnavailable (a ValueError) that says why."""
    if "flash" in kernel or kernel == "flex_attention":
        if setting != "auto":
            raise AttentionUnavailable(
                f"learner.attention={setting!r} with {kernel}: that kernel keeps sequences apart "
                "itself (flash by position ids, flex by a block mask), with neither the 4D mask, "
                "segments nor varlen; leave it 'auto'"
            )
        how = "position ids" if "flash" in kernel else "a block mask"
        return AttentionChoice(kernel, f"learner.attn_implementation={kernel} packs by {how}")
    blocker = varlen_blocker(device_type, capability, dtype, config, sliding_window)
    if setting == "varlen":
        if blocker is not None:
            raise AttentionUnavailable(
                f"learner.attention=varlen cannot run here: {blocker}; use auto or mask"
            )
        return AttentionChoice("varlen", "asked for (learner.attention=varlen)")
    if setting != "auto":
        return AttentionChoice(setting, f"asked for (learner.attention={setting})")
    if blocker is None:
        return AttentionChoice(
            "varlen", "auto: variable-length flash attention (torch varlen_attn) on CUDA"
        )
    if device_type == "cpu":
        return AttentionChoice(
            "segments",
            f"auto on the CPU: segments on rows where masked attention would cost >= "
            f"{AUTO_MIN_SHARE} of the matmuls, else the 4D mask",
        )
    return AttentionChoice("mask", f"auto: the 4D mask, as varlen cannot run: {blocker}")


def use_varlen(model: torch.nn.Module) -> None:
    """Switch `model` to varlen attention (as `use_segments`)."""
    _switch(model, VARLEN)


# --- the start-up check of the path `auto` chose ----------------------------------------------

# How far the chosen path may lie from the 4D mask on the probe batch (`logprobs.attention_gap`:
# the mean absolute difference of the loss tokens' logprobs or entropies), by the dtype attention
# runs in. On SmolLM2-135M (bench/attention_check.py, numbers in docs/learner.md) right kernels lie
# ~1e-5 away in fp32 and ~0.06 under bf16 autocast, wrong ones (a misplaced causal diagonal,
# sequences that see each other) ~2: the tolerances sit between, a factor of 4 or more from each.
CHECK_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 0.25, torch.float16: 0.25}


def probe_trajectories(vocab_size: int, seed: int = 0) -> list[Trajectory]:
    """A small step to check an attention path on: two groups of three sharing a prompt, with
    continuations of different lengths, one of them two sampled turns around a tool output (mask 0),
    and a lone sequence; random token ids (a fixed generator). Packed as the learner packs, it puts
    prompts, continuations and row tails in one row, every layout the paths must keep apart."""
    g = torch.Generator().manual_seed(seed)

    def ids(n: int) -> list[int]:
        return torch.randint(0, vocab_size, (n,), generator=g).tolist()

    def trajectory(group: str, prompt: list[int], turns: list[tuple[int, int]]) -> Trajectory:
        token_ids, mask = list(prompt), [0] * len(prompt)
        for n, m in turns:
            token_ids += ids(n)
            mask += [m] * n
        return Trajectory(
            task_id=group,
            token_ids=token_ids,
            loss_mask=mask,
            logprobs=[-1.0 * m for m in mask],
            prompt_len=len(prompt),
            messages=[],
            stop_reason=StopReason.COMPLETED,
            reward=0.0,
            group_id=group,
        )

    out = []
    for group, prompt_len, turns in (
        ("probe-a", 24, [[(9, 1)], [(5, 1)], [(3, 1), (3, 0), (6, 1)]]),
        ("probe-b", 12, [[(15, 1)], [(2, 1)], [(7, 1)]]),
    ):
        prompt = ids(prompt_len)
        out += [trajectory(group, prompt, t) for t in turns]
    return [*out, trajectory("probe-c", ids(10), [(11, 1)])]


def probe_rows(vocab_size: int, seed: int = 0) -> list[TrainingRow]:
    """`probe_trajectories` as the learner trains them: one row each, advantage 0."""
    trajs = probe_trajectories(vocab_size, seed)
    return training_rows(trajs, {t.id: Advantage(t.id, 0.0) for t in trajs})
