"""Token logprobs of packed micro-batches, with the LM head run only where a loss needs it.

`PolicyForward` wraps a causal LM (a transformers `*ForCausalLM`, or a peft model around one) so
that one `forward` returns the logprobs of a micro-batch's loss tokens. It is the module accelerate
prepares (DDP/FSDP wrap it), so gradient synchronisation hooks see every forward. The decoder runs
on all packed tokens, the head only on the M hidden states that predict a loss token: the numbers
of `model(...).logits`, for a fraction of the head's FLOPs and of its [*, V] memory.

Precision: under autocast the decoder runs in bf16, but the head and the log-softmax run with
autocast off (fp32 unless the parameters were cast), so the only bf16 rounding is in the hidden
states; on CUDA the head may run on TF32 tensor cores (`tf32_matmuls`). `head_chunk_tokens` runs
the head over chunks of loss tokens under activation checkpointing: the same numbers, one chunk's
logits alive at a time. Why and what it costs: docs/learner.md ("Precision", "Head chunks").
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Sequence
from typing import Literal

import torch
from torch.utils.checkpoint import checkpoint

from agentgrpo.learner.attention import (
    SEGMENTS,
    VARLEN,
    Segments,
    Varlen,
    flex_block_mask,
    take_rows,
)
from agentgrpo.learner.batch import TrainBatch, attention_pair_cost


@contextlib.contextmanager
def tf32_matmuls(enabled: bool):
    """CUDA's fp32 matmuls on TF32 tensor cores while the block runs (and the backward it starts),
    then back to what was set. torch's flag is process-wide: a CUDA matmul of another thread in the
    meantime runs on TF32 too."""
    if not enabled:
        yield
        return
    flags = torch.backends.cuda.matmul
    before, flags.allow_tf32 = (
        flags.allow_tf32,
        True,
    )  # the legacy name: torch 2.9 .. 2.13 read it alike
    try:
        yield
    finally:
        flags.allow_tf32 = before


def wants_tf32(setting: str | bool, device: torch.device, bf16_autocast: bool) -> bool:
    """The learner's `tf32` setting on `device`: auto = on CUDA under bf16 autocast, where the
    head's input, bf16 values, is exact in TF32 and only the head's weights (and in backward the
    logits' gradient) are rounded; the fp32 matmuls of a decoder without autocast stay fp32 unless
    asked."""
    if setting is True and device.type != "cuda":
        raise ValueError(
            f"learner.tf32=true: TF32 is a CUDA matmul mode, and this learner runs on "
            f"{device.type}; leave it 'auto'"
        )
    return device.type == "cuda" and (setting is True or (setting == "auto" and bf16_autocast))


def causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """The `*ForCausalLM` inside `model` (itself, or the base model of a peft wrapper)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if get_base is not None else model


def attn_implementation(model: torch.nn.Module) -> str:
    return str(getattr(causal_lm(model).config, "_attn_implementation", "eager") or "eager")


def uses_flash(model: torch.nn.Module) -> bool:
    """True for flash-attention kernels, which take no 4D mask but pack by position ids (varlen)."""
    return "flash" in attn_implementation(model)


class PolicyForward(torch.nn.Module):
    """`forward(batch, temperature)` -> (logprobs_M, entropy_M) of the batch's loss tokens.

    `logprobs_M[m] = log softmax(head(h[pred_index_M[m]]) / T)[target_ids_M[m]]`; temperature 0
    (greedy rollouts) scores with T = 1, as the engines report. `entropy_M` is the entropy of the
    same distribution (always returned: it costs an elementwise pass over [M, V], small next to the
    head's matmul; it carries a gradient only with `entropy_grad=True`).
    `disable_adapter=True` runs a peft model's base weights (the LoRA reference).
    `head_chunk_tokens`: see the module docstring (None: the head over all M at once).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        autocast_bf16: bool = False,
        head_chunk_tokens: int | None = None,
        segment_min_share: float = 0.0,
    ) -> None:
        super().__init__()
        lm = causal_lm(model)
        if getattr(lm.config, "final_logit_softcapping", None) or getattr(
            lm.config, "logit_scale", None
        ):
            raise ValueError(
                "models whose head does more than lm_head(h) (logit soft-capping or "
                "scaling) are not supported by the head-only logprob path"
            )
        # Granite divides its logits by `logits_scaling` after lm_head; so does this path.
        self.logits_divisor = float(getattr(lm.config, "logits_scaling", None) or 1.0)
        self.model = model
        self.autocast_bf16 = autocast_bf16
        self.head_chunk_tokens = head_chunk_tokens
        self.segment_min_share = segment_min_share
        # accelerate's FSDP auto-wrap policy reads this to find the transformer blocks.
        self._no_split_modules = getattr(lm, "_no_split_modules", None)

    def forward(
        self,
        batch: TrainBatch,
        temperature: float = 1.0,
        *,
        disable_adapter: bool = False,
        entropy_grad: bool = False,
        layout: Literal["configured", "chosen", "mask"] = "configured",
    ) -> tuple[torch.Tensor, torch.Tensor]:
        lm = causal_lm(self.model)
        decoder, head = lm.get_decoder(), lm.get_output_embeddings()
        device = batch.input_ids_RS.device
        off = self.model.disable_adapter() if disable_adapter else contextlib.nullcontext()
        amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=self.autocast_bf16)
        share = 0.0 if layout == "chosen" else self.segment_min_share
        layout_kw = _layout_kwargs(lm, batch, self.autocast_bf16, share, mask=layout == "mask")
        with off:
            with amp:
                hidden_RSH = decoder(
                    input_ids=batch.input_ids_RS,
                    position_ids=batch.position_ids_RS,
                    use_cache=False,
                    **layout_kw,
                ).last_hidden_state
            _check_layout_seen(lm, layout_kw)
            h_MH = take_rows(hidden_RSH.flatten(0, 1), batch.pred_index_M)
            run = functools.partial(
                _head_logprobs,
                head,
                temperature=temperature,
                entropy_grad=entropy_grad,
                divisor=self.logits_divisor,
            )
            chunk, M = self.head_chunk_tokens, h_MH.shape[0]
            if not chunk or M <= chunk:
                return run(h_MH, batch.target_ids_M)
            if (
                torch.is_grad_enabled()
            ):  # keep only each chunk's input; backward recomputes its head
                run = functools.partial(checkpoint, run, use_reentrant=False)
            parts = [
                run(h_MH[i : i + chunk], batch.target_ids_M[i : i + chunk])
                for i in range(0, M, chunk)
            ]
        return torch.cat([lp for lp, _ in parts]), torch.cat([ent for _, ent in parts])


def _head_logprobs(
    head: torch.nn.Module,
    h_MH: torch.Tensor,
    target_ids_M: torch.Tensor,
    *,
    temperature: float,
    entropy_grad: bool,
    divisor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.autocast(h_MH.device.type, enabled=False):
        logits_MV = head(h_MH.to(head.weight.dtype)).float()
    divisor *= temperature if temperature > 0 else 1.0
    if divisor != 1.0:
        logits_MV = logits_MV / divisor
    logz_M = torch.logsumexp(logits_MV, dim=-1)
    logprobs_M = logits_MV.gather(-1, target_ids_M[:, None])[:, 0] - logz_M
    # Without its gradient the entropy is a metric: no [M, V] softmax is kept for backward.
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        probs_MV = torch.softmax(logits_MV, dim=-1)
        entropy_M = logz_M - (probs_MV * logits_MV).sum(-1)
    return logprobs_M, entropy_M


def _layout_kwargs(
    lm: torch.nn.Module,
    batch: TrainBatch,
    bf16: bool,
    segment_min_share: float = 0.0,
    *,
    mask: bool = False,
) -> dict:
    """How the decoder learns the row layout: nothing (plain causal is exact), the runs and offsets
    for varlen attention (a model switched to `VARLEN`), the spans for segment attention
    (`agentgrpo.learner.attention`; on a switched model, for rows where masked attention would cost
    at least `segment_min_share` of the matmuls), a flex BlockMask (`flex_attention` models), or a
    4D mask (which a switched model runs as sdpa; always with `mask`)."""
    if not batch.needs_mask:
        return {"attention_mask": None}
    window = sliding_window_of(lm.config)
    if window is not None and (longest := int(batch.position_ids_RS.max()) + 1) > window:
        raise ValueError(
            f"this model attends through a sliding window of {window} tokens and a packed "
            f"micro-batch holds a sequence of {longest}: the packed layouts' masks cannot say "
            "the window, so its logprobs would be wrong; set learner.packing: padded"
        )
    impl = attn_implementation(lm)
    if mask and impl in (SEGMENTS, VARLEN):
        impl = "sdpa"
    if impl == VARLEN:
        return {"attention_mask": None, "varlen": Varlen.of(batch)}
    S = batch.input_ids_RS.shape[1]
    if impl == SEGMENTS and attention_pair_cost(lm.config) * S >= segment_min_share:
        return {"attention_mask": None, "segments": Segments.of(batch)}
    if impl == SEGMENTS:
        impl = "sdpa"
    if impl == "flex_attention":
        return {"attention_mask": flex_block_mask(batch)}
    mask_R1SS = batch.attention_mask_R1SS()
    if "flash" in impl:
        raise ValueError("flash attention takes no 4D mask: build micro-batches with one_row=True")
    if impl == "eager":  # eager adds the mask to the scores
        dtype = torch.bfloat16 if bf16 else next(lm.parameters()).dtype
        mask_R1SS = torch.zeros(mask_R1SS.shape, dtype=dtype, device=mask_R1SS.device).masked_fill(
            ~mask_R1SS, torch.finfo(dtype).min
        )
    return {"attention_mask": mask_R1SS}


def sliding_window_of(config: object) -> int | None:
    """The attention window of a model that has sliding-window layers (Mistral, Gemma 2/3, Qwen2
    with use_sliding_window), else None. Packed layouts pass their own mask, which transformers
    uses as given: beyond the window it would let tokens see too far, so `_layout_kwargs` refuses
    a packed sequence longer than the window (the padded layout keeps the model's own masks)."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return int(window) if "sliding_attention" in layer_types else None
    return None if getattr(config, "use_sliding_window", True) is False else int(window)


def _check_layout_seen(lm: torch.nn.Module, layout: dict) -> None:
    """Every layer's attention got the segments or varlen layout (each call counts itself)."""
    for name in ("segments", "varlen"):
        if name not in layout:
            continue
        layers = getattr(lm.config, "num_hidden_layers", None)
        if layout[name].calls != layers:
            raise RuntimeError(
                f"{name} attention ran in {layout[name].calls} of {layers} layers: this model's "
                "decoder does not pass its kwargs to attention, so packed sequences would see "
                "each other; set learner.attention: mask"
            )


def attention_gap(forward: torch.nn.Module, batch: TrainBatch, temperature: float) -> float:
    """How far the attention kernel `forward`'s model was switched to (`layout="chosen"`) lies
    from the 4D mask (`layout="mask"`) on `batch`: the mean over its loss tokens of the absolute
    difference of their logprobs, or of their entropies, whichever is larger; no gradients, NaN
    counted as infinite. `forward` is a `PolicyForward`, possibly wrapped by accelerate (DDP,
    FSDP: every rank calls it)."""
    with torch.no_grad():
        lp, ent = forward(batch, temperature, layout="chosen")
        lp_ref, ent_ref = forward(batch, temperature, layout="mask")
    gap = torch.maximum((lp - lp_ref).abs().mean(), (ent - ent_ref).abs().mean())
    return math.inf if gap.isnan() else float(gap)


def to_loss_layout(values_M: torch.Tensor, batch: TrainBatch) -> torch.Tensor:
    """[M] values of the loss tokens -> [B, T] in the batch's loss layout (0 elsewhere); keeps
    grad."""
    N, L = batch.loss_mask_BT.shape
    out = values_M.new_zeros(N * L).index_put((batch.dest_index_M,), values_M)
    return out.view(N, L)


def token_logprobs(
    model: torch.nn.Module,
    input_ids_BT: torch.Tensor,
    attention_mask_BT: torch.Tensor,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Reference implementation on a right-padded batch: logprobs_BT[b, t] = log p(input_ids[b, t] |
    input_ids[b, :t]) at `temperature` from the full logits; 0 at t = 0. Used by tests and
    benchmarks to check the packed, head-only path."""
    logits = model(input_ids=input_ids_BT, attention_mask=attention_mask_BT).logits[:, :-1].float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    targets = input_ids_BT[:, 1:].unsqueeze(-1)
    lp = logits.gather(-1, targets).squeeze(-1) - torch.logsumexp(logits, dim=-1)  # [B, T-1]
    return torch.cat([torch.zeros_like(lp[:, :1]), lp], dim=1)


def sequence_logprobs(
    model: torch.nn.Module, seqs: Sequence[Sequence[int]], temperature: float = 1.0
) -> list[list[float]]:
    """Per-sequence reference: each sequence alone, full logits; entry j = logprob of token j
    (0 at 0)."""
    out = []
    with torch.no_grad():
        for s in seqs:
            ids = torch.tensor([list(s)])
            out.append(token_logprobs(model, ids, torch.ones_like(ids), temperature)[0].tolist())
    return out
