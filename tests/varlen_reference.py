"""A CPU stand-in for torch's `varlen_attn` (a CUDA-only flash kernel), for tests only: the same
call contract, computed as one sdpa call per sequence. It checks the inputs the way the kernel
needs them (flat [tokens, heads, dim] tensors of one dtype, int32 offsets that cover them exactly,
the longest lengths, GQA asked for when the heads differ), so a test that swaps it in for
`agentgrpo.learner.attention.VARLEN_KERNEL` checks the wiring: offsets, key gathers, positions, the
transformers hook. tests/test_gpu.py checks that the real kernel agrees with it on CUDA."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def reference_varlen_attn(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seq_q: torch.Tensor,
    cu_seq_k: torch.Tensor,
    max_q: int,
    max_k: int,
    *,
    scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    enable_gqa: bool = False,
) -> torch.Tensor:
    """[T_q, H, D] output. Causal (`window_size=(-1, 0)`) aligns the mask to the bottom right, as
    flash attention does: in a sequence of Lq queries and Lk keys, query i sees keys j <= i + Lk -
    Lq."""
    assert query.dim() == key.dim() == value.dim() == 3, "flat [tokens, heads, dim] tensors"
    assert query.dtype == key.dtype == value.dtype, (query.dtype, key.dtype, value.dtype)
    assert cu_seq_q.dtype == cu_seq_k.dtype == torch.int32, "int32 offsets"
    assert window_size in ((-1, -1), (-1, 0)), window_size
    assert enable_gqa == (query.shape[1] != key.shape[1]), "enable_gqa iff the heads differ"
    assert cu_seq_q.shape == cu_seq_k.shape and int(cu_seq_q[0]) == int(cu_seq_k[0]) == 0
    assert int(cu_seq_q[-1]) == query.shape[0] and int(cu_seq_k[-1]) == key.shape[0]
    len_q, len_k = cu_seq_q.diff().tolist(), cu_seq_k.diff().tolist()
    assert min(len_q) >= 1 and max(len_q) == max_q and max(len_k) == max_k, (max_q, max_k)
    outs = []
    for i, (lq, lk) in enumerate(zip(len_q, len_k, strict=True)):
        q = query[int(cu_seq_q[i]) : int(cu_seq_q[i]) + lq].transpose(0, 1)  # [H, Lq, D]
        k, v = (x[int(cu_seq_k[i]) : int(cu_seq_k[i]) + lk].transpose(0, 1) for x in (key, value))
        mask = None
        if window_size == (-1, 0):
            assert lk >= lq, "every query sees at least one key"
            mask = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(diagonal=lk - lq)
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa
        )
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)


def top_left_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, **kw):
    """A wrong varlen_attn for the start-up check to catch: flash-attn 2.0's causal alignment (top
    left: query i sees keys j <= i), which is right when a sequence has as many keys as queries and
    wrong for a continuation attending to [its prompt, itself], whose queries then miss the end of
    the prompt."""
    outs = []
    for i in range(len(cu_seq_q) - 1):
        q0, q1 = int(cu_seq_q[i]), int(cu_seq_q[i + 1])
        k0, k1 = int(cu_seq_k[i]), int(cu_seq_k[i + 1])
        q, k, v = (x.transpose(0, 1) for x in (query[q0:q1], key[k0:k1], value[k0:k1]))
        mask = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool, device=q.device).tril()
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=kw.get("scale"), enable_gqa=kw.get("enable_gqa", False)
        )
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)
