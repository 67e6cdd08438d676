"""Segment attention: every sequence of a packed row attends on its own, with no kernel call under
a [T, T] mask (sdpa, any device); the CPU path of `learner.attention`.

A prompt or a lone sequence attends causally to itself, a continuation of a shared prompt to [its
prompt, itself] with the causal diagonal shifted by the prompt's length. Segments of similar size
are gathered into one padded sdpa call (a bucket), whose padding is bounded to `_SLACK` x the
spans' own (query, key) rectangles. Nothing is computed across sequences, so the numbers are the
masked kernel's up to float summation order (tests compare logprobs and gradients). Where it pays,
and what `auto` does with it: docs/learner.md ("Segment attention").
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from agentgrpo.learner.batch import TrainBatch

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


def take_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """`x[idx]`: the rows of `x` at the integer indices `idx` (any shape), with a backward that
    gives the same bits on every run. The indices repeat (a shared prompt's keys serve every
    continuation; its last hidden state predicts every member's first token), so the backward adds
    several gradients into one row. On the CPU, `x[idx]`'s backward (index_put_ with accumulate)
    does that with atomic adds from all threads once the tensor is large, and the order of the
    additions, hence their last bits, follows the thread timing; `index_select`'s backward
    (index_add_) adds them one index after another. On CUDA it is the other way round (index_add_
    is atomic, indexing's backward sorts the indices), so `x[idx]` stays there."""
    if x.device.type != "cpu":
        return x[idx]
    return torch.index_select(x, 0, idx.reshape(-1)).view(*idx.shape, *x.shape[1:])


_SLACK = 1.3  # a bucket may compute this many times its spans' own (query, key) rectangles


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


def _refuse_unsupported(kernel: str, kwargs: dict) -> None:
    """ValueError naming the first of `_UNSUPPORTED` that this model's attention call passes."""
    for name in _UNSUPPORTED:
        if kwargs.get(name) is not None:
            raise ValueError(
                f"{kernel} attention does not implement {name} (this model uses it): "
                "set learner.attention: mask"
            )


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
    _refuse_unsupported("segment", kwargs)
    segments.calls += 1
    R, H, S, D = query.shape  # the packed rows, as transformers passes them: [R, heads, S, D]
    rep = H // key.shape[1]
    q, k, v = (
        x.transpose(1, 2).reshape(R * S, x.shape[1], D) for x in (query, key, value)
    )  # [R*S, heads, D]
    outs = []
    for bk in segments.buckets:
        o = F.scaled_dot_product_attention(
            take_rows(q, bk.q_idx).transpose(1, 2),
            repeat_kv(take_rows(k, bk.k_idx).transpose(1, 2), rep),
            repeat_kv(take_rows(v, bk.k_idx).transpose(1, 2), rep),
            attn_mask=bk.mask,
            dropout_p=dropout,
            scale=scaling,
        )
        outs.append(o.transpose(1, 2).reshape(-1, H, D)[bk.real])  # [real queries, H, D]
    real = torch.cat(outs)  # in sdpa's dtype (bf16 under autocast, whatever the query's)
    return real.new_zeros(R * S, H, D).index_put((segments.dest,), real).view(R, S, H, D), None
