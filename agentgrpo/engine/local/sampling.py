"""Token sampling for `LocalEngine`: one pure function from logits to `(ids, logprobs)`.

Kept apart from the engine because it is an algorithm over tensors (STYLE point 4): no model, cache
or request inside; the per-row settings and the uniforms come in as arguments, so the tests call it
on hand-built logits. What the logprobs mean and why every row brings its own uniform:
docs/rollouts.md ("How the local engine works": Logprobs, Seeds).
"""

from __future__ import annotations

import torch

_CANDIDATES = 256  # least tokens the cheap topk path of truncated sampling takes (see `sample`)


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
    convention and the learner's; docs/rollouts.md, Logprobs). Greedy rows (T == 0) take the argmax
    and report `log_softmax(logits)`.

    Truncated rows sample among the `max(_CANDIDATES, top_k) + 1` most likely tokens (a `topk`,
    much cheaper than sorting the vocabulary). Top-p cuts on the full-vocabulary probabilities for a
    row without top-k and on the renormalised top-k ones otherwise. A row whose kept set may extend
    past its candidates (its last kept token is no more likely than the last candidate: a top-p-only
    row whose candidates hold less mass than p, or a tie across the candidate boundary) is sampled
    again from its whole sorted vocabulary, so the result is always exact. Equal probabilities rank
    by ascending id on both paths (a stable sort), so a row's sample does not depend on the other
    rows of the batch, which set how many candidates there are, beyond float rounding.
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

    k_B = torch.tensor([k if 0 < k < V else V for k in top_k], device=device)
    p_B = torch.tensor(top_p, dtype=logits_BV.dtype, device=device)
    truncate_B = ((k_B < V) | (p_B < 1)) & ~greedy_B
    if bool(truncate_B.any()):
        rows = _rows(truncate_B)
        k_R, p_R, u_R, logp_RV = k_B[rows], p_B[rows], uniforms[rows], logp_BV[rows]
        C = min(V, max([_CANDIDATES] + k_R[k_R < V].tolist()) + 1)
        picked_R, exact_R = _truncated(logp_RV, k_R, p_R, u_R, C)
        if not bool(exact_R.all()):
            redo = _rows(~exact_R)
            picked_R[redo] = _truncated(logp_RV[redo], k_R[redo], p_R[redo], u_R[redo], V)[0]
        ids_B[rows] = picked_R
    return ids_B, logp_BV.gather(-1, ids_B[:, None])[:, 0]


def _rows(mask_B: torch.Tensor) -> slice | torch.Tensor:
    """Index of the rows where `mask_B` holds: a slice when it holds everywhere (views, no copy)."""
    return slice(None) if bool(mask_B.all()) else mask_B.nonzero()[:, 0]


def _truncated(
    logp_RV: torch.Tensor, k_R: torch.Tensor, p_R: torch.Tensor, u_R: torch.Tensor, C: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k / top-p sampling among each row's `C` most likely tokens: `(ids_R, exact_R)`.

    `exact_R` is False where the kept set may reach beyond the candidates (its last token is no
    more likely than the last candidate); those ids are to be thrown away. With `C == V` every row
    is exact."""
    V = logp_RV.shape[-1]
    if C < V:
        cand_RC, order_RC = logp_RV.topk(C, dim=-1)
        # topk ranks equal values in no defined order: rank them by id, as the stable sort does.
        order_RC, by_id = order_RC.sort(dim=-1)
        cand_RC, by_value = cand_RC.gather(-1, by_id).sort(dim=-1, descending=True, stable=True)
        order_RC = order_RC.gather(-1, by_value)
    else:
        cand_RC, order_RC = logp_RV.sort(dim=-1, descending=True, stable=True)
    drop_RC = torch.arange(C, device=logp_RV.device)[None, :] >= k_R[:, None]
    kept_RC = cand_RC.masked_fill(drop_RC, float("-inf"))
    # logp is normalised over the vocabulary: only rows cut by top-k renormalise before top-p.
    norm_R = torch.where(k_R < V, torch.logsumexp(kept_RC, dim=-1), 0.0)
    prob_RC = (kept_RC - norm_R[:, None]).exp()
    # Top-p keeps the smallest prefix whose mass reaches p (always the first token).
    drop_RC |= (prob_RC.cumsum(-1) - prob_RC >= p_R[:, None]) & (p_R < 1)[:, None]
    drop_RC[:, 0] = False
    last_R = (~drop_RC).sum(-1) - 1  # the kept set is a prefix
    # Exact iff every token as likely as the last kept one is a candidate.
    exact_R = cand_RC.gather(-1, last_R[:, None])[:, 0] > cand_RC[:, -1]
    if C == V:
        exact_R[:] = True
    kept_RC = cand_RC.masked_fill(drop_RC, float("-inf"))
    kept_RC = kept_RC - torch.logsumexp(kept_RC, dim=-1, keepdim=True)
    cdf_RC = kept_RC.exp().cumsum(-1, dtype=torch.float64)
    pick_R = torch.searchsorted(cdf_RC, (u_R * cdf_RC[:, -1])[:, None], right=True)[:, 0]
    pick_R = pick_R.clamp(max=C - 1)
    pick_R = torch.where(drop_RC.gather(-1, pick_R[:, None])[:, 0], 0, pick_R)  # rounding guard
    return order_RC.gather(-1, pick_R[:, None])[:, 0], exact_R
