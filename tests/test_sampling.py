"""`sampling.sample` against a straightforward reference, on vocabularies larger than its
candidates.

The reference is top-k then top-p as HF, vLLM and SGLang define them: sort the tempered distribution
(most likely first; equal probabilities by ascending id), keep the first k, renormalise, keep the
smallest prefix whose mass reaches p (always the first token), renormalise. The vocabularies here
(5000) exceed `_CANDIDATES`, so the cheap topk path, its coverage check and the full-sort fallback
all run; the engine tests use vocabularies of a few hundred, where the topk is the whole vocabulary.
"""

from __future__ import annotations

import pytest
import torch

from agentgrpo.engine.local.sampling import _CANDIDATES, sample

V = 5000
assert V > 4 * _CANDIDATES


def reference(logits_V: torch.Tensor, temperature: float, top_k: int, top_p: float):
    """(kept ids, their sampling probabilities), in sampling order. The order is that of the
    float32 logprobs the sampler sees (float64 would split ties of float32); the sums are
    float64."""
    logp = torch.log_softmax(logits_V / temperature, dim=-1)
    logp, order = logp.sort(descending=True, stable=True)  # ties: lower id first
    probs = logp.double().exp()
    if 0 < top_k < len(probs):
        probs, order = probs[:top_k] / probs[:top_k].sum(), order[:top_k]
    if top_p < 1:
        before = probs.cumsum(0) - probs
        # No test case sits on the boundary, where float32 and float64 sums could disagree.
        assert (before - top_p).abs().min() > 1e-5
        n = max(1, int((before < top_p).sum()))
        probs, order = probs[:n] / probs[:n].sum(), order[:n]
    return order, probs


def long_tail(seed: int) -> torch.Tensor:
    """One 0.85 token, 300 tokens sharing 0.11 (exact ties), the rest sharing 0.04; ids shuffled.
    The 256 most likely tokens hold ~0.94 of the mass, and renormalising them moves the 0.9 cut."""
    p = torch.full((V,), 0.04 / (V - 301), dtype=torch.float64)
    p[0], p[1:301] = 0.85, 0.11 / 300
    g = torch.Generator().manual_seed(seed)
    return p[torch.randperm(V, generator=g)].log().float()


def smooth(seed: int, scale: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(V, generator=g) * scale


DISTRIBUTIONS = {
    "long_tail": long_tail(0),
    "smooth_peaky": smooth(1, 4.0),
    "smooth_flat": smooth(2, 1.5),
}
SETTINGS = [  # (temperature, top_k, top_p)
    (1.0, -1, 0.9), (1.0, -1, 0.5), (0.7, -1, 0.95), (1.3, -1, 0.7),  # top-p only
    (1.0, 40, 0.9), (1.0, 300, 0.95), (1.0, 2000, 0.8), (0.8, 1000, 1.0), (1.0, 5, 1.0),
]  # fmt: skip


@pytest.mark.parametrize("name", DISTRIBUTIONS)
@pytest.mark.parametrize(("temperature", "top_k", "top_p"), SETTINGS)
def test_truncated_sampling_equals_the_reference(name, temperature, top_k, top_p):
    # One row per kept token (at most 400, spread over the set, the last one always): its uniform is
    # the middle of that token's reference CDF interval, so the sampler must return exactly that
    # token. A sampler that keeps too few tokens or too many shifts the intervals near the end;
    # u -> 1 must give the reference's last kept token.
    logits = DISTRIBUTIONS[name]
    kept, probs = reference(logits, temperature, top_k, top_p)
    cdf = probs.cumsum(0)
    rows = torch.linspace(0, len(kept) - 1, min(len(kept), 400)).round().long().unique()
    uniforms = torch.cat(
        [cdf[rows] - probs[rows] / 2, torch.tensor([1 - 1e-12], dtype=torch.float64)]
    )
    expected = torch.cat([kept[rows], kept[-1:]])
    n = len(uniforms)
    ids, logprobs = sample(
        logits.repeat(n, 1), temperature=[temperature] * n, top_k=[top_k] * n, top_p=[top_p] * n,
        uniforms=uniforms,
    )  # fmt: skip
    assert ids.tolist() == expected.tolist(), f"kept {len(kept)} tokens in the reference"
    full = torch.log_softmax(logits / temperature, dim=-1)
    assert torch.equal(logprobs, full[ids])  # the full-vocabulary logprob, not the truncated one


def test_a_rows_sample_does_not_depend_on_its_batch_companions():
    # The same rows and uniforms, alone and next to rows that change how many candidates the batch
    # takes (a top_k above _CANDIDATES), force the full sort (a flat row whose candidates cannot
    # reach p) or take no truncation at all (greedy, plain sampling).
    n = 300
    uniforms = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    companions = {
        "big_top_k": (smooth(3, 2.0), 1.0, 4000, 1.0),
        "flat": (torch.zeros(V), 1.0, -1, 0.9),
        "greedy": (smooth(4, 2.0), 0.0, -1, 1.0),
        "plain": (smooth(5, 2.0), 1.0, -1, 1.0),
    }
    for logits in DISTRIBUTIONS.values():
        for temperature, top_k, top_p in SETTINGS:
            alone, _ = sample(
                logits.repeat(n, 1), temperature=[temperature] * n, top_k=[top_k] * n,
                top_p=[top_p] * n, uniforms=uniforms,
            )  # fmt: skip
            for what, (other, t, k, p) in companions.items():
                batched, _ = sample(
                    torch.cat([logits.repeat(n, 1), other[None]]),
                    temperature=[temperature] * n + [t],
                    top_k=[top_k] * n + [k], top_p=[top_p] * n + [p],
                    uniforms=torch.cat([uniforms, torch.tensor([0.5], dtype=torch.float64)]),
                )  # fmt: skip
                assert torch.equal(batched[:n], alone), (what, temperature, top_k, top_p)


def test_ties_break_by_id_whatever_path_the_row_takes():
    # Ten tokens of equal probability 0.09 and a tail: top_p = 0.5 keeps the six lowest ids of the
    # ten, as a stable sort of the whole vocabulary would (mass before the sixth: 0.45 < 0.5; before
    # the seventh: 0.54 >= 0.5).
    p = torch.full((V,), 0.1 / (V - 10), dtype=torch.float64)
    tied = torch.tensor([4321, 17, 999, 2500, 3, 4000, 1234, 77, 4999, 600])
    p[tied] = 0.09
    logits = p.log().float()
    n = 600
    uniforms = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    for companion_top_k in (-1, 4000):  # a flat row that needs a full sort; a top_k above K
        ids, _ = sample(
            torch.cat([logits.repeat(n, 1), torch.zeros(1, V)]), temperature=[1.0] * (n + 1),
            top_k=[-1] * n + [companion_top_k], top_p=[0.5] * (n + 1),
            uniforms=torch.cat([uniforms, torch.tensor([0.5], dtype=torch.float64)]),
        )  # fmt: skip
        assert sorted(set(ids[:n].tolist())) == sorted(tied.tolist())[:6]
