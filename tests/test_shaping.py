"""Tests of agentgrpo.algo.shaping: DAPO overlong shaping, truncation masks, dynamic-sampling
filter, and the start-up description of the algorithm."""

import math

import pytest
import torch
from pydantic import ValidationError

from agentgrpo.algo.advantage import AdvantageConfig, compute_advantages
from agentgrpo.algo.loss import LossConfig
from agentgrpo.algo.shaping import (
    ShapingConfig,
    describe_algorithm,
    keep_informative_groups,
    overlong_penalty,
    shaped_rewards,
    truncated_rows,
)
from agentgrpo.types import StopReason
from tests.tiny import traj

NAN = math.nan


def test_shaped_rewards_count_tokens_after_the_prompt_and_keep_nan():
    # prompts of 5; after it 10, 18 and 18 tokens; max_tokens 20, buffer 4: 0, -0.5, -0.5 (NaN
    # stays)
    trajs = [
        traj([1] * (5 + n), [0] * 5 + [1] * n, reward=r)
        for n, r in ((10, 1.0), (18, 1.0), (18, NAN))
    ]
    rewards = [t.reward for t in trajs]  # the trajectories' scores
    got = shaped_rewards(trajs, rewards, ShapingConfig(overlong_buffer_len=4), max_tokens=20)
    assert got[:2].tolist() == pytest.approx([1.0, 0.5]) and math.isnan(got[2])
    assert shaped_rewards(trajs, rewards, ShapingConfig(), max_tokens=20)[:2].tolist() == [1.0, 1.0]


def test_overlong_penalty_hand_computed():
    # max_len 20, buffer 4 -> the penalty starts after 16 tokens; e = len - 16
    #   len 10: e = -6 -> 0 ; 16: e = 0 -> 0 ; 17: -1/4 = -0.25 ; 18: -0.5 ; 20: -1
    #   25: capped at -1
    got = overlong_penalty(torch.tensor([10, 16, 17, 18, 20, 25]), max_len=20, buffer_len=4)
    assert got.tolist() == pytest.approx([0, 0, -0.25, -0.5, -1, -1])
    # penalty_factor 0.5 scales it: len 18 -> -0.5 * 2/4 = -0.25 ; 22 -> -0.5
    got = overlong_penalty(torch.tensor([18, 22]), max_len=20, buffer_len=4, penalty_factor=0.5)
    assert got.tolist() == pytest.approx([-0.25, -0.5])
    assert got.dtype == torch.float32


def test_overlong_penalty_keeps_unscorable_rewards_nan():
    rewards = torch.tensor([1.0, NAN]) + overlong_penalty(torch.tensor([19, 19]), 20, 4)
    assert rewards[0].item() == pytest.approx(0.25) and math.isnan(rewards[1].item())


def test_overlong_buffer_validated():
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_penalty(torch.tensor([1]), max_len=10, buffer_len=11)
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_penalty(torch.tensor([1]), max_len=10, buffer_len=0)


def test_truncated_rows():
    reasons = [StopReason.COMPLETED, StopReason.MAX_TOKENS, "max_turns", "max_tokens"]
    trunc = truncated_rows(reasons)
    assert trunc.tolist() == [False, True, False, True]
    assert truncated_rows(reasons, {StopReason.MAX_TURNS}).tolist() == [False, False, True, False]
    with pytest.raises(ValueError):
        truncated_rows(["finished"])


def test_keep_informative_groups():
    groups = [[1.0, 0.0], [1.0, 1.0], [0.5], [NAN, 1.0, 1.0], [NAN, 1.0, 0.0], [], [NAN, NAN]]
    assert keep_informative_groups(groups) == [True, False, False, False, True, False, False]


def test_filter_agrees_with_zero_advantages():
    # a kept group has a non-zero advantage somewhere; a dropped one is all zeros
    groups = [[0.1] * 7, [0.2, 0.2 + 1e-9], [NAN, 3.0], [1.0, 0.0, NAN]]
    keep = keep_informative_groups(groups)
    ids = [i for i, g in enumerate(groups) for _ in g]
    a = compute_advantages(torch.tensor([r for g in groups for r in g], dtype=torch.float64), ids)
    for i, k in enumerate(keep):
        nonzero = bool(a[torch.tensor(ids) == i].abs().sum() > 0)
        assert nonzero == k, (i, groups[i])


def test_shaping_config():
    cfg = ShapingConfig()
    assert not cfg.dynamic_sampling and cfg.overlong_buffer_len is None and not cfg.mask_truncated
    with pytest.raises(ValidationError, match="dynamic_sampeling"):
        ShapingConfig(dynamic_sampeling=True)
    with pytest.raises(ValidationError, match="max_extra_rounds"):
        ShapingConfig(max_extra_rounds=-1)
    with pytest.raises(ValidationError, match="overlong_buffer_len"):
        ShapingConfig(overlong_buffer_len=0)
    for name, field in ShapingConfig.model_fields.items():
        assert field.description, name


def test_describe_algorithm_names_every_choice():
    text = describe_algorithm(
        AdvantageConfig(estimator="rloo"),
        LossConfig(
            clip_high=0.28,
            dual_clip=3.0,
            kl_coef=0.001,
            kl_estimator="k2",
            tis="sequence",
            tis_cap=1.5,
            mis="geometric",
            mis_low=0.25,
            mis_high=4.0,
        ),
        ShapingConfig(
            dynamic_sampling=True, max_extra_rounds=5, overlong_buffer_len=256, mask_truncated=True
        ),
    )
    for piece in [
        "rloo",
        "ppo-clip",
        "[0.8, 1.28]",
        "dual clip c = 3",
        "token-mean",
        "k2",
        "beta = 0.001",
        "sequence-level, cap 1.5",
        "geometric: 0 where the geometric mean of each sequence's token ratios is outside "
        "[0.25, 4], else the tis weight",
        "<= 5 extra rounds",
        "last 256 tokens",
        "truncated trajectories masked",
    ]:
        assert piece in text, piece
    plain = describe_algorithm(AdvantageConfig(), LossConfig(loss="gspo"), ShapingConfig())
    for piece in [
        "grpo",
        "1e-06",
        "gspo",
        "seq-mean-token-mean",
        "kl           off (no reference model)",
        "no dynamic sampling",
        "tis          off",
        "mis          off",
    ]:
        assert piece in plain, piece
    assert text.startswith("algorithm:\n") and len(text.splitlines()) == 9
    token = describe_algorithm(AdvantageConfig(), LossConfig(mis="token"), ShapingConfig())
    assert "mis          token: weight = the token ratio, 0 outside [0.5, 2]" in token
    norm = describe_algorithm(
        AdvantageConfig(estimator="dr_grpo", batch_std=True),
        LossConfig(agg="seq-mean-token-sum-norm", max_response_len=1024),
        ShapingConfig(),
    )
    assert "batch std" in norm and "/ 1024" in norm


def test_the_printed_formula_is_the_one_computed_with_batch_std():
    # rloo with batch_std centres on the mean of the others: n/(n-1) x (r - group mean), not r -
    # mean
    cfg = AdvantageConfig(estimator="rloo", batch_std=True)
    text = describe_algorithm(cfg, LossConfig(), ShapingConfig())
    assert "A = (r - mean of the other group members) / (batch std" in text
    r = torch.tensor([1.0, 0.0, 0.0])
    adv = compute_advantages(r, [0, 0, 0], "rloo", cfg.eps, batch_std=True)
    others = torch.stack([(r.sum() - r[i]) / 2 for i in range(3)])
    assert adv.tolist() == pytest.approx(((r - others) / (r.std() + cfg.eps)).tolist(), abs=1e-5)
    assert "grpo  A = (r - group mean) / (batch std" in describe_algorithm(
        AdvantageConfig(batch_std=True), LossConfig(), ShapingConfig()
    )


def test_an_overlong_buffer_past_max_tokens_is_refused_at_start_up():
    from agentgrpo.run.config import ConfigError, load_config

    with pytest.raises(
        ConfigError, match="shaping.overlong_buffer_len=128 is longer than rollout.max_tokens=64"
    ):
        load_config(None, ["shaping.overlong_buffer_len=128", "rollout.max_tokens=64"])
    assert (
        load_config(
            None, ["shaping.overlong_buffer_len=64", "rollout.max_tokens=64"]
        ).shaping.overlong_buffer_len
        == 64
    )


def test_describe_algorithm_prints_the_turn_level_formula():
    text = describe_algorithm(
        AdvantageConfig(estimator="turn_grpo", gamma=0.9, turn_weight=0.5),
        LossConfig(),
        ShapingConfig(),
    )
    for piece in [
        "turn_grpo  A_k = (r - group mean) / (group std + 1e-06) + 0.5 * (R_k - mean_k)",
        "on turn k's tokens",
        "R_k = sum_(j>=k) 0.9^(j-k) r_j",
        "with a turn k",
        "outcome term 0 for singletons",
    ]:
        assert piece in text, piece
    cfg = AdvantageConfig(estimator="turn_grpo")
    plain = describe_algorithm(cfg, LossConfig(), ShapingConfig())
    assert "R_k = sum_(j>=k) r_j" in plain and "+ 1 * (R_k" in plain
