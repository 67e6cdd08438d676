"""Token sampling for `LocalEngine`: one pure function from logits to `(ids, logprobs)`.

Kept apart from the engine because it is an algorithm over tensors (STYLE point 4): no model, cache
or request inside; the per-row settings and the uniforms come in as arguments, so the tests call it
on hand-built logits. What the logprobs mean and why every row brings its own uniform is in the
module docstring of `local.py` (Logprobs, Seeds).
"""

from __future__ import annotations

import torch

_CANDIDATES = 256  # tokens kept by the cheap topk path of truncated sampling (see `sample`)


def sample(
    logits_BV: torch.Tensor,
    *,
    temperature: list[float],
    top_k: list[int],
    top_p: list[float],
    uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row and return `(ids_B, logprobs_B)`.

    Settings are per row. `uniforms` (float64 in [0, 1), one per row) drive inverse-CDF sampling,
    so a row's randomness comes only from its own generator. Sampling follows `log_softmax(logits /
    T)`, then (if active) top-k, renormalise, top-p, renormalise, as vLLM orders them; the logprob
    returned is always the full-vocabulary `log_softmax(logits / T)` of the sampled token (SGLang's
    convention and the learner's; see `local.py`, Logprobs). Greedy rows (T == 0) take the argmax
    and report `log_softmax(logits)`.

    Truncated rows sample among the `max(_CANDIDATES, top_k)` most likely tokens (a `topk`, much
    cheaper than sorting the vocabulary); when a top-p-only row's candidates hold less mass than p
    the whole vocabulary is sorted instead, so the result is always exact.
    """
    B, V = logits_BV.shape
    device = logits_BV.device
    temp_B = torch.tensor(temperature, dtype=logits_BV.dtype, device=device)
    greedy_B = temp_B == 0
    logp_BV = torch.log_softmax(logits_BV / torch.where(greedy_B, 1.0, temp_B)[:, None], dim=-1)
    cdf_BV = logp_BV.exp().cumsum(-1, dtype=torch.float64)
    ids_B = torch.searchsorted(cdf_BV, (uniforms * cdf_BV[:, -1])[:, None], right=True)[:, 0]
    ids_B = torch.where(ids_B < V, ids_B, logp_BV.argmax(-1))  # float rounding past the end
    ids_B = torch.where(greedy_B, logits_BV.argmax(-1), ids_B)
    logprobs_B = logp_BV.gather(-1, ids_B[:, None])[:, 0]

    k_B = torch.tensor([k if 0 < k < V else V for k in top_k], device=device)
    p_B = torch.tensor(top_p, dtype=logits_BV.dtype, device=device)
    truncate_B = ((k_B < V) | (p_B < 1)) & ~greedy_B
    if not bool(truncate_B.any()):
        return ids_B, logprobs_B
    K = min(V, max([_CANDIDATES] + k_B[truncate_B & (k_B < V)].tolist()))
    cand_BK, order_BK = logp_BV.topk(K, dim=-1)  # sorted, most likely first
    uncovered_B = truncate_B & (k_B > K) & (cand_BK.exp().sum(-1) < p_B)
    if K < V and bool(uncovered_B.any()):
        K = V
        cand_BK, order_BK = logp_BV.sort(dim=-1, descending=True)
    drop_BK = torch.arange(K, device=device)[None, :] >= k_B[:, None]
    kept_BK = cand_BK.masked_fill(drop_BK, float("-inf"))
    prob_BK = (kept_BK - torch.logsumexp(kept_BK, dim=-1, keepdim=True)).exp()
    # Top-p keeps the smallest prefix whose mass reaches p (always the first token).
    drop_BK |= (prob_BK.cumsum(-1) - prob_BK >= p_B[:, None]) & (p_B < 1)[:, None]
    drop_BK[:, 0] = False
    kept_BK = cand_BK.masked_fill(drop_BK, float("-inf"))
    kept_BK = kept_BK - torch.logsumexp(kept_BK, dim=-1, keepdim=True)
    cdf_BK = kept_BK.exp().cumsum(-1, dtype=torch.float64)
    pick_B = torch.searchsorted(cdf_BK, (uniforms * cdf_BK[:, -1])[:, None], right=True)[:, 0]
    pick_B = pick_B.clamp(max=K - 1)
    pick_B = torch.where(drop_BK.gather(-1, pick_B[:, None])[:, 0], 0, pick_B)  # rounding guard
    ids_B = torch.where(truncate_B, order_BK.gather(-1, pick_B[:, None])[:, 0], ids_B)
    return ids_B, logp_BV.gather(-1, ids_B[:, None])[:, 0]
