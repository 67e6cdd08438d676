"""Numeric tests of agentgrpo.algo.loss: hand-computed values (arithmetic in comments), micro-batch
additivity of losses and gradients, masking edge cases, and autograd against slow per-token
Python references."""

import math

import pytest
import torch
from pydantic import ValidationError

from agentgrpo.algo.loss import (
    AGG_MODES,
    LOSSES,
    MIS_MODES,
    LossConfig,
    aggregate,
    compute_loss,
    geometric_mis_weights,
    get_loss_fn,
    gspo_loss,
    kl_penalty,
    mis_weights,
    policy_loss,
    rollout_mismatch_metrics,
    sequence_mis_weights,
    sequence_tis_weights,
    token_mis_weights,
    token_tis_weights,
)

LN = math.log
F64 = torch.float64


def t(x):
    return torch.tensor(x, dtype=F64)


def close(actual, expected):
    torch.testing.assert_close(actual.detach().double(), t(expected))


def ppo(log_ratios, adv, mask=None, **kw):
    """policy_loss on one row per list in log_ratios with old_logprobs = 0, so logp = log-ratio."""
    logp = t(log_ratios).requires_grad_()
    mask = torch.ones_like(logp) if mask is None else t(mask)
    return policy_loss(logp, torch.zeros_like(logp), t(adv), mask, **kw), logp


# --- PPO-clip by hand ----------------------------------------------------------------------------


def test_ppo_clip_positive_advantage():
    # A = 1, rho = [1.5, 0.5, 1.0], clip [0.8, 1.2]
    #   1.5: max(-1.5, -1.2) = -1.2 (clip binds) ; 0.5: max(-0.5, -0.8) = -0.5 ; 1.0: -1.0
    #   token-mean = (-1.2 - 0.5 - 1.0) / 3 = -0.9 ; clipfrac = 1/3
    (loss, m), _ = ppo([[LN(1.5), LN(0.5), 0.0]], [1.0])
    assert loss.item() == pytest.approx(-0.9)
    assert m["clipfrac"] == pytest.approx(1 / 3) and m["clipfrac_dual"] == 0.0
    # ppo_kl = mean(old - new) = -(ln 1.5 + ln 0.5 + 0) / 3 = 0.09589
    assert m["ppo_kl"] == pytest.approx(-(LN(1.5) + LN(0.5)) / 3)
    assert m["loss_tokens"] == 3.0


def test_ppo_clip_negative_advantage():
    # A = -1, rho = [1.5, 0.5, 1.0]
    #   1.5: max(1.5, 1.2) = 1.5 ; 0.5: max(0.5, 0.8) = 0.8 (clip binds) ; 1.0: 1.0
    #   token-mean = (1.5 + 0.8 + 1.0) / 3 = 1.1 ; clipfrac = 1/3
    (loss, m), _ = ppo([[LN(1.5), LN(0.5), 0.0]], [-1.0])
    assert loss.item() == pytest.approx(1.1)
    assert m["clipfrac"] == pytest.approx(1 / 3)


def test_clip_higher():
    # DAPO clip-higher 0.2 / 0.28, A = 2, rho = [1.5, 0.7]
    #   1.5: max(-3, -2 * 1.28) = -2.56 ; 0.7: max(-1.4, -2 * 0.8) = -1.4 -> mean -1.98
    (loss, _), _ = ppo([[LN(1.5), LN(0.7)]], [2.0], clip_high=0.28)
    assert loss.item() == pytest.approx(-1.98)
    # A = -2, rho = [1.5, 0.7]: 1.5: max(3, 2.56) = 3 ; 0.7: max(1.4, 2 * 0.8) = 1.6 -> mean 2.3
    (loss, _), _ = ppo([[LN(1.5), LN(0.7)]], [-2.0], clip_high=0.28)
    assert loss.item() == pytest.approx(2.3)


def test_dual_clip():
    # A = -1, rho = [e^2 = 7.389, 1.5], c = 3
    #   e^2: max(7.389, 1.2) = 7.389 -> min(7.389, 3) = 3 (dual clip binds, not in clipfrac)
    #   1.5: 1.5 < 3, unchanged -> mean (3 + 1.5) / 2 = 2.25 ; clipfrac_dual = 1/2, clipfrac = 0
    (loss, m), logp = ppo([[2.0, LN(1.5)]], [-1.0], dual_clip=3.0)
    assert loss.item() == pytest.approx(2.25)
    assert m["clipfrac_dual"] == pytest.approx(0.5) and m["clipfrac"] == 0.0
    loss.backward()
    # d/dlogp: dual-clipped token is constant -> 0 ; other: d(rho)/dlogp / 2 = 1.5 / 2 = 0.75
    close(logp.grad, [[0.0, 0.75]])
    # without dual clip the first token costs e^2: (7.389 + 1.5) / 2 = 4.4445
    (loss, _), _ = ppo([[2.0, LN(1.5)]], [-1.0])
    assert loss.item() == pytest.approx((math.exp(2) + 1.5) / 2)
    # dual clip never touches A > 0
    (loss, m), _ = ppo([[2.0, LN(1.5)]], [1.0], dual_clip=3.0)
    assert loss.item() == pytest.approx(-1.2) and m["clipfrac_dual"] == 0.0
    with pytest.raises(ValueError, match="dual_clip"):
        ppo([[0.0]], [1.0], dual_clip=1.0)


def test_large_log_ratios_are_clamped_and_finite():
    # log-ratio 100 -> rho = e^20 (clamp), -100 -> e^-20
    (loss, _), logp = ppo([[100.0, -100.0]], [-1.0])
    # A = -1: max(e^20, 1.2) = e^20 ; max(e^-20, 0.8) = 0.8 -> (e^20 + 0.8) / 2
    assert loss.item() == pytest.approx((math.exp(20) + 0.8) / 2)
    loss.backward()
    assert torch.isfinite(logp.grad).all() and logp.grad.tolist() == [[0.0, 0.0]]  # clamp and clip
    (loss, _), _ = ppo([[100.0, -100.0]], [-1.0], dual_clip=3.0)
    assert loss.item() == pytest.approx((3 + 0.8) / 2)
    (loss, _), _ = ppo([[100.0, -100.0]], [1.0])
    assert loss.item() == pytest.approx((-1.2 - math.exp(-20)) / 2)


# --- aggregation by hand -------------------------------------------------------------------------

# rho = 1 everywhere, so the per-token loss is -A of its row. Row 0: A = 1, 3 tokens; row 1: A = 2,
# 1 token; row 2: A = 5, no tokens.
MASK = [[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]]
ADV = [1.0, 2.0, 5.0]
AGG_CASES = {
    # (-1 * 3 + -2 * 1) / 4 tokens = -1.25
    "token-mean": -1.25,
    # row means -1 and -2 over 2 rows with tokens -> -1.5
    "seq-mean-token-mean": -1.5,
    # token sums -3 and -2 / (max_response_len 4 * 2 rows) = -0.625
    "seq-mean-token-sum-norm": -0.625,
}


@pytest.mark.parametrize("agg", AGG_MODES)
def test_aggregation_hand_computed(agg):
    (loss, _), _ = ppo([[0.0] * 4] * 3, ADV, MASK, agg=agg, max_response_len=4)
    assert loss.item() == pytest.approx(AGG_CASES[agg])


def test_step_normalisers_override():
    # token-mean with num_tokens = 10: -5 / 10 = -0.5
    (loss, _), _ = ppo([[0.0] * 4] * 3, ADV, MASK, num_tokens=10)
    assert loss.item() == pytest.approx(-0.5)
    # seq-mean-token-mean with num_seqs = 4: (-1 - 2) / 4 = -0.75 ; num_tokens is ignored there
    (loss, _), _ = ppo(
        [[0.0] * 4] * 3, ADV, MASK, agg="seq-mean-token-mean", num_seqs=4, num_tokens=99
    )
    assert loss.item() == pytest.approx(-0.75)
    # sum-norm with num_seqs = 5, L = 4: -5 / 20 = -0.25 ; a tensor normaliser works too
    (loss, _), _ = ppo(
        [[0.0] * 4] * 3,
        ADV,
        MASK,
        agg="seq-mean-token-sum-norm",
        max_response_len=4,
        num_seqs=torch.tensor(5),
    )
    assert loss.item() == pytest.approx(-0.25)


def test_normaliser_smaller_than_call_raises():
    with pytest.raises(ValueError, match="num_tokens"):
        ppo([[0.0] * 4] * 3, ADV, MASK, num_tokens=3)
    with pytest.raises(ValueError, match="num_seqs"):
        ppo([[0.0] * 4] * 3, ADV, MASK, agg="seq-mean-token-mean", num_seqs=1)


def test_sum_norm_needs_max_response_len_and_unknown_agg():
    with pytest.raises(ValueError, match="max_response_len"):
        ppo([[0.0]], [1.0], agg="seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="valid: \\['token-mean'"):
        ppo([[0.0]], [1.0], agg="token-sum")


def test_all_masked_row_adds_nothing():
    # the same batch with and without a fully masked row (even holding -inf / NaN) is the same loss
    logp = t([[-0.3, -1.2], [-math.inf, math.nan]]).requires_grad_()
    old = t([[-0.5, -1.0], [math.nan, -math.inf]])
    mask = t([[1, 1], [0, 0]])
    for agg in AGG_MODES:
        full, _ = policy_loss(logp, old, t([1.0, 3.0]), mask, agg=agg, max_response_len=2)
        alone, _ = policy_loss(logp[:1], old[:1], t([1.0]), mask[:1], agg=agg, max_response_len=2)
        assert full.item() == pytest.approx(alone.item())
        logp.grad = None
        full.backward()
        assert torch.isfinite(logp.grad).all() and logp.grad[1].tolist() == [0.0, 0.0]


@pytest.mark.parametrize("fn", [policy_loss, gspo_loss])
@pytest.mark.parametrize("agg", AGG_MODES)
def test_all_masked_call_is_attached_zero(fn, agg):
    logp = t([[-math.inf, 0.5], [math.nan, -2.0]]).requires_grad_()
    loss, m = fn(
        logp,
        t([[0.0, math.nan], [1.0, math.inf]]),
        t([1.0, -1.0]),
        torch.zeros(2, 2),
        agg=agg,
        max_response_len=8,
    )
    assert loss.item() == 0.0 and loss.requires_grad
    loss.backward()
    assert logp.grad.tolist() == [[0.0, 0.0], [0.0, 0.0]]
    assert all(math.isfinite(v) for v in m.values())


def test_token_level_advantages_accepted():
    # advantages [B, T]: A = [[1, -1]], rho = 1 -> losses -1, 1 -> mean 0
    logp = torch.zeros(1, 2, dtype=F64)
    loss, _ = policy_loss(logp, logp, t([[1.0, -1.0]]), torch.ones(1, 2))
    assert loss.item() == 0.0


def test_shape_mismatch_raises():
    with pytest.raises(ValueError, match="shape"):
        policy_loss(torch.zeros(2, 3), torch.zeros(2, 4), torch.zeros(2), torch.ones(2, 3))


# --- GSPO ----------------------------------------------------------------------------------------


def test_gspo_hand_computed():
    # one row, log-ratios [ln 2, 0] -> s = ln(2) / 2 -> rho = sqrt(2) = 1.41421 for both tokens
    # A = 1: max(-1.41421, -1.2) = -1.2 for both (clipped) -> seq-mean-token-mean -1.2, grad 0
    logp = t([[LN(2), 0.0]]).requires_grad_()
    loss, m = gspo_loss(logp, torch.zeros(1, 2, dtype=F64), t([1.0]), torch.ones(1, 2))
    assert loss.item() == pytest.approx(-1.2) and m["clipfrac"] == 1.0
    loss.backward()
    assert logp.grad.tolist() == [[0.0, 0.0]]
    # A = -1: max(1.41421, 1.2) = 1.41421 ; d/dlogp_t = rho * |A| / 2 tokens = 0.70711 each
    logp.grad = None
    loss, m = gspo_loss(logp, torch.zeros(1, 2, dtype=F64), t([-1.0]), torch.ones(1, 2))
    assert loss.item() == pytest.approx(math.sqrt(2)) and m["clipfrac"] == 0.0
    loss.backward()
    close(logp.grad, [[math.sqrt(2) / 2] * 2])


def test_gspo_cap_and_dual_clip_ignored():
    # mean log-ratio 15 is capped at 10: A = -1 -> loss e^10
    logp = t([[15.0, 15.0, 0.0]])
    mask = t([[1, 1, 0]])
    a, _ = gspo_loss(logp, torch.zeros_like(logp), t([-1.0]), mask)
    b, _ = gspo_loss(logp, torch.zeros_like(logp), t([-1.0]), mask, dual_clip=3.0)
    assert a.item() == pytest.approx(math.exp(10)) and b.item() == a.item()


# --- micro-batches: same loss, same gradient -----------------------------------------------------


def _batch(seed, B=7, T=6):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=g, dtype=F64) * 2
    old = logp + (torch.rand(B, T, generator=g, dtype=F64) - 0.5) * 0.8  # ratios around the clip
    ref = logp + (torch.rand(B, T, generator=g, dtype=F64) - 0.5)
    rollout = old + (torch.rand(B, T, generator=g, dtype=F64) - 0.5) * 0.6
    ent = torch.rand(B, T, generator=g, dtype=F64)
    adv = torch.randn(B, generator=g, dtype=F64)
    mask = (torch.rand(B, T, generator=g) > 0.3).to(F64)
    mask[2] = 0  # one fully masked row
    return logp, old, adv, mask, ref, ent, rollout


def _split_equals_whole(call, seed=0):
    """call(logp, old, adv, mask, ref, ent, rollout, num_tokens, num_seqs) -> loss"""
    logp, old, adv, mask, ref, ent, rollout = _batch(seed)
    slices = (slice(0, 2), slice(2, 3), slice(3, 7))  # the middle micro-batch is all masked
    n_tok, n_seq = int(mask.sum()), int((mask.sum(-1) > 0).sum())  # the step's loss tokens and rows
    whole_p = logp.clone().requires_grad_()
    whole = call(whole_p, old, adv, mask, ref, ent, rollout, None, None)
    whole.backward()
    split_p = logp.clone().requires_grad_()
    total = 0.0
    for sl in slices:
        part = call(
            split_p[sl], old[sl], adv[sl], mask[sl], ref[sl], ent[sl], rollout[sl], n_tok, n_seq
        )
        part.backward()
        total += part.item()
    assert total == pytest.approx(whole.item(), abs=1e-12)
    torch.testing.assert_close(split_p.grad, whole_p.grad, rtol=0, atol=1e-12)
    assert whole_p.grad.abs().sum() > 0


@pytest.mark.parametrize("name", sorted(LOSSES))
@pytest.mark.parametrize("agg", AGG_MODES)
def test_micro_batches_add_up(name, agg):
    def call(logp, old, adv, mask, ref, ent, rollout, n_tok, n_seq):
        return LOSSES[name](
            logp,
            old,
            adv,
            mask,
            agg=agg,
            max_response_len=6,
            num_tokens=n_tok,
            num_seqs=n_seq,
            clip_high=0.28,
        )[0]

    _split_equals_whole(call)


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize(
    ("tis", "mis"),
    [
        ("token", "none"),
        ("sequence", "none"),
        ("none", "token"),
        ("none", "sequence"),
        ("none", "geometric"),
        ("token", "geometric"),
    ],
)
def test_compute_loss_micro_batches_add_up(agg, tis, mis):
    # narrow MIS band, so that some tokens of the random batch are dropped and others kept
    cfg = LossConfig(
        agg=agg, max_response_len=6, kl_coef=0.1, entropy_coef=0.01, tis=tis, dual_clip=3.0,
        mis=mis, mis_low=0.9, mis_high=1.1,
    )  # fmt: skip

    def call(logp, old, adv, mask, ref, ent, rollout, n_tok, n_seq):
        # entropy depends on logp so its gradient is part of the check
        return compute_loss(
            cfg,
            logp,
            old,
            adv,
            mask,
            ref_logprobs_BT=ref,
            entropy_BT=ent * logp,
            rollout_logprobs_BT=rollout,
            num_tokens=n_tok,
            num_seqs=n_seq,
        )[0]

    _split_equals_whole(call)


# --- autograd against slow per-token Python references -------------------------------------------


def ref_ppo_token(lp, old, a, clip_low, clip_high, dual):
    """One token, branching on values as the PPO paper reads (no max/min tensors)."""
    lr = torch.clamp(lp - old, -20, 20)
    rho = torch.exp(lr)
    if a >= 0:
        loss = -a * (1 + clip_high) + 0 * lp if rho.item() > 1 + clip_high else -a * rho
    else:
        loss = -a * (1 - clip_low) + 0 * lp if rho.item() < 1 - clip_low else -a * rho
        if dual is not None and loss.item() > -a * dual:
            loss = -a * dual + 0 * lp
    return loss


def ref_aggregate(token_losses, max_len):
    """token_losses: list of rows, each a list of scalar tensors (loss tokens only)."""
    rows = [r for r in token_losses if r]
    n_tok = sum(len(r) for r in rows)
    return {
        "token-mean": sum(sum(r) for r in rows) / n_tok,
        "seq-mean-token-mean": sum(sum(r) / len(r) for r in rows) / len(rows),
        "seq-mean-token-sum-norm": sum(sum(r) for r in rows) / (max_len * len(rows)),
    }


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("dual", [None, 3.0])
def test_ppo_gradient_matches_reference(seed, dual):
    logp, old, adv, mask, *_ = _batch(seed)
    old = old.clone()
    old[0, 0] = logp[0, 0] - 3.0  # a dual-clip case: ratio e^3 > 3
    adv[0] = -abs(adv[0])
    for agg in AGG_MODES:
        p = logp.clone().requires_grad_()
        loss, _ = policy_loss(
            p,
            old,
            adv,
            mask,
            clip_low=0.2,
            clip_high=0.28,
            dual_clip=dual,
            agg=agg,
            max_response_len=6,
        )
        (g_fast,) = torch.autograd.grad(loss, p)
        q = logp.clone().requires_grad_()
        rows = [
            [
                ref_ppo_token(q[i, j], old[i, j], adv[i].item(), 0.2, 0.28, dual)
                for j in range(q.shape[1])
                if mask[i, j]
            ]
            for i in range(q.shape[0])
        ]
        ref = ref_aggregate(rows, 6)[agg]
        (g_ref,) = torch.autograd.grad(ref, q)
        assert loss.item() == pytest.approx(ref.item(), abs=1e-12)
        torch.testing.assert_close(g_fast, g_ref, rtol=0, atol=1e-12)


@pytest.mark.parametrize("seed", range(3))
def test_gspo_gradient_matches_sequence_level_reference(seed):
    """GSPO as the paper writes it: one ratio per sequence, exp(mean log-ratio), clipped per
    sequence, differentiated through the mean. For seq-mean-token-mean that is exactly verl's token
    form."""
    logp, old, adv, mask, *_ = _batch(seed)
    for agg in AGG_MODES:
        p = logp.clone().requires_grad_()
        loss, _ = gspo_loss(p, old, adv, mask, clip_high=0.28, agg=agg, max_response_len=6)
        (g_fast,) = torch.autograd.grad(loss, p)
        q = logp.clone().requires_grad_()
        rows = []
        for i in range(q.shape[0]):
            idx = [j for j in range(q.shape[1]) if mask[i, j]]
            if not idx:
                rows.append([])
                continue
            s = torch.exp(sum(q[i, j] - old[i, j] for j in idx) / len(idx))
            a = adv[i].item()
            binds = s.item() > 1.28 if a >= 0 else s.item() < 0.8
            seq_loss = -a * (1.28 if a >= 0 else 0.8) + 0 * s if binds else -a * s
            rows.append([seq_loss] * len(idx))  # every token of the row carries the sequence loss
        ref = ref_aggregate(rows, 6)[agg]
        (g_ref,) = torch.autograd.grad(ref, q)
        assert loss.item() == pytest.approx(ref.item(), abs=1e-12)
        torch.testing.assert_close(g_fast, g_ref, rtol=0, atol=1e-12)


# --- KL estimators -------------------------------------------------------------------------------


def test_kl_estimators_hand_computed():
    # logp = -1, ref = -2: d = logp - ref = 1
    #   k1 = 1 ; k2 = 0.5 * 1 = 0.5 ; k3 = e^(ref - logp) - (ref - logp) - 1
    #        = e^-1 + 1 - 1 = 0.36788
    lp, ref = t([[-1.0]]).requires_grad_(), t([[-2.0]])
    assert kl_penalty(lp, ref, "k1").item() == pytest.approx(1.0)
    assert kl_penalty(lp, ref, "k2").item() == pytest.approx(0.5)
    k3 = kl_penalty(lp, ref, "k3")
    assert k3.item() == pytest.approx(math.exp(-1))
    # d k3 / d logp = 1 - e^(ref - logp) = 1 - e^-1 = 0.63212 ; d k2 / d logp = logp - ref = 1
    k3.sum().backward()
    assert lp.grad.item() == pytest.approx(1 - math.exp(-1))
    assert kl_penalty(t([[0.3]]), t([[0.3]]), "k3").item() == 0.0


def test_k3_clamps():
    # ref - logp = -30 -> clamp -20 -> e^-20 + 20 - 1 = 19.0 -> clamp 10
    # ref - logp = +30 -> clamp 20 -> e^20 - 21 -> clamp 10 ; both finite
    got = kl_penalty(t([[0.0, -30.0]]), t([[-30.0, 0.0]]), "k3")
    assert got.tolist() == [[10.0, 10.0]]
    # ref - logp = 2: e^2 - 3 = 4.389 (below the clamp)
    assert kl_penalty(t([[0.0]]), t([[2.0]]), "k3").item() == pytest.approx(math.exp(2) - 3)


def test_unknown_kl_kind():
    with pytest.raises(ValueError, match="valid: \\['k1', 'k2', 'k3'\\]"):
        kl_penalty(t([[0.0]]), t([[0.0]]), "low_var_kl")


# --- TIS -----------------------------------------------------------------------------------------


def test_token_tis_hand_computed():
    # old - rollout = [ln 3, ln 0.5, (masked)], cap 2 -> weights [2, 0.5, 0]
    #   ratio_mean = (3 + 0.5) / 2 = 1.75 ; clipped_frac = 1/2
    #   mismatch/kl = mean(rollout - old) = (-ln 3 - ln 0.5) / 2
    #       = (-1.09861 + 0.69315) / 2 = -0.20273
    old, rollout, mask = t([[LN(3), LN(0.5), 7.0]]), torch.zeros(1, 3, dtype=F64), t([[1, 1, 0]])
    w, m = token_tis_weights(old, rollout, mask, cap=2.0)
    close(w, [[2.0, 0.5, 0.0]])
    assert m["tis/ratio_mean"] == pytest.approx(1.75) and m["tis/clipped_frac"] == 0.5
    assert m["mismatch/kl"] == pytest.approx((-LN(3) - LN(0.5)) / 2)
    # k3 with d = rollout - old: e^-d + d - 1 -> (3 - ln 3 - 1 + 0.5 - ln 0.5 - 1) / 2 = 0.64727
    assert m["mismatch/k3_kl"] == pytest.approx((3 - LN(3) - 1 + 0.5 + LN(2) - 1) / 2)


def test_sequence_tis_hand_computed():
    # row 0: sum(old - rollout) = ln 3 + ln 0.5 = ln 1.5 -> weight 1.5 on its loss tokens (cap 2)
    # row 1: sum = ln 3 + ln 3 = ln 9 -> capped at 2 ; row 2: no loss tokens
    old = t([[LN(3), LN(0.5)], [LN(3), LN(3)], [5.0, 5.0]])
    w, m = sequence_tis_weights(old, torch.zeros_like(old), t([[1, 1], [1, 1], [0, 0]]), cap=2.0)
    close(w, [[1.5, 1.5], [2.0, 2.0], [0.0, 0.0]])
    assert m["tis/ratio_mean"] == pytest.approx((1.5 + 9) / 2) and m["tis/clipped_frac"] == 0.5


def test_sequence_tis_metrics_pool_across_micro_batches_like_one_batch():
    # rows of 3 and 1 loss tokens; the learner pools micro-batches' metrics by loss tokens, so a
    # mean over rows (1.5 + 9) / 2 came out differently when the rows were in separate micro-batches
    old = t([[LN(3), LN(0.5), 0.0], [LN(9), 0.0, 0.0]])
    mask = t([[1, 1, 1], [1, 0, 0]])
    _, whole = sequence_tis_weights(old, torch.zeros_like(old), mask, cap=2.0)
    parts = [
        sequence_tis_weights(
            old[i : i + 1], torch.zeros_like(old[i : i + 1]), mask[i : i + 1], cap=2.0
        )[1]
        for i in range(2)
    ]
    n = mask.sum(-1)
    for key in ("tis/ratio_mean", "tis/clipped_frac"):
        pooled = sum(float(n[i]) * parts[i][key] for i in range(2)) / float(n.sum())
        assert whole[key] == pytest.approx(pooled)
    assert (
        whole["tis/ratio_mean"] == pytest.approx((3 * 1.5 + 9) / 4)
        and whole["tis/clipped_frac"] == 0.25
    )


def test_tis_weights_are_detached_and_clamped():
    old = t([[100.0, -100.0]]).requires_grad_()
    w, m = token_tis_weights(old, torch.zeros(1, 2, dtype=F64), torch.ones(1, 2), cap=2.0)
    assert not w.requires_grad
    close(w, [[2.0, math.exp(-20)]])
    assert all(math.isfinite(v) for v in m.values())
    assert rollout_mismatch_metrics(old, old.detach(), torch.ones(1, 2))["mismatch/kl"] == 0.0


# --- MIS -----------------------------------------------------------------------------------------


def test_token_mis_hand_computed():
    # old - rollout = [ln 3, ln 0.5, ln 1.5, ln 0.25, (masked)], band [0.5, 2] (ends included)
    #   ratios 3 (out), 0.5 (in: the lower end), 1.5 (in), 0.25 (out)
    #   -> keep [0, 1, 1, 0, 0], weights = ratio x keep = [0, 0.5, 1.5, 0, 0]
    #   masked_frac = 2 / 4 = 0.5 ; ratio_mean = (3 + 0.5 + 1.5 + 0.25) / 4 = 1.3125
    #   weight_mean = (0.5 + 1.5) / 4 = 0.5
    old = t([[LN(3), LN(0.5), LN(1.5), LN(0.25), 7.0]])
    rollout, mask = torch.zeros(1, 5, dtype=F64), t([[1, 1, 1, 1, 0]])
    w = token_mis_weights(old, rollout, mask, low=0.5, high=2.0)
    close(w.weights_BT, [[0.0, 0.5, 1.5, 0.0, 0.0]])
    close(w.keep_BT, [[0.0, 1.0, 1.0, 0.0, 0.0]])
    m = w.metrics
    assert m["mis/masked_frac"] == 0.5 and m["mis/ratio_mean"] == pytest.approx(1.3125)
    assert m["mis/weight_mean"] == pytest.approx(0.5)
    assert m["mismatch/kl"] == pytest.approx(-(LN(3) + LN(0.5) + LN(1.5) + LN(0.25)) / 4)
    assert not w.weights_BT.requires_grad


# Five rows for the two sequence variants (old - rollout per token; the 3rd of row 2 is masked):
#   row 0: ln 3, ln 0.5        sum ln 1.5   mean ln 1.5 / 2
#   row 1: ln 3, ln 3          sum ln 9     mean ln 3
#   row 2: ln 4, ln 0.25       sum 0        mean 0
#   row 3: 4 x ln 1.5          sum ln 5.0625 (= 1.5^4)   mean ln 1.5
#   row 4: no loss tokens
MIS_ROWS = [
    [LN(3), LN(0.5), 0.0, 0.0],
    [LN(3), LN(3), 0.0, 0.0],
    [LN(4), LN(0.25), 9.0, 0.0],
    [LN(1.5)] * 4,
    [5.0, 5.0, 5.0, 5.0],
]
MIS_MASK = [[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]]


def test_sequence_mis_hand_computed():
    # product R_i = exp(sum), band [0.5, 2]: 1.5 kept, 9 rejected, 1 kept, 5.0625 rejected
    #   weights: R_i on the kept rows' loss tokens
    #   masked_frac = (2 + 4) / 10 = 0.6
    #   ratio_mean = (2 * 1.5 + 2 * 9 + 2 * 1 + 4 * 5.0625) / 10 = 43.25 / 10 = 4.325
    #   weight_mean = (2 * 1.5 + 2 * 1) / 10 = 0.5
    old = t(MIS_ROWS)
    w = sequence_mis_weights(old, torch.zeros_like(old), t(MIS_MASK), low=0.5, high=2.0)
    close(w.weights_BT, [[1.5, 1.5, 0, 0], [0, 0, 0, 0], [1, 1, 0, 0], [0] * 4, [0] * 4])
    assert w.metrics["mis/masked_frac"] == pytest.approx(0.6)
    assert w.metrics["mis/ratio_mean"] == pytest.approx(4.325)
    assert w.metrics["mis/weight_mean"] == pytest.approx(0.5)


def test_geometric_mis_hand_computed():
    # geometric mean R_i = exp(mean), band [0.5, 2]:
    #   sqrt(1.5) = 1.22474 kept, 3 rejected, 1 kept, 1.5 kept (a longer row with the same per-token
    #   gap as the product's 5.0625, which the sequence variant rejects)
    #   masked_frac = 2 / 10 = 0.2
    #   ratio_mean = (2 sqrt(1.5) + 2 * 3 + 2 * 1 + 4 * 1.5) / 10 = 1.64495
    #   weight_mean = (2 sqrt(1.5) + 2 * 1 + 4 * 1.5) / 10 = 1.04495
    old, r = t(MIS_ROWS), math.sqrt(1.5)
    w = geometric_mis_weights(old, torch.zeros_like(old), t(MIS_MASK), low=0.5, high=2.0)
    close(w.weights_BT, [[r, r, 0, 0], [0, 0, 0, 0], [1, 1, 0, 0], [1.5] * 4, [0] * 4])
    close(w.keep_BT, [[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 0, 0], [1] * 4, [0] * 4])
    assert w.metrics["mis/masked_frac"] == pytest.approx(0.2)
    assert w.metrics["mis/ratio_mean"] == pytest.approx((2 * r + 6 + 2 + 6) / 10)
    assert w.metrics["mis/weight_mean"] == pytest.approx((2 * r + 2 + 6) / 10)


def _trl_mask_ratio(old_BT, rollout_BT, mask_BT, mode, clip_min, clip_max):
    """TRL's masked importance sampling ratio, as huggingface/trl computes it at commit
    f2cd57710ae345ea6428ae95363267fcf38a3dc8 (trl/trainer/grpo_trainer.py,
    `GRPOTrainer._generate_and_score_completions`, the `vllm_importance_sampling_correction`
    block; modes token_mask and sequence_mask), written anew: the masked log-ratio, summed over
    the row for the sequence mode, exponentiated without a clamp, and set to 0 outside
    [clip_min, clip_max]. It multiplies the per-token loss, broadcast over the row's tokens."""
    diff = (old_BT - rollout_BT) * mask_BT
    if mode == "sequence_mask":
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    return ratio.masked_fill((ratio < clip_min) | (ratio > clip_max), 0.0)


def _verl_mask_weights(old_BT, rollout_BT, mask_BT, level, upper, lower):
    """verl's MIS weights, as volcengine/verl computes them at commit
    5d378b5f95085fabcde5447f53980ae842d0c165 (verl/trainer/ppo/mismatch_helper.py,
    `compute_rollout_importance_weights` with rollout_is_mode="mask" and the veto off), written
    anew: the log-ratio per token, its masked sum (sequence) or masked mean (geometric; verl's
    masked mean divides by the count + 1e-8) per row, clamped to [-20, 20] and exponentiated;
    weights outside [lower, upper] become 0; then times the response mask."""
    log_ratio = old_BT - rollout_BT
    if level == "sequence":
        log_ratio = (log_ratio * mask_BT).sum(-1, keepdim=True)
    elif level == "geometric":
        count = mask_BT.sum(-1, keepdim=True) + 1e-8
        log_ratio = (log_ratio * mask_BT).sum(-1, keepdim=True) / count
    w = torch.exp(log_ratio.clamp(-20, 20)).expand_as(old_BT)
    return w * ((w >= lower) & (w <= upper)).to(w.dtype) * mask_BT


def _mismatched_logprobs(seed):
    """Old and rollout logprobs over [6, 9] and a ragged loss mask: row 0 has no loss token, row 1
    gaps of ~0.01 nats (inside any band, for every variant), row 2 gaps of ~1 nat (outside), the
    other rows gaps of a few tenths (tokens on both sides of the band)."""
    g = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(6, 9, generator=g, dtype=F64) * 3
    scale = t([[0.0], [0.01], [0.1], [0.4], [0.4], [0.4]])
    shift = t([[0.0], [0.0], [1.0], [0.0], [0.1], [-0.1]])
    old = rollout + shift + torch.randn(6, 9, generator=g, dtype=F64) * scale
    mask = (torch.rand(6, 9, generator=g) < 0.8).to(F64)
    mask[0] = 0.0
    mask[1:, 0] = 1.0
    return old, rollout, mask


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mis_equals_trl_and_verl_on_the_same_tensors(seed):
    old, rollout, mask = _mismatched_logprobs(seed)
    low, high = 0.7, 1.5
    for ours, trl_mode, verl_level in [
        ("token", "token_mask", "token"),
        ("sequence", "sequence_mask", "sequence"),
        ("geometric", None, "geometric"),
    ]:
        w = mis_weights(ours, old, rollout, mask, low, high)
        # both kept and rejected entries are present, so the comparison tests the band too
        assert 0 < w.metrics["mis/masked_frac"] < 1, ours
        verl = _verl_mask_weights(old, rollout, mask, verl_level, upper=high, lower=low)
        # rtol: verl's + 1e-8 in the mean's count moves a geometric ratio by ~1e-9 of itself
        torch.testing.assert_close(w.weights_BT, verl, rtol=1e-9, atol=0)
        if trl_mode is not None:  # TRL multiplies its ratio into the per-token loss, masked there
            trl = _trl_mask_ratio(old, rollout, mask, trl_mode, low, high) * mask
            torch.testing.assert_close(w.weights_BT, trl.expand_as(old), rtol=1e-12, atol=0)


def test_mis_band_must_hold_ratio_one_and_variants_are_named():
    x = torch.zeros(1, 1)
    with pytest.raises(ValueError, match="0 < low <= 1 <= high"):
        token_mis_weights(x, x, torch.ones(1, 1), low=1.2, high=2.0)
    with pytest.raises(ValueError, match=r"unknown MIS variant 'product'; valid: \['geometric', "):
        mis_weights("product", x, x, torch.ones(1, 1), 0.5, 2.0)
    with pytest.raises(ValidationError, match="mis_low"):
        LossConfig(mis="token", mis_low=1.5)
    with pytest.raises(ValidationError, match="mis_high"):
        LossConfig(mis="token", mis_high=0.9)
    with pytest.raises(ValidationError, match="mis"):
        LossConfig(mis="product")
    assert set(MIS_MODES) == {"token", "sequence", "geometric"}
    for mode in MIS_MODES:
        assert LossConfig(mis=mode).mis == mode


# --- compute_loss --------------------------------------------------------------------------------


def test_compute_loss_combines_terms_by_hand():
    # rho = 1, A = 1 -> pg token losses [-1, -1] -> token-mean -1
    # k1 with ref = logp - 0.5 -> 0.5 per token -> kl_loss 0.5 ; beta 0.1 -> +0.05
    # entropy [2, 4] -> mean 3 ; coef 0.01 -> -0.03 ;  total = -1 + 0.05 - 0.03 = -0.98
    logp = t([[-1.0, -2.0]])
    cfg = LossConfig(kl_coef=0.1, kl_estimator="k1", entropy_coef=0.01)
    loss, m = compute_loss(
        cfg,
        logp,
        logp,
        t([1.0]),
        torch.ones(1, 2),
        ref_logprobs_BT=logp - 0.5,
        entropy_BT=t([[2.0, 4.0]]),
    )
    assert loss.item() == pytest.approx(-0.98)
    assert m["pg_loss"] == pytest.approx(-1) and m["kl_loss"] == pytest.approx(0.5)
    assert m["entropy"] == pytest.approx(3) and m["loss"] == pytest.approx(-0.98)


def test_compute_loss_applies_tis_to_policy_term_only():
    # token weights [2, 0.5] (see test_token_tis_hand_computed) times pg losses [-1, -1]
    #   -> (-2 - 0.5) / 2 = -1.25 ; the KL term (k1 = 0.5, beta 1) is not weighted: -1.25 + 0.5
    logp = t([[LN(3), LN(0.5)]])
    cfg = LossConfig(tis="token", tis_cap=2.0, kl_coef=1.0, kl_estimator="k1")
    loss, m = compute_loss(
        cfg,
        logp,
        logp,
        t([1.0]),
        torch.ones(1, 2),
        ref_logprobs_BT=logp - 0.5,
        rollout_logprobs_BT=torch.zeros(1, 2, dtype=F64),
    )
    assert m["pg_loss"] == pytest.approx(-1.25) and loss.item() == pytest.approx(-0.75)
    assert m["tis/clipped_frac"] == 0.5


def test_compute_loss_mis_weighs_and_rejects_in_the_policy_term_only():
    # logp = old = [ln 3, ln 0.5, ln 1.5, ln 0.25], rollout 0: rho = 1, A = 1 -> pg losses -1 each
    # MIS token, band [0.5, 2]: weights [0, 0.5, 1.5, 0] (test_token_mis_hand_computed)
    #   token-mean, rejected tokens still counted: (0 - 0.5 - 1.5 + 0) / 4 = -0.5
    #   d pg / d logp = -A rho w / 4 = [0, -0.125, -0.375, 0] (rejected tokens get no gradient)
    # with TIS token, cap 1.2 on top: TIS weighs, MIS only rejects: min(ratio, 1.2) =
    #   [1.2, 0.5, 1.2, 0.25] x keep [0, 1, 1, 0] = [0, 0.5, 1.2, 0] -> pg = -(0.5 + 1.2) / 4
    #   = -0.425 ; gradient -w / 4 = [0, -0.125, -0.3, 0]
    # the KL term (k1 = 0.5 per token, beta 0.1) is not weighted: loss = pg + 0.05
    old = t([[LN(3), LN(0.5), LN(1.5), LN(0.25)]])
    rollout, mask = torch.zeros(1, 4, dtype=F64), torch.ones(1, 4)
    for tis, pg, grad in [
        ("none", -0.5, [0, -0.125, -0.375, 0]),
        ("token", -0.425, [0, -0.125, -0.3, 0]),
    ]:
        cfg = LossConfig(tis=tis, tis_cap=1.2, mis="token", kl_coef=0.1, kl_estimator="k1")
        loss, m = compute_loss(
            cfg, old, old, t([1.0]), mask, ref_logprobs_BT=old - 0.5, rollout_logprobs_BT=rollout
        )
        assert m["pg_loss"] == pytest.approx(pg) and loss.item() == pytest.approx(pg + 0.05)
        assert m["mis/masked_frac"] == 0.5 and m["kl_loss"] == pytest.approx(0.5)
        logp = old.clone().requires_grad_()
        cfg = LossConfig(tis=tis, tis_cap=1.2, mis="token")
        compute_loss(cfg, logp, old, t([1.0]), mask, rollout_logprobs_BT=rollout)[0].backward()
        close(logp.grad, [grad])


def test_compute_loss_requires_what_the_config_uses():
    x, a, m = torch.zeros(1, 2), torch.ones(1), torch.ones(1, 2)
    with pytest.raises(ValueError, match="ref_logprobs_BT"):
        compute_loss(LossConfig(kl_coef=0.1), x, x, a, m)
    with pytest.raises(ValueError, match="entropy_BT"):
        compute_loss(LossConfig(entropy_coef=0.1), x, x, a, m)
    with pytest.raises(ValueError, match="rollout_logprobs_BT"):
        compute_loss(LossConfig(tis="sequence"), x, x, a, m)
    with pytest.raises(ValueError, match="mis='token' needs rollout_logprobs_BT"):
        compute_loss(LossConfig(mis="token"), x, x, a, m)
    # given but unused inputs are logged, not added
    loss, met = compute_loss(
        LossConfig(), x, x, a, m, ref_logprobs_BT=x - 1, entropy_BT=m, rollout_logprobs_BT=x + 0.1
    )
    assert loss.item() == pytest.approx(-1.0)
    assert met["kl"] > 0 and met["entropy"] == 1.0 and met["mismatch/kl"] == pytest.approx(0.1)


def test_compute_loss_gspo_uses_its_default_agg():
    # two rows, rho = 1: A = 1 over 3 tokens, A = 3 over 1 token
    #   seq-mean-token-mean (gspo default): (-1 - 3) / 2 = -2 ; token-mean (ppo default): -6 / 4
    logp = torch.zeros(2, 3, dtype=F64)
    mask = t([[1, 1, 1], [1, 0, 0]])
    assert compute_loss(LossConfig(loss="gspo"), logp, logp, t([1.0, 3.0]), mask)[0].item() == -2.0
    assert compute_loss(LossConfig(), logp, logp, t([1.0, 3.0]), mask)[0].item() == -1.5


@pytest.mark.parametrize("kl", ["k1", "k2", "k3"])
def test_compute_loss_all_masked_everything_on(kl):
    # -inf logprobs and NaN rollout logprobs at masked positions: a mask applied by multiplication
    # (0 * inf = NaN) would leak NaN into k2's gradient; masking by torch.where does not.
    logp = torch.full((2, 3), -math.inf, dtype=F64, requires_grad=True)
    ent = torch.full((2, 3), math.inf, dtype=F64, requires_grad=True)
    cfg = LossConfig(kl_coef=0.1, kl_estimator=kl, entropy_coef=0.01, tis="token", dual_clip=3.0)
    loss, met = compute_loss(
        cfg,
        logp,
        torch.zeros(2, 3),
        t([1.0, -1.0]),
        torch.zeros(2, 3),
        ref_logprobs_BT=torch.zeros(2, 3),
        entropy_BT=ent,
        rollout_logprobs_BT=torch.full((2, 3), math.nan),
    )
    assert loss.item() == 0.0 and loss.requires_grad
    loss.backward()
    assert logp.grad.abs().sum() == 0 and ent.grad.abs().sum() == 0
    assert all(math.isfinite(v) for v in met.values())


# --- config and registry -------------------------------------------------------------------------


def test_loss_config_validation_names_fields():
    with pytest.raises(ValidationError, match="max_response_len"):
        LossConfig(agg="seq-mean-token-sum-norm")
    assert LossConfig(agg="seq-mean-token-sum-norm", max_response_len=512).max_response_len == 512
    with pytest.raises(ValidationError, match="dual_clip"):
        LossConfig(dual_clip=1.0)
    with pytest.raises(ValidationError, match="dual_clip"):
        LossConfig(loss="gspo", dual_clip=3.0)
    with pytest.raises(ValidationError, match="clip_hgh"):
        LossConfig(clip_hgh=0.28)
    with pytest.raises(ValidationError, match="kl_estimator"):
        LossConfig(kl_estimator="k4")
    with pytest.raises(ValidationError, match="tis"):
        LossConfig(tis="both")
    with pytest.raises(ValidationError, match="kl_coef"):
        LossConfig(kl_coef=-1)
    for name, field in LossConfig.model_fields.items():
        assert field.description, name


def test_loss_registry():
    assert get_loss_fn("ppo") is policy_loss and get_loss_fn("gspo") is gspo_loss
    with pytest.raises(ValueError, match="valid: \\['gspo', 'ppo'\\]"):
        get_loss_fn("grpo")


def test_aggregate_keeps_dtype():
    loss = aggregate(torch.ones(2, 2, dtype=torch.bfloat16), torch.ones(2, 2))
    assert loss.dtype == torch.bfloat16 and loss.item() == 1.0
