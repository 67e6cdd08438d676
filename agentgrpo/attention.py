"""Attention over packed rows segment by segment, instead of one kernel call under a [T, T] mask.

A packed row (`agentgrpo.batch`) holds several sequences; under `shared_prefix` a GRPO group's
prompt once, then every member's continuation, which sees that prompt and itself. A 4D mask makes
this exact with one sdpa call per row, but the kernel still computes every (query, key) pair of the
row: for 8 python_math-shaped members of ~870 tokens in one 5311-token row that is ~6x the pairs
anyone needs, and SmolLM2's attention then costs 1.7x its matmuls (the reason `row_tokens: auto`
splits such groups). Here every segment attends on its own: a prompt or a lone sequence causally
to itself, a continuation to [its prompt, itself] with the causal diagonal shifted by the prompt's
length. Segments of similar size are gathered into one padded sdpa batch (a "bucket"; a call per
segment cost more than it saved in a CPU bf16 backward), padding bounded to
`_SLACK` x the segments' own (query, key) rectangles. Nothing is computed across segments; the
numbers are the masked kernel's up to float summation order (tests compare logprobs and gradients).

On the CPU it pays on long rows (whole python_math-shaped groups); on short rows (the calculator's)
the attention pairs shrink 2x only and the gathers cost about what that saves. So
`learner.attention: auto` runs it only on micro-batches whose rows are long enough
(`AUTO_MIN_SHARE`) and the mask elsewhere; `segments` runs it everywhere. On an H200 it was slower
than the masked kernel, so `auto` keeps the masked kernel on GPUs. Both choices rest on one CPU's
and one GPU's measurements: docs/performance.md ("Segment attention against the mask").

How it is wired: `use_segments(model)` registers `segment_attention` with transformers'
`AttentionInterface` under `SEGMENTS` and switches the model to it (models that dispatch attention
through that interface: Llama, Qwen2/3, Mistral, SmolLM2, ...). `PolicyForward` then passes
`segments=Segments.of(batch)` through the decoder's kwargs, which transformers hands to every
attention call. A call without `segments` (anything else that runs the model: a weight-sync probe,
a plain `model(...)`) falls back to transformers' sdpa with its own mask, so the switched model
stays correct for every other use. Each call counts itself on the `Segments`, and `PolicyForward`
checks that every layer saw the layout: a model whose attention did not receive the kwarg raises
instead of silently attending across sequences. Unsupported: logit soft-capping and attention sinks
(a ValueError names the feature; `learner.attention: mask` runs them). A sliding window no packed
layout expresses (segments, flex or the 4D mask): a packed sequence longer than the model's window
is refused (`logprobs.sliding_window_of`); `learner.packing: padded` runs it with the model's masks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from agentgrpo.batch import TrainBatch

SEGMENTS = "agentgrpo_segments"
# kwargs transformers passes to attention functions that change what attention computes; a value
# other than None is a feature this function does not implement.
_UNSUPPORTED = ("sliding_window", "softcap", "s_aux", "sinks", "position_bias")


@dataclass
class _Bucket:
    """Spans of similar size run as one padded sdpa batch: n spans, queries padded to L,
    keys to K."""

    q_idx: (
        torch.Tensor
    )  # [n, L] long, flat [R*S] position of query i of span j (pads: any real one)
    k_idx: torch.Tensor  # [n, K] long, flat position of key t: the prefix, then the span itself
    mask: torch.Tensor  # [n, 1, L, K] bool; a pad query sees key 0 only (no all-masked row, no NaN)
    real: torch.Tensor  # [n * L] bool, the queries that are not padding


@dataclass
class Segments:
    """The row layout of one micro-batch: `spans[i] = (row, start, end, prefix_start, prefix_end)`,
    the query span [start, end) of row `row` attends to keys [prefix_start, prefix_end) +
    [start, end) causally (an empty prefix for a prompt or a lone sequence). Row tails (padding) are
    no span: their attention output is 0 (nothing reads their hidden states).

    Spans run in `buckets`: sorted by key length, grouped while padding them to the group's longest
    keeps the pairs computed within `_SLACK` of the spans' own; each group is one sdpa call on
    gathered, padded queries and keys. `dest`: flat position of every real query, bucket by bucket.
    Built once per micro-batch, shared by every layer."""

    spans: list[tuple[int, int, int, int, int]]
    buckets: list[_Bucket]
    dest: torch.Tensor  # [real queries] long
    calls: int = field(default=0)

    @classmethod
    def of(cls, batch: TrainBatch) -> Segments:
        seg_RS = batch.segment_ids_RS.cpu().numpy()
        vis_RS = batch.visible_ids_RS.cpu().numpy()
        T = seg_RS.shape[1]
        spans = []
        for b, (seg_S, vis_S) in enumerate(zip(seg_RS, vis_RS, strict=True)):
            starts = np.flatnonzero(
                np.diff(seg_S, prepend=-1)
            ).tolist()  # a segment is one contiguous run
            ends = [*starts[1:], T]
            where = {int(seg_S[s]): (s, e) for s, e in zip(starts, ends, strict=True)}
            for s, e in zip(starts, ends, strict=True):
                sid, vid = int(seg_S[s]), int(vis_S[s])
                if sid != 0:  # 0: row tail
                    ps, pe = where[vid] if vid != sid else (s, s)
                    spans.append((b, s, e, ps, pe))
        device = batch.segment_ids_RS.device
        buckets, dest = zip(
            *(_bucket([spans[i] for i in g], T, device) for g in _bucketed(spans)), strict=True
        )
        return cls(spans, list(buckets), torch.from_numpy(np.concatenate(dest)).to(device))


_SLACK = 1.3  # a bucket may compute this many times its spans' own (query, key) rectangles

# `attention: auto` runs segments on a micro-batch only where its rows' masked attention would cost
# at least this share of their matmuls (r x T, `batch.attention_pair_cost`); 0.4 = 1229 tokens for
# SmolLM2-135M (r = 1/3072). Chosen from CPU measurements (docs/performance.md): segments lost at a
# share of 0.22, were even at 0.28 and won from 0.5.
AUTO_MIN_SHARE = 0.4


def _bucketed(spans: list[tuple[int, int, int, int, int]]) -> list[list[int]]:
    own = [e - s for _, s, e, _, _ in spans]
    keys = [pe - ps + e - s for _, s, e, ps, pe in spans]
    groups: list[list[int]] = []
    for i in sorted(range(len(spans)), key=lambda i: (-keys[i], -own[i])):
        g = groups[-1] if groups else None
        if g is not None:
            L, K = max(own[j] for j in g + [i]), keys[g[0]]
            if (len(g) + 1) * L * K <= _SLACK * sum(own[j] * keys[j] for j in g + [i]):
                g.append(i)
                continue
        groups.append([i])
    return groups


def _bucket(
    spans: list[tuple[int, int, int, int, int]], T: int, device: torch.device
) -> tuple[_Bucket, np.ndarray]:
    """The bucket of `spans` in a batch of rows of T, and the flat positions of its real queries."""
    own = np.array([e - s for _, s, e, _, _ in spans])[:, None]
    P = np.array([pe - ps for _, s, e, ps, pe in spans])[:, None]
    base = np.array([b * T + s for b, s, _, _, _ in spans])[:, None]
    pbase = np.array([b * T + ps for b, _, _, ps, _ in spans])[:, None]
    L, K = int(own.max()), int((own + P).max())
    i, t = np.arange(L)[None, :], np.arange(K)[None, :]
    q_idx = base + np.minimum(i, own - 1)
    k_idx = np.where(t < P, pbase + t, base + np.clip(t - P, 0, own - 1))
    real_q = i < own  # [n, L]
    mask = (t[:, None, :] <= P[:, :, None] + i[:, :, None]) & (
        t[:, None, :] < (P + own)[:, :, None]
    )
    mask = np.where(real_q[:, :, None], mask, t[:, None, :] == 0)
    bucket = _Bucket(
        *(torch.from_numpy(x).to(device) for x in (q_idx, k_idx, mask[:, None], real_q.reshape(-1)))
    )
    return bucket, (base + i)[real_q]


def segment_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    segments: Segments | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: query [B, H, T, D], key/value [B, KV, T, D] ->
    ([B, T, H, D], None)."""
    from transformers.integrations.sdpa_attention import repeat_kv, sdpa_attention_forward

    if segments is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    for name in _UNSUPPORTED:
        if kwargs.get(name) is not None:
            raise ValueError(
                f"segment attention does not implement {name} (this model uses it): "
                "set learner.attention: mask"
            )
    segments.calls += 1
    R, H, S, D = query.shape  # the packed rows, as transformers passes them: [R, heads, S, D]
    rep = H // key.shape[1]
    q, k, v = (
        x.transpose(1, 2).reshape(R * S, x.shape[1], D) for x in (query, key, value)
    )  # [R*S, heads, D]
    outs = []
    for bk in segments.buckets:
        o = F.scaled_dot_product_attention(
            q[bk.q_idx].transpose(1, 2),
            repeat_kv(k[bk.k_idx].transpose(1, 2), rep),
            repeat_kv(v[bk.k_idx].transpose(1, 2), rep),
            attn_mask=bk.mask,
            dropout_p=dropout,
            scale=scaling,
        )
        outs.append(o.transpose(1, 2).reshape(-1, H, D)[bk.real])  # [real queries, H, D]
    real = torch.cat(outs)  # in sdpa's dtype (bf16 under autocast, whatever the query's)
    return real.new_zeros(R * S, H, D).index_put((segments.dest,), real).view(R, S, H, D), None


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
    """Make `SEGMENTS` a transformers attention implementation (idempotent). Its mask function is
    sdpa's, so calls without `segments` get the mask sdpa would."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(SEGMENTS, segment_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(SEGMENTS, sdpa_mask)


def use_segments(model: torch.nn.Module) -> None:
    """Switch `model` (a transformers PreTrainedModel) to segment attention; ValueError when it
    cannot (its attention does not go through transformers' AttentionInterface)."""
    register()
    model.set_attn_implementation(SEGMENTS)
    got = getattr(model.config, "_attn_implementation", None)
    if got != SEGMENTS:
        raise ValueError(
            f"{type(model).__name__} kept attention {got!r}: it does not dispatch through "
            "transformers' AttentionInterface; set learner.attention: mask"
        )
