"""Numeric tests of agentgrpo.algo.advantage: hand-computed values, edge cases, invariances, and a
slow pure-Python reference."""

import math
import random
import statistics

import pytest
import torch
from pydantic import ValidationError

from agentgrpo.algo.advantage import (
    ESTIMATORS,
    AdvantageConfig,
    compute_advantages,
    compute_turn_advantages,
    discounted_returns,
    estimator_names,
    get_estimator,
    is_zero_variance,
)

NAN = math.nan
S3 = math.sqrt(
    1 / 3
)  # std of [1, 0, 0] with Bessel: deviations 2/3, -1/3, -1/3 -> (4+1+1)/9 / 2 = 1/3


def adv(rewards, ids, estimator="grpo", **kw):
    return compute_advantages(torch.tensor(rewards, dtype=torch.float64), ids, estimator, **kw)


# --- hand-computed values ------------------------------------------------------------------------


def test_grpo_hand_computed():
    # group a = [1, 0, 0]: mean 1/3, std sqrt(1/3) = 0.57735
    #   A = (2/3) / 0.57735 = 1.1547, (-1/3) / 0.57735 = -0.57735 (x2)
    # group b = [2, 4]: mean 3, std sqrt((1 + 1) / 1) = 1.41421 -> A = -/+ 0.70711
    got = adv([1, 0, 0, 2, 4], ["a", "a", "a", "b", "b"])
    want = [
        (2 / 3) / (S3 + 1e-6),
        (-1 / 3) / (S3 + 1e-6),
        (-1 / 3) / (S3 + 1e-6),
        -1 / (math.sqrt(2) + 1e-6),
        1 / (math.sqrt(2) + 1e-6),
    ]
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64))
    assert got[0].item() == pytest.approx(1.1547, abs=1e-4)


def test_grpo_eps_is_used():
    # [0, 2]: mean 1, std sqrt(2); eps = 1 -> A = -1 / (1.41421 + 1) = -0.41421
    got = adv([0, 2], [0, 0], eps=1.0)
    assert got.tolist() == pytest.approx([-1 / (math.sqrt(2) + 1), 1 / (math.sqrt(2) + 1)])


def test_dr_grpo_hand_computed():
    # group [1, 0, 0]: mean 1/3 -> A = 2/3, -1/3, -1/3 ; group [2, 4]: mean 3 -> -1, 1
    got = adv([1, 0, 0, 2, 4], ["a", "a", "a", "b", "b"], "dr_grpo")
    assert got.tolist() == pytest.approx([2 / 3, -1 / 3, -1 / 3, -1, 1])


def test_rloo_hand_computed():
    # group [1, 0, 0]: A_0 = 1 - mean(0, 0) = 1 ; A_1 = 0 - mean(1, 0) = -0.5 ; A_2 = -0.5
    # group [2, 4, 9]: A = 2 - 6.5 = -4.5 ; 4 - 5.5 = -1.5 ; 9 - 3 = 6
    got = adv([1, 0, 0, 2, 4, 9], [7, 7, 7, 8, 8, 8], "rloo")
    assert got.tolist() == pytest.approx([1, -0.5, -0.5, -4.5, -1.5, 6])


def test_batch_std_hand_computed():
    # rewards [1, 0, 3, 5] in groups a, a, b, b. Group means 0.5 and 4.
    # batch std (Bessel): mean 2.25, deviations -1.25 -2.25 .75 2.75 -> squares 1.5625 5.0625
    #   .5625 7.5625 = 14.75 / 3 = 4.91667 -> std 2.21736
    # grpo and dr_grpo: (r - group mean) / batch std = .5, -.5, -1, 1 divided by 2.21736
    sd = math.sqrt(14.75 / 3)
    want = [0.5 / sd, -0.5 / sd, -1 / sd, 1 / sd]
    for est in ("grpo", "dr_grpo"):
        got = adv([1, 0, 3, 5], ["a", "a", "b", "b"], est, batch_std=True, eps=0.0)
        assert got.tolist() == pytest.approx(want)
    # rloo: n/(n-1) = 2 -> 1, -1, -2, 2, then / batch std
    got = adv([1, 0, 3, 5], ["a", "a", "b", "b"], "rloo", batch_std=True, eps=0.0)
    assert got.tolist() == pytest.approx([1 / sd, -1 / sd, -2 / sd, 2 / sd])


# --- edge cases ----------------------------------------------------------------------------------


@pytest.mark.parametrize("estimator", sorted(ESTIMATORS))
def test_zero_variance_group_is_exactly_zero(estimator):
    # 0.1 summed seven times is 0.7000000000000001, so the float mean is not exactly 0.1 and the
    # formula alone leaves a residue: the explicit equality check must make it exactly 0.
    r = [0.1] * 7
    naive = torch.tensor(r, dtype=torch.float64) - torch.tensor(r, dtype=torch.float64).mean()
    assert naive.abs().max() > 0  # the test is meaningful: without the check this would fail
    got = adv(r + [1.0, 0.0], [0] * 7 + [1, 1], estimator)
    assert got[:7].tolist() == [0.0] * 7
    assert got[7] > 0 > got[8]


@pytest.mark.parametrize("estimator", sorted(ESTIMATORS))
def test_singleton_and_all_nan_groups_give_zero(estimator):
    got = adv(
        [5.0, NAN, NAN, 3.0, NAN, 1.0, 0.0], ["s", "n", "n", "one", "one", "ok", "ok"], estimator
    )
    assert not torch.isnan(got).any()
    # singleton, all-NaN group, group with a single scorable reward: all exactly 0
    assert got[:5].tolist() == [0.0] * 5
    assert got[5] > 0 > got[6]


def test_nan_left_out_of_statistics():
    # group [1, NaN, 0]: stats over [1, 0] only -> mean .5, std sqrt(.5) = .70711
    #   grpo: +-.5 / .70711 = +-.70711 ; rloo: n = 2 -> 2 * (+-.5) = +-1 ; NaN row -> 0
    r, ids = [1.0, NAN, 0.0], ["g", "g", "g"]
    assert adv(r, ids, "grpo", eps=0.0).tolist() == pytest.approx(
        [math.sqrt(0.5), 0.0, -math.sqrt(0.5)]
    )
    assert adv(r, ids, "dr_grpo").tolist() == pytest.approx([0.5, 0.0, -0.5])
    assert adv(r, ids, "rloo").tolist() == pytest.approx([1.0, 0.0, -1.0])


def test_nan_group_with_equal_scorable_rewards_is_zero():
    assert adv([1.0, NAN, 1.0], [0, 0, 0]).tolist() == [0.0, 0.0, 0.0]


def test_empty_batch():
    assert compute_advantages(torch.zeros(0), []).shape == (0,)


def test_inf_reward_raises():
    with pytest.raises(ValueError, match="inf"):
        adv([1.0, math.inf], [0, 0])


def test_shape_errors():
    with pytest.raises(ValueError, match="entries"):
        adv([1.0, 0.0], [0])
    with pytest.raises(ValueError, match="1-D"):
        compute_advantages(torch.zeros(2, 2), [0, 0])
    with pytest.raises(ValueError, match="1-D"):
        compute_advantages(torch.zeros(4), torch.zeros(2, 2, dtype=torch.long))


def test_unknown_estimator_lists_valid_names():
    with pytest.raises(ValueError, match=r"valid: \['dr_grpo', 'grpo', 'rloo'\]"):
        adv([1.0, 0.0], [0, 0], "ppo")
    with pytest.raises(ValueError, match="dr_grpo"):
        get_estimator("GRPO")


def test_dtype_no_grad_and_integer_rewards():
    r = torch.tensor([1.0, 0.0], requires_grad=True)
    got = compute_advantages(r, [0, 0])
    assert got.dtype == torch.float32 and not got.requires_grad
    got = compute_advantages(torch.tensor([1, 0, 0]), [0, 0, 0], "dr_grpo")
    assert got.dtype == torch.float32 and got.tolist() == pytest.approx([2 / 3, -1 / 3, -1 / 3])
    half = compute_advantages(torch.tensor([1.0, 0.0], dtype=torch.bfloat16), [0, 0])
    assert half.dtype == torch.bfloat16


# --- group ids and invariances -------------------------------------------------------------------


def _random_batch(seed, n=40):
    rng = random.Random(seed)
    ids = [rng.randrange(8) for _ in range(n)]
    rewards = [rng.choice([0.0, 1.0, 0.5, NAN, rng.random()]) for _ in range(n)]
    return rewards, ids


@pytest.mark.parametrize("estimator", sorted(ESTIMATORS))
def test_permuting_rows_permutes_advantages(estimator):
    rewards, ids = _random_batch(0)
    base = adv(rewards, ids, estimator)
    perm = torch.randperm(len(ids), generator=torch.Generator().manual_seed(1)).tolist()
    got = adv([rewards[i] for i in perm], [ids[i] for i in perm], estimator)
    torch.testing.assert_close(got, base[perm], rtol=0, atol=1e-12)


@pytest.mark.parametrize("estimator", sorted(ESTIMATORS))
def test_relabelling_groups_leaves_advantages_unchanged(estimator):
    rewards, ids = _random_batch(2)
    base = adv(rewards, ids, estimator)
    relabels = [
        lambda g: -g - 1,  # negative
        lambda g: 2**62 + g,  # huge (exact only if read as Python ints)
        lambda g: f"task-{g}",  # strings
        lambda g: ("t", g),  # any hashable
    ]
    for f in relabels:
        assert adv(rewards, [f(g) for g in ids], estimator).tolist() == base.tolist()
    assert adv(rewards, torch.tensor([2**62 + g for g in ids]), estimator).tolist() == base.tolist()
    assert adv(rewards, torch.tensor(ids), estimator).tolist() == base.tolist()


def test_huge_int_ids_are_not_merged():
    # 2**62 and 2**62 + 1 are equal as float64; read as ints they are two groups (singletons -> 0)
    got = adv([1.0, 0.0], torch.tensor([2**62, 2**62 + 1]))
    assert got.tolist() == [0.0, 0.0]


# --- against a slow reference --------------------------------------------------------------------


def reference(rewards, ids, estimator, eps=1e-6):
    """Per-row pure Python: the formulas of docs/design.md (algorithms), one group at a time."""
    out = []
    for r, g in zip(rewards, ids, strict=True):
        members = [x for x, h in zip(rewards, ids, strict=True) if h == g and not math.isnan(x)]
        if math.isnan(r) or len(members) < 2 or len(set(members)) == 1:
            out.append(0.0)
        elif estimator == "grpo":
            out.append((r - statistics.mean(members)) / (statistics.stdev(members) + eps))
        elif estimator == "dr_grpo":
            out.append(r - statistics.mean(members))
        else:
            others = list(members)
            others.remove(r)
            out.append(r - statistics.mean(others))
    return out


@pytest.mark.parametrize("estimator", sorted(ESTIMATORS))
@pytest.mark.parametrize("seed", range(3))
def test_matches_slow_reference(estimator, seed):
    rewards, ids = _random_batch(seed, n=60)
    assert adv(rewards, ids, estimator).tolist() == pytest.approx(
        reference(rewards, ids, estimator), abs=1e-9
    )


def test_is_zero_variance():
    assert is_zero_variance([1.0, 1.0])
    assert is_zero_variance([1.0, NAN])
    assert is_zero_variance([])
    assert not is_zero_variance([1.0, NAN, 0.0])
    assert not is_zero_variance(torch.tensor([0.1, 0.1 + 1e-12], dtype=torch.float64))


# --- config --------------------------------------------------------------------------------------


def test_config_defaults_forbid_and_descriptions():
    cfg = AdvantageConfig()
    assert (cfg.estimator, cfg.eps, cfg.batch_std) == ("grpo", 1e-6, False)
    with pytest.raises(ValidationError, match="estimatr"):
        AdvantageConfig(estimatr="rloo")
    with pytest.raises(ValidationError, match="estimator"):
        AdvantageConfig(estimator="ppo")
    for name, field in AdvantageConfig.model_fields.items():
        assert field.description, name
    assert set(AdvantageConfig.model_fields["estimator"].annotation.__args__) == set(
        estimator_names()
    )


# --- turn-level: turn_grpo -----------------------------------------------------------------------


def turn_adv(rewards, turns, ids, **kw):
    return compute_turn_advantages(torch.tensor(rewards, dtype=torch.float64), turns, ids, **kw)


def assert_rows(got, want):
    assert [len(r) for r in got] == [len(r) for r in want]
    for g, w in zip(got, want, strict=True):
        assert g == pytest.approx(w, abs=1e-12)


def test_discounted_returns_hand_computed():
    # gamma 0.5: R_2 = 4, R_1 = 2 + 0.5 * 4 = 4, R_0 = 1 + 0.5 * 4 = 3 ; a NaN at turn 1 makes
    # R_1 and R_0 NaN, R_2 stays 4
    got = discounted_returns(torch.tensor([[1.0, 2.0, 4.0], [1.0, NAN, 4.0]]), 0.5)
    assert got[0].tolist() == [3.0, 4.0, 4.0]
    assert math.isnan(got[1, 0]) and math.isnan(got[1, 1]) and got[1, 2].item() == 4.0


def test_turn_grpo_hand_computed_unequal_turns():
    # One group of 3 (eps 0). Outcome rewards [1.5, 1, 0]: mean 5/6, deviations 2/3, 1/6, -5/6,
    #   squares 4/9 + 1/36 + 25/36 = 7/6, / 2 = 7/12, std 0.763763
    #   -> A = .872872, .218218, -1.091089
    # turn 0 returns (gamma 1) = the totals [1.5, 1, 0]: the same z-scores as the outcome
    # turn 1 returns [1, 1, 0]: mean 2/3, std sqrt((1/9 + 1/9 + 4/9) / 2) = 0.577350
    #   -> z = .577350, .577350, -1.154701
    # turn 2: only the third member has one: a lone member -> turn term 0
    sd_o, sd_1 = math.sqrt(7 / 12), math.sqrt(1 / 3)
    o = [(1.5 - 5 / 6) / sd_o, (1 - 5 / 6) / sd_o, (0 - 5 / 6) / sd_o]
    z1 = [(1 - 2 / 3) / sd_1, (1 - 2 / 3) / sd_1, (0 - 2 / 3) / sd_1]
    got = turn_adv([1.5, 1.0, 0.0], [[0.5, 1.0], [0.0, 1.0], [0.0, 0.0, 0.0]], ["g"] * 3, eps=0.0)
    want = [[2 * o[0], o[0] + z1[0]], [2 * o[1], o[1] + z1[1]], [2 * o[2], o[2] + z1[2], o[2]]]
    assert_rows(got, want)
    assert got[0][0] == pytest.approx(1.745743, abs=1e-6)
    # turn_weight scales the turn term only: 0 leaves the outcome (grpo) advantage on every turn
    flat = turn_adv([1.5, 1.0, 0.0], [[0.5, 1.0], [0.0, 1.0], [0.0] * 3], [0] * 3, turn_weight=0)
    grpo = adv([1.5, 1.0, 0.0], [0] * 3).tolist()
    assert_rows(flat, [[grpo[0]] * 2, [grpo[1]] * 2, [grpo[2]] * 3])


def test_turn_grpo_gamma_and_weight():
    # Two members, equal outcome (1 each: outcome term exactly 0). gamma 0.5:
    #   member 0 turns [0, 1] -> R_0 = 0 + 0.5 * 1 = 0.5, R_1 = 1
    #   member 1 turns [1, 0] -> R_0 = 1, R_1 = 0
    # turn 0: [0.5, 1]: mean .75, std sqrt(2 * .0625) = .353553 -> z = -.707107, .707107
    # turn 1: [1, 0]: mean .5, std .707107 -> z = .707107, -.707107 ; turn_weight 2 doubles them
    r = 1 / math.sqrt(2)
    got = turn_adv([1.0, 1.0], [[0.0, 1.0], [1.0, 0.0]], [0, 0], eps=0.0, gamma=0.5, turn_weight=2)
    assert_rows(got, [[-2 * r, 2 * r], [2 * r, -2 * r]])
    # gamma 1: turn 0 returns are equal (1 and 1): its turn term is exactly 0
    got = turn_adv([1.0, 1.0], [[0.0, 1.0], [1.0, 0.0]], [0, 0], eps=0.0)
    assert got[0][0] == 0.0 and got[1][0] == 0.0
    assert got[0][1] == pytest.approx(r) and got[1][1] == pytest.approx(-r)


def test_turn_grpo_nan_rewards():
    # Group of 4 (eps 0):
    #   m0: reward NaN (unscorable) -> 0 on every turn, and in no statistics
    #   m1: reward 2, turns [1, 1]; m2: reward 1, turns [NaN, 1]; m3: reward 0, turns [0, 0]
    # outcome over m1..m3 [2, 1, 0]: mean 1, std 1 -> 1, 0, -1
    # turn 0 returns: m1 2, m2 NaN (left out, term 0), m3 0: mean 1, std sqrt(2) -> +-.707107
    # turn 1 returns: [1, 1, 0]: mean 2/3, std .577350 -> .577350, .577350, -1.154701
    r, s = 1 / math.sqrt(2), math.sqrt(1 / 3)
    got = turn_adv(
        [NAN, 2.0, 1.0, 0.0], [[1.0, 1.0], [1.0, 1.0], [NAN, 1.0], [0.0, 0.0]], [0] * 4, eps=0.0
    )
    assert got[0] == [0.0, 0.0]
    assert_rows(got[1:], [[1 + r, 1 + (1 / 3) / s], [0.0, (1 / 3) / s], [-1 - r, -1 - (2 / 3) / s]])


def test_turn_grpo_singleton_and_all_equal_groups_are_exactly_zero():
    got = turn_adv(
        [1.0, 1.0, 1.0, 0.5, 0.5],
        [[1.0, 0.0], [0.5, 0.5], [0.5, 0.5], [0.0, 0.5], [0.0, 0.5]],
        ["alone", "eq", "eq", "eq2", "eq2"],
    )
    assert got == [[0.0, 0.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]]
    # equal outcomes but different turn returns: the turn term alone (outcome term exactly 0)
    # turn 0 returns [1, 1] equal -> 0 ; turn 1 returns [0.5, 1]: mean .75, std .353553 -> -+.707107
    got = turn_adv([1.0, 1.0], [[0.5, 0.5], [0.0, 1.0]], [0, 0], eps=0.0)
    assert got[0][0] == 0.0 and got[1][0] == 0.0
    assert [got[0][1], got[1][1]] == pytest.approx([-1 / math.sqrt(2), 1 / math.sqrt(2)])


def test_turn_grpo_groups_are_independent_and_empty_rows_allowed():
    # groups a and b interleaved give what each gives alone; a row with no sampled turn gets []
    a = turn_adv([1.0, 0.0], [[1.0], [0.0]], [0, 0])
    b = turn_adv([3.0, 1.0, 2.0], [[2.0, 1.0], [1.0], [0.0, 2.0]], [0, 0, 0])
    both = turn_adv(
        [1.0, 3.0, 0.0, 1.0, 2.0, 0.0],
        [[1.0], [2.0, 1.0], [0.0], [1.0], [0.0, 2.0], []],
        ["a", "b", "a", "b", "b", "c"],
    )
    assert both == [a[0], b[0], a[1], b[1], b[2], []]


def test_turn_estimator_errors():
    with pytest.raises(ValueError, match=r"gamma must be in \(0, 1\]"):
        turn_adv([1.0, 0.0], [[1.0], [0.0]], [0, 0], gamma=0.0)
    with pytest.raises(ValueError, match="turn_weight must be >= 0"):
        turn_adv([1.0, 0.0], [[1.0], [0.0]], [0, 0], turn_weight=-1.0)
    with pytest.raises(ValueError, match="unknown turn-level advantage estimator 'grpo'"):
        turn_adv([1.0, 0.0], [[1.0], [0.0]], [0, 0], estimator="grpo")
    with pytest.raises(ValueError, match="inf"):
        turn_adv([1.0, 0.0], [[math.inf], [0.0]], [0, 0])
    with pytest.raises(ValueError, match="2 turn-reward lists but 3 rewards"):
        turn_adv([1.0, 0.0, 1.0], [[1.0], [0.0]], [0, 0, 0])
    # the outcome-only entry point names why it cannot run a turn-level estimator
    with pytest.raises(ValueError, match="'turn_grpo' is turn-level"):
        adv([1.0, 0.0], [0, 0], "turn_grpo")


def test_turn_config_validation():
    cfg = AdvantageConfig(estimator="turn_grpo", gamma=0.9, turn_weight=0.5)
    assert (cfg.gamma, cfg.turn_weight) == (0.9, 0.5)
    assert (AdvantageConfig().gamma, AdvantageConfig().turn_weight) == (1.0, 1.0)
    for bad in (0.0, -0.5, 1.5):
        with pytest.raises(ValidationError, match="gamma"):
            AdvantageConfig(estimator="turn_grpo", gamma=bad)
    with pytest.raises(ValidationError, match="turn_weight"):
        AdvantageConfig(estimator="turn_grpo", turn_weight=-1)
    with pytest.raises(ValidationError, match="apply only to a turn-level estimator"):
        AdvantageConfig(estimator="grpo", gamma=0.9)
    with pytest.raises(ValidationError, match="batch_std is not supported"):
        AdvantageConfig(estimator="turn_grpo", batch_std=True)
    with pytest.raises(ValidationError, match="turn_grpo"):  # the valid names are listed
        AdvantageConfig(estimator="turn_ppo")


# --- the training step's assignment (agentgrpo.run.train.assign_advantages)
# --------------------------


def _episodes(changes=None):
    """A group of three two-turn episodes (two runs of loss_mask == 1); the last one's second turn
    got no env.step. `changes`: {index: fields to replace} of some episodes."""
    import dataclasses

    from agentgrpo.types import Group, Task
    from tests.tiny import traj

    turn_rewards = [[0.5, 1.0], [0.0, 1.0], [0.0]]
    out = []
    for i, tr in enumerate(turn_rewards):
        t = traj([1, 2, 3, 4], [0, 1, 0, 1], group="g", reward=sum(tr))
        out.append(dataclasses.replace(t, turn_rewards=tr, **(changes or {}).get(i, {})))
    return Group("g", Task(id="t", prompt="p"), out)


def test_assign_advantages_outcome_only_is_unchanged_and_turn_level_sets_turns():
    from agentgrpo.run.config import RunConfig
    from agentgrpo.run.train import assign_advantages

    group = _episodes()
    adv = assign_advantages([group], RunConfig.model_validate({"advantage": {"estimator": "grpo"}}))
    want = compute_advantages(torch.tensor([1.5, 1.0, 0.0]), ["g"] * 3).tolist()
    trajs = group.trajectories
    assert [adv[t.id].value for t in trajs] == want  # exactly compute_advantages' numbers
    assert all(adv[t.id].per_turn is None for t in trajs)
    assert all(t.to_dict(advantage=adv[t.id])["turn_advantages"] is None for t in trajs)

    cfg = RunConfig.model_validate({"advantage": {"estimator": "turn_grpo"}})
    adv = assign_advantages([group], cfg)
    assert [adv[t.id].value for t in trajs] == want  # the outcome term
    # the third episode's unanswered second turn counts as reward 0 (sampled_turn_rewards)
    expected = compute_turn_advantages(
        torch.tensor([1.5, 1.0, 0.0]), [[0.5, 1.0], [0.0, 1.0], [0.0, 0.0]], ["g"] * 3
    )
    assert [list(adv[t.id].per_turn) for t in trajs] == expected
    assert [t.to_dict(advantage=adv[t.id])["turn_advantages"] for t in trajs] == expected


def test_assign_advantages_turn_level_drops_unscorable_and_masked_rows():
    from agentgrpo.run.config import RunConfig
    from agentgrpo.run.train import assign_advantages
    from agentgrpo.types import StopReason

    group = _episodes({0: {"reward": NAN}, 2: {"stop_reason": StopReason.MAX_TOKENS}})
    cfg = {"advantage": {"estimator": "turn_grpo"}, "shaping": {"mask_truncated": True}}
    adv = assign_advantages([group], RunConfig.model_validate(cfg))
    first, second, third = group.trajectories
    assert first.id not in adv and third.id not in adv  # not trained on: no advantage at all
    assert len(adv[second.id].per_turn) == 2
