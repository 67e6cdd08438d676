"""Learner: accumulated gradients equal one big batch, passes, mini-batches, schedule, reference,
LoRA, precision options, save/load, and 2 gloo processes equal 1 process."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch

from agentgrpo.algo.loss import LossConfig, compute_loss
from agentgrpo.learner.batch import balanced_parts, make_micro_batches, token_advantages
from agentgrpo.learner.learner import Learner, LearnerConfig
from agentgrpo.learner.logprobs import sequence_logprobs, token_logprobs
from tests.ranks import spawn_gloo
from tests.tiny import groups_of_trajectories, rows, tiny_llama, traj

TEMPERATURE = 0.8


def off_policy(trajs, model, seed=0):
    """Rollout logprobs = the model's own plus noise, so ratios differ from 1 and clipping binds."""
    g = torch.Generator().manual_seed(seed)
    ref = sequence_logprobs(model, [list(t.token_ids) for t in trajs], TEMPERATURE)
    out = []
    for t, lps in zip(trajs, ref, strict=True):
        noise = (torch.randn(len(lps), generator=g) * 0.3).tolist()
        logprobs = [lp + e if m else 0.0 for lp, e, m in zip(lps, noise, t.loss_mask, strict=True)]
        out.append(dataclasses.replace(t, logprobs=logprobs))
    return out


def batch_and_advantages(seed=0, model=None):
    trajs = off_policy(groups_of_trajectories(n_groups=3, size=4, seed=seed), model or tiny_llama())
    advantages = [((i * 7) % 5 - 2) / 2 for i in range(len(trajs))]  # mixed signs, some zeros
    return trajs, advantages


def record_grads(learner):
    """Capture the gradient the optimizer is about to apply (after accumulation and clipping)."""
    grads: list[dict[str, torch.Tensor]] = []
    step = learner.optimizer.step

    def recording(*a, **kw):
        grads.append(
            {
                n: p.grad.clone()
                for n, p in learner.unwrapped.named_parameters()
                if p.grad is not None
            }
        )
        return step(*a, **kw)

    learner.optimizer.step = recording
    return grads


def one_big_batch_grads(trajs, advantages, loss_cfg):
    """The plain reference: every trajectory in one right-padded batch, full logits, one loss call
    with its own (whole-batch) normalisers, one backward."""
    model = tiny_llama().train()
    T = max(len(t.token_ids) for t in trajs)
    ids = torch.zeros(len(trajs), T, dtype=torch.long)
    attn, mask, old = torch.zeros_like(ids), torch.zeros(len(trajs), T), torch.zeros(len(trajs), T)
    for i, t in enumerate(trajs):
        n = len(t.token_ids)
        ids[i, :n], attn[i, :n] = torch.tensor(t.token_ids), 1
        mask[i, :n], old[i, :n] = (
            torch.tensor(t.loss_mask, dtype=torch.float),
            torch.tensor(t.logprobs),
        )
    lp = token_logprobs(model, ids, attn, TEMPERATURE)
    ref = (
        token_logprobs(tiny_llama(), ids, attn, TEMPERATURE).detach() if loss_cfg.kl_coef else None
    )
    adv = torch.as_tensor(advantages)  # [B], or [B, T] per token
    loss, _ = compute_loss(loss_cfg, lp, old, adv, mask, ref_logprobs_BT=ref)
    loss.backward()
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    "loss_cfg",
    [
        LossConfig(),
        LossConfig(agg="seq-mean-token-mean", kl_coef=0.1, dual_clip=3.0),
        LossConfig(agg="seq-mean-token-sum-norm", max_response_len=24, loss="gspo"),
    ],
    ids=["token-mean", "seq-mean+kl", "dr-grpo+gspo"],
)
@pytest.mark.parametrize(
    "packing,budget,row_cap,chunk",
    [
        ("shared_prefix", 48, "auto", None),
        ("packed", 64, "auto", None),
        ("padded", 64, "auto", None),
        ("shared_prefix", 100_000, "auto", None),
        ("shared_prefix", 100_000, 30, 5),
    ],
)
def test_accumulated_gradient_equals_one_big_batch(loss_cfg, packing, budget, row_cap, chunk):
    trajs, adv = batch_and_advantages()
    cfg = LearnerConfig(
        micro_batch_tokens=budget,
        packing=packing,
        row_tokens=row_cap,
        head_chunk_tokens=chunk,
        grad_clip=1e9,
    )
    learner = Learner(tiny_llama(), cfg, loss_cfg, temperature=TEMPERATURE)
    grads = record_grads(learner)
    metrics = learner.train_step(rows(trajs, adv))
    assert metrics["micro_batches"] > (1 if budget < 1000 else 0)
    if row_cap != "auto":  # the cap split the groups (their whole units are longer)
        assert (
            metrics["row_tokens"]
            <= max(30, max(len(t.token_ids) for t in trajs))
            < max(b.input_ids_RS.shape[1] for b in make_micro_batches(rows(trajs, adv), budget))
        )
    expected = one_big_batch_grads(trajs, adv, loss_cfg)
    assert grads[0].keys() == expected.keys()
    for name, g in expected.items():
        torch.testing.assert_close(grads[0][name], g, atol=1e-6, rtol=1e-4, msg=name)
    if loss_cfg.loss == "ppo":  # the noise makes the token clip bind somewhere: not a trivial test
        assert metrics["clipfrac"] > 0


def test_scorable_filter_and_empty_step():
    trajs, adv = batch_and_advantages()
    learner = Learner(tiny_llama(), LearnerConfig(), LossConfig(), temperature=TEMPERATURE)
    assert rows(trajs, [math.nan] * len(trajs)) == []  # not trained on: no row at all
    assert learner.train_step([]) == {"loss": 0.0, "skipped": 1.0}
    assert learner.step == 0 and learner.scheduler.last_epoch == 0


def test_recomputed_old_logprobs_and_several_passes():
    trajs, adv = batch_and_advantages()
    learner = Learner(
        tiny_llama(),
        LearnerConfig(passes=3, old_logprobs="recompute", lr=1e-2),
        LossConfig(),
        temperature=TEMPERATURE,
    )
    m = learner.train_step(rows(trajs, adv))
    # pass 1: pi == pi_old exactly, so every ratio is 1 and nothing clips; later passes move away.
    assert m["pass1/ratio_mean"] == pytest.approx(1.0, abs=1e-6) and m["pass1/clipfrac"] == 0.0
    assert m["pass1/ratio_max"] == pytest.approx(1.0, abs=1e-5)
    assert m["pass3/ratio_max"] > 1.01 and m["pass3/ppo_kl"] != 0
    assert m["mismatch/k3_kl"] > 1e-3  # the rollout logprobs (noisy) vs the recomputed old ones
    assert learner.scheduler.last_epoch == 3 and learner.step == 1  # one optimizer step per pass


def test_logprobs_are_at_the_rollout_temperature():
    trajs = groups_of_trajectories()
    adv = [1.0] * len(trajs)
    own = sequence_logprobs(tiny_llama(), [list(t.token_ids) for t in trajs], TEMPERATURE)
    trajs = [  # on-policy rollout logprobs at T = 0.8
        dataclasses.replace(t, logprobs=[lp if m else 0.0 for lp, m in zip(lps, t.loss_mask)])
        for t, lps in zip(trajs, own, strict=True)
    ]
    m = Learner(tiny_llama(), LearnerConfig(), LossConfig(), temperature=TEMPERATURE).train_step(
        rows(trajs, adv)
    )
    assert m["logprob_gap_max"] < 1e-5 and m["ratio_max"] == pytest.approx(1.0, abs=1e-5)
    wrong = Learner(tiny_llama(), LearnerConfig(), LossConfig(), temperature=1.0).train_step(
        rows(trajs, adv)
    )
    assert wrong["logprob_gap_mean"] > 1e-2


def test_lr_schedule_warmup_then_cosine():
    cfg = LearnerConfig(lr=1.0, warmup_steps=2, lr_schedule="cosine", min_lr_ratio=0.1)
    learner = Learner(tiny_llama(), cfg, LossConfig(), total_steps=6)
    lrs = []
    for _ in range(6):
        lrs.append(learner.scheduler.get_last_lr()[0])
        learner.optimizer.step()
        learner.scheduler.step()
    # warm-up 1/2, 2/2; then cosine over 4 steps: 0.1 + 0.9 * 0.5 * (1 + cos(pi * k / 4)), k = 0..3
    expected = [0.5, 1.0] + [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(4)]
    assert lrs == pytest.approx(expected)
    with pytest.raises(ValueError, match="total_steps"):
        Learner(tiny_llama(), LearnerConfig(lr_schedule="linear"), LossConfig())


def test_tf32_is_set_for_the_step_only_and_refused_where_it_cannot_run():
    from agentgrpo.learner.logprobs import tf32_matmuls

    flags = torch.backends.cuda.matmul
    assert not flags.allow_tf32
    with pytest.raises(RuntimeError, match="inside"), tf32_matmuls(True):
        assert flags.allow_tf32
        raise RuntimeError("inside")
    assert not flags.allow_tf32  # restored after an error too
    with tf32_matmuls(False):
        assert not flags.allow_tf32
    assert not Learner(
        tiny_llama(), LearnerConfig(autocast="bf16"), LossConfig()
    ).tf32  # CUDA's mode
    with pytest.raises(ValueError, match="tf32=true: TF32 is a CUDA matmul mode.*runs on cpu"):
        Learner(tiny_llama(), LearnerConfig(tf32=True), LossConfig())


def test_reference_only_with_kl_frozen_and_equal_to_the_initial_policy():
    assert Learner(tiny_llama(), LearnerConfig(), LossConfig()).ref is None
    trajs, adv = batch_and_advantages()
    learner = Learner(
        tiny_llama(), LearnerConfig(lr=1e-2), LossConfig(kl_coef=0.5), temperature=TEMPERATURE
    )
    assert not learner.ref.training and not any(p.requires_grad for p in learner.ref.parameters())
    assert learner.train_step(rows(trajs, adv))["kl"] == pytest.approx(
        0.0, abs=1e-7
    )  # policy == reference
    assert (
        learner.train_step(rows(trajs, adv))["kl"] > 1e-6
    )  # the policy moved, the reference did not
    offloaded = Learner(tiny_llama(), LearnerConfig(ref_offload=True), LossConfig(kl_coef=0.5))
    offloaded.train_step(rows(trajs, adv))
    assert next(offloaded.ref.parameters()).device.type == "cpu"


def test_lora_reference_is_the_base_model_and_export_merges():
    from transformers import LlamaForCausalLM

    trajs, adv = batch_and_advantages()
    cfg = LearnerConfig(
        lr=5e-2, lora={"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "up_proj"]}
    )
    learner = Learner(tiny_llama(), cfg, LossConfig(kl_coef=0.1), temperature=TEMPERATURE)
    assert learner.ref is None  # no second copy: the reference is the adapter switched off
    trainable = {n for n, p in learner.unwrapped.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    m1 = learner.train_step(rows(trajs, adv))
    m2 = learner.train_step(rows(trajs, adv))
    assert m1["kl"] == pytest.approx(0.0, abs=1e-7) and m2["kl"] > 1e-7  # LoRA B starts at 0
    merged = learner.export_state_dict()
    base = tiny_llama()
    assert set(merged) == set(base.state_dict())
    plain = LlamaForCausalLM(base.config)
    plain.load_state_dict(merged)
    ids = [list(trajs[0].token_ids)]

    def lps(model):
        return sequence_logprobs(model, ids)[0]

    assert lps(plain) == pytest.approx(lps(learner.unwrapped), abs=1e-5)
    assert lps(plain) != pytest.approx(lps(base), abs=1e-4)  # the adapter did change the policy
    exported = learner.export_model()  # what WeightSync gets
    assert set(exported.state_dict()) == set(merged)
    with learner.unwrapped.disable_adapter():  # the base weights never moved
        assert lps(learner.unwrapped) == pytest.approx(lps(base), abs=1e-6)


def test_gradient_checkpointing_and_eager_attention_give_the_same_gradient():
    trajs, adv = batch_and_advantages()
    grads = []
    for cfg in (
        LearnerConfig(grad_clip=1e9),
        LearnerConfig(grad_clip=1e9, gradient_checkpointing=True),
        LearnerConfig(grad_clip=1e9, attn_implementation="eager"),
    ):
        learner = Learner(tiny_llama(), cfg, LossConfig(), temperature=TEMPERATURE)
        grads.append(record_grads(learner))
        learner.train_step(rows(trajs, adv))
    for other in grads[1:]:
        for name, g in grads[0][0].items():
            torch.testing.assert_close(other[0][name], g, atol=1e-6, rtol=1e-4)


def test_bf16_autocast_on_cpu_is_close_to_fp32():
    trajs, adv = batch_and_advantages()
    fp32 = Learner(tiny_llama(), LearnerConfig(), LossConfig(), temperature=TEMPERATURE)
    bf16 = Learner(
        tiny_llama(), LearnerConfig(autocast="bf16"), LossConfig(), temperature=TEMPERATURE
    )
    a, b = fp32.train_step(rows(trajs, adv)), bf16.train_step(rows(trajs, adv))
    assert a["logprob_gap_mean"] != b["logprob_gap_mean"]  # bf16 really ran
    assert abs(a["logprob_gap_mean"] - b["logprob_gap_mean"]) < 0.05
    assert next(bf16.unwrapped.parameters()).dtype == torch.float32  # master weights stay fp32


@pytest.mark.parametrize("fmt,mini_batches", [("full", 1), ("sharded", 1), ("full", 2)])
def test_save_load_continues_exactly(tmp_path, fmt, mini_batches):
    trajs, adv = batch_and_advantages()
    cfg = LearnerConfig(lr=1e-2, warmup_steps=3, checkpoint_format=fmt, mini_batches=mini_batches)
    straight = Learner(tiny_llama(), cfg, LossConfig(), temperature=TEMPERATURE)
    for _ in range(3):
        straight.train_step(rows(trajs, adv))
    first = Learner(tiny_llama(), cfg, LossConfig(), temperature=TEMPERATURE)
    first.train_step(rows(trajs, adv))
    first.save(tmp_path)
    resumed = Learner(tiny_llama(), cfg, LossConfig(), temperature=TEMPERATURE)
    resumed.load(tmp_path)
    assert resumed.step == 1 and resumed.scheduler.get_last_lr() == first.scheduler.get_last_lr()
    assert resumed.scheduler.last_epoch == mini_batches  # optimizer steps, not train steps
    for _ in range(2):
        resumed.train_step(rows(trajs, adv))
    for (n, p), q in zip(
        straight.unwrapped.named_parameters(), resumed.unwrapped.parameters(), strict=True
    ):
        torch.testing.assert_close(p, q, atol=0, rtol=0, msg=n)


# --- mini-batches: several optimizer steps per pass -----------------------------------------------


def _uneven_groups(seed=0):
    """Groups of random sizes and lengths, shuffled together (group ids, not positions, count)."""
    rng = random.Random(seed)
    trajs = []
    for g in range(rng.randint(1, 9)):
        for _ in range(rng.randint(1, 6)):
            n = rng.randint(3, 40)
            trajs.append(traj(list(range(n)), [0] * (n - 1) + [1], group=f"g{g}"))
    rng.shuffle(trajs)
    return trajs


@pytest.mark.parametrize("seed", range(20))
def test_mini_batches_keep_groups_whole_and_balance_tokens(seed):
    trajs = _uneven_groups(seed)
    groups = {t.group_id for t in trajs}
    tokens = {g: sum(len(t.token_ids) for t in trajs if t.group_id == g) for g in groups}
    for k in range(1, 6):
        parts = balanced_parts(trajs, k)
        assert len(parts) == min(k, len(groups))  # fewer groups than k: one group per mini-batch
        assert sorted(i for p in parts for i in p) == list(range(len(trajs)))  # each exactly once
        owner = {}
        for j, p in enumerate(parts):
            assert p
            for i in p:
                assert owner.setdefault(trajs[i].group_id, j) == j, "a group straddles mini-batches"
        load = [sum(len(trajs[i].token_ids) for i in p) for p in parts]
        # greedy largest-first: the lightest and heaviest differ by at most the largest group
        assert max(load) - min(load) <= max(tokens.values())
        assert balanced_parts(list(trajs), k) == parts  # a function of the list alone
    assert balanced_parts(trajs, 1) == [list(range(len(trajs)))]


LOSSES = [
    LossConfig(kl_coef=0.1),
    LossConfig(agg="seq-mean-token-mean", dual_clip=3.0),
    LossConfig(agg="seq-mean-token-sum-norm", max_response_len=24, loss="gspo", kl_coef=0.1),
]
LOSS_IDS = ["token-mean+kl", "seq-mean", "dr-grpo+gspo+kl"]


@pytest.mark.parametrize("loss_cfg", LOSSES, ids=LOSS_IDS)
@pytest.mark.parametrize("passes", [1, 2])
def test_mini_batches_equal_steps_on_the_parts(loss_cfg, passes):
    """With rollout old logprobs a step of 2 mini-batches is 2 steps of 1, on the two parts (each
    normalised by its own tokens / sequences), pass after pass: bit for bit."""
    trajs, adv = batch_and_advantages()
    parts = balanced_parts(trajs, 2)
    assert sorted(len(p) for p in parts) == [
        4,
        8,
    ]  # 3 groups of 4: unequal parts, unequal normalisers
    cfg = dict(lr=1e-2, warmup_steps=3, micro_batch_tokens=48, passes=passes, grad_clip=1e9)
    split = Learner(
        tiny_llama(), LearnerConfig(mini_batches=2, **cfg), loss_cfg, temperature=TEMPERATURE
    )
    grads = record_grads(split)
    m = split.train_step(rows(trajs, adv))
    # the first optimizer step's gradient is the plain one-batch gradient of the first part alone
    expected = one_big_batch_grads(
        [trajs[i] for i in parts[0]], [adv[i] for i in parts[0]], loss_cfg
    )
    for name, g in expected.items():
        torch.testing.assert_close(grads[0][name], g, atol=1e-6, rtol=1e-4, msg=name)
    steps = Learner(
        tiny_llama(), LearnerConfig(**{**cfg, "passes": 1}), loss_cfg, temperature=TEMPERATURE
    )
    ref = []
    for _ in range(passes):
        for part in parts:
            ref.append(steps.train_step(rows([trajs[i] for i in part], [adv[i] for i in part])))
    for (n, p), q in zip(
        steps.unwrapped.named_parameters(), split.unwrapped.parameters(), strict=True
    ):
        torch.testing.assert_close(q, p, atol=0, rtol=0, msg=n)
    assert (
        split.scheduler.last_epoch == steps.scheduler.last_epoch == 2 * passes and split.step == 1
    )
    assert m["optimizer_steps"] == len(grads) == 2 * passes and m["grad_norm"] > 0
    assert m["mb1/loss"] == pytest.approx(sum(r["loss"] for r in ref[0::2]) / passes, abs=1e-7)
    assert m["mb2/loss"] == pytest.approx(sum(r["loss"] for r in ref[1::2]) / passes, abs=1e-7)
    assert m["lr"] == pytest.approx(sum(r["lr"] for r in ref) / len(ref))


@pytest.mark.parametrize("loss_cfg", LOSSES, ids=LOSS_IDS)
def test_mini_batches_with_zero_lr_log_the_metrics_of_one(loss_cfg):
    """lr = 0: every mini-batch sees the same policy, so the step's metrics (loss pooled with each
    mini-batch's share of the batch's normaliser; token-weighted means; extremes) are those of one
    optimizer step over the whole batch."""
    trajs, adv = batch_and_advantages()
    out = []
    for k in (1, 3):
        learner = Learner(
            tiny_llama(),
            LearnerConfig(mini_batches=k, passes=2, micro_batch_tokens=48),
            loss_cfg,
            temperature=TEMPERATURE,
        )
        learner.scheduler.base_lrs = [0.0]
        learner.optimizer.param_groups[0]["lr"] = 0.0
        out.append(learner.train_step(rows(trajs, adv)))
    one, three = out
    assert one["optimizer_steps"] == 2 and three["optimizer_steps"] == 6
    keys = [
        "loss",
        "pg_loss",
        "loss_tokens",
        "clipfrac",
        "ppo_kl",
        "ratio_mean",
        "ratio_min",
        "ratio_max",
        "entropy",
        "pass2/loss",
        "pass2/clipfrac",
    ]
    keys += ["kl", "kl_loss"] if loss_cfg.kl_coef else []
    assert abs(one["pg_loss"]) > 1e-3 and (
        one["clipfrac"] > 0 or loss_cfg.loss == "gspo"
    )  # not trivial
    for k in keys:
        assert three[k] == pytest.approx(one[k], rel=1e-5, abs=1e-7), k
    assert {f"mb{j}/ratio_mean" for j in (1, 2, 3)} <= set(three) and "mb1/loss" not in one
    # each mini-batch's own loss is normalised by its own tokens / sequences, not the batch's
    assert sum(three[f"mb{j}/loss"] for j in (1, 2, 3)) != pytest.approx(one["loss"], rel=1e-3)


def test_old_logprobs_recomputed_once_before_the_first_mini_batch():
    trajs, adv = batch_and_advantages()
    learner = Learner(
        tiny_llama(),
        LearnerConfig(mini_batches=3, old_logprobs="recompute", lr=1e-2),
        LossConfig(),
        temperature=TEMPERATURE,
    )
    m = learner.train_step(rows(trajs, adv))
    # mini-batch 1 runs on the policy that was scored: ratio 1; mini-batch 3 after two updates.
    assert m["mb1/ratio_mean"] == pytest.approx(1.0, abs=1e-6) and m["mb1/clipfrac"] == 0.0
    assert m["mb3/ratio_max"] > 1.01 and m["mb3/ppo_kl"] != 0
    # the rollout/learner gap is measured before any update: the first mini-batch's tokens
    gap_only_first = Learner(
        tiny_llama(), LearnerConfig(lr=1e-2), LossConfig(), temperature=TEMPERATURE
    )
    part = balanced_parts(trajs, 3)[0]
    alone = gap_only_first.train_step(rows([trajs[i] for i in part], [adv[i] for i in part]))
    assert m["logprob_gap_max"] == pytest.approx(alone["logprob_gap_max"])
    assert m["logprob_gap_mean"] == pytest.approx(alone["logprob_gap_mean"])


def test_lr_schedule_advances_passes_times_mini_batches():
    trajs, adv = batch_and_advantages()
    cfg = LearnerConfig(lr=1.0, lr_schedule="linear", passes=2, mini_batches=3)
    learner = Learner(tiny_llama(), cfg, LossConfig(), temperature=TEMPERATURE, total_steps=2)
    m = learner.train_step(rows(trajs, adv))
    # 2 train steps x 2 passes x 3 mini-batches = 12 optimizer steps of linear decay: lr_i = 1 -
    # i/12
    assert learner.scheduler.last_epoch == 6 and learner.scheduler.get_last_lr()[
        0
    ] == pytest.approx(0.5)
    assert m["optimizer_steps"] == 6 and m["lr"] == pytest.approx(
        sum(1 - i / 12 for i in range(6)) / 6
    )
    learner.train_step(rows(trajs, adv))
    assert learner.scheduler.last_epoch == 12 and learner.scheduler.get_last_lr()[
        0
    ] == pytest.approx(0.0)
    # one group: one mini-batch (never an optimizer step on nothing)
    few = Learner(tiny_llama(), cfg, LossConfig(), temperature=TEMPERATURE, total_steps=2)
    assert (
        few.train_step(rows(trajs[:4], adv[:4]))["optimizer_steps"] == 2
        and few.scheduler.last_epoch == 2
    )


# --- 2 processes (gloo) == 1 process --------------------------------------------------------------


def assert_trained_alike(a: dict, b: dict, before: dict, what: str) -> None:
    """`a` and `b` trained from `before` alike: each tensor within 0.1% of how far it moved (+1e-6).

    For runs that sum gradients in another order (other ranks, FSDP's re-tied embeddings): Adam
    divides by sqrt(v) + eps, so a weight whose gradient is ~0 turns a last-bit difference into a
    visible one (measured up to 9.5e-6 on weights that moved 1.5e-2, a norm ratio of ~4e-6; which
    tensor shows it, if any, depends on the CPU's kernels). Element-wise tolerances fail on that
    noise; compare the gradients themselves for exactness."""
    assert set(a) == set(b), what
    for name, t in b.items():
        moved, apart = float((t - before[name]).norm()), float((a[name] - t).norm())
        assert moved > 0 and apart <= 1e-3 * moved + 1e-6, (what, name, moved, apart)


def _steps(learner):
    """Three steps: a normal one, one with unequal micro-batch counts per rank, and one with a
    single trajectory, where one rank has no data and runs an empty micro-batch. The rollouts exist
    on rank 0 only and are broadcast, as in the loop. Returns the gradients each optimizer step
    applied (Adam hides gradient scale, so weights alone would be a weak check)."""
    grads = record_grads(learner)
    first = second = None
    if learner.is_main:
        first, second = batch_and_advantages(seed=0), batch_and_advantages(seed=1)
    (trajs, adv), (trajs2, adv2) = learner.broadcast((first, second))
    learner.train_step(rows(trajs, adv))
    learner.train_step(rows(trajs2[:7], adv2[:7]))
    return grads, learner.train_step(rows(trajs2[:1], [1.0]))


def _make(accelerator=None, mini_batches=1):
    cfg = LearnerConfig(lr=1e-2, micro_batch_tokens=64, grad_clip=1e9, mini_batches=mini_batches)
    return Learner(
        tiny_llama(), cfg, LossConfig(kl_coef=0.1), temperature=TEMPERATURE, accelerator=accelerator
    )


def _worker(rank: int, out: str, mini_batches: int) -> None:
    from accelerate import Accelerator

    learner = _make(Accelerator(cpu=True), mini_batches)
    grads, metrics = _steps(learner)
    if rank == 0:
        torch.save(
            {"weights": learner.unwrapped.state_dict(), "grads": grads, "metrics": metrics}, out
        )
    learner.close()  # both ranks leave together; spawn_gloo then skips the interpreter's teardown


@pytest.mark.parametrize("mini_batches", [1, 2])
def test_two_gloo_processes_equal_one_process(tmp_path, mini_batches):
    """With 2 mini-batches: step 1 splits 3 groups 2 + 1, step 2 (7 trajectories) 1 + 1, each group
    then dealt to the 2 ranks by trajectory; step 3 has one trajectory, so one mini-batch."""
    out = tmp_path / "two.pt"
    spawn_gloo(_worker, str(out), mini_batches)
    two = torch.load(out, weights_only=True)
    one = _make(mini_batches=mini_batches)
    start = {k: v.clone() for k, v in one.unwrapped.state_dict().items()}
    grads, metrics = _steps(one)
    assert len(two["grads"]) == len(grads) == (3 if mini_batches == 1 else 5)
    # The ranks pack other micro-batches than one process does, so sums run in another order
    # (segment attention's padded buckets depend on a span's companions): the first step's gradients
    # agree to ~4e-9, and two AdamW steps at lr 1e-2 grow that to ~4e-6 in single elements. A
    # sharding or normalisation error is orders of magnitude larger.
    for step, (g2, g1) in enumerate(zip(two["grads"], grads, strict=True)):
        for name, g in g1.items():
            torch.testing.assert_close(
                g2[name], g, atol=1e-6 if step == 0 else 2e-5, rtol=1e-4, msg=f"step {step}: {name}"
            )
    assert_trained_alike(two["weights"], one.unwrapped.state_dict(), start, "2 gloo ranks")
    for k in ("loss", "kl", "loss_tokens", "clipfrac", "grad_norm"):
        assert two["metrics"][k] == pytest.approx(metrics[k], rel=1e-4, abs=1e-7), k


# --- per-turn advantages (turn-level estimators) -------------------------------------------------


def with_turn_advantages(trajs):
    """One advantage per sampled turn (its runs of loss_mask == 1) of each trajectory, distinct
    across turns and rows, and its per-token [T] advantages for the reference."""
    per_turn, per_token = [], []
    for i, t in enumerate(trajs):
        n = t.segments[0].num_turns
        per_turn.append([((i * 3 + k * 5) % 7 - 3) / 2 for k in range(n)])
        per_token.append(list(token_advantages(t.loss_mask, per_turn[-1])))
    return per_turn, per_token


@pytest.mark.parametrize("packing,budget", [("shared_prefix", 48), ("padded", 64)])
def test_turn_advantages_reach_each_turn_s_tokens(packing, budget):
    # the reference weighs each token of the padded batch by its turn's advantage ([B, T])
    trajs, _ = batch_and_advantages()
    per_turn, per_token = with_turn_advantages(trajs)
    assert any(len(set(turns)) > 1 for turns in per_turn)  # turns of a row really differ
    outcome = [0.0] * len(trajs)  # the scalar is not what the loss reads for these rows
    cfg = LearnerConfig(micro_batch_tokens=budget, packing=packing, grad_clip=1e9)
    learner = Learner(tiny_llama(), cfg, LossConfig(), temperature=TEMPERATURE)
    grads = record_grads(learner)
    learner.train_step(rows(trajs, outcome, per_turn))
    T = max(len(t.token_ids) for t in trajs)
    adv_BT = torch.tensor([p + [0.0] * (T - len(p)) for p in per_token])
    expected = one_big_batch_grads(trajs, adv_BT, LossConfig())
    for name, g in expected.items():
        torch.testing.assert_close(grads[0][name], g, atol=1e-6, rtol=1e-4, msg=name)


def test_outcome_only_rows_train_on_the_per_trajectory_path_bit_for_bit():
    # No per-turn advantages (every outcome-only estimator): the micro-batches carry no per-token
    # advantages and the loss reads advantages_B, as before turn-level estimators existed. Rows
    # whose turn advantages all equal their scalar advantage give exactly the same gradient.
    trajs, adv = batch_and_advantages()
    (mb,) = make_micro_batches(rows(trajs, adv), 100_000)
    assert mb.token_advantages_BT is None and mb.loss_advantages is mb.advantages_B
    grads = []
    for per_turn in (False, True):
        fresh, _ = batch_and_advantages()
        turns = [[a] * t.segments[0].num_turns for t, a in zip(fresh, adv, strict=True)]
        learner = Learner(
            tiny_llama(), LearnerConfig(grad_clip=1e9), LossConfig(), temperature=TEMPERATURE
        )
        grads.append(record_grads(learner))
        learner.train_step(rows(fresh, adv, turns if per_turn else None))
    for name, g in grads[0][0].items():
        assert torch.equal(g, grads[1][0][name]), name
