"""On a CUDA GPU (skipped without one; `bash scripts/gpu-check.sh` runs these and the GPU
benchmark): packed layouts give the per-sequence logprobs with CUDA's attention kernels (flex
attention's block masks too, whose gradient equals the 4D mask's), the learner's accumulated
gradient on the GPU equals the plain CPU computation, and bf16 autocast (the GPU default) stays
close to fp32 and reports the step's peak memory."""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch

from agentgrpo.attention import use_segments
from agentgrpo.batch import make_micro_batches
from agentgrpo.learner import Learner, LearnerConfig
from agentgrpo.logprobs import sequence_logprobs, tf32_matmuls
from agentgrpo.loss import LossConfig
from tests.test_batch import assert_per_sequence, packed_logprobs
from tests.test_learner import TEMPERATURE, batch_and_advantages, one_big_batch_grads, record_grads
from tests.tiny import groups_of_trajectories, tiny_llama

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


# flex's CUDA kernels need a head dimension of 16 or more (tiny_llama's is 8)
flex_sized = partial(tiny_llama, head_dim=16)


@pytest.mark.parametrize("attention", ["mask", "segments", "flex"])
@pytest.mark.parametrize("mode", ["padded", "packed", "shared_prefix"])
def test_packed_logprobs_on_cuda_equal_per_sequence_logprobs_on_cpu(mode, attention):
    make = flex_sized if attention == "flex" else tiny_llama
    trajs = groups_of_trajectories()
    ref = sequence_logprobs(make("sdpa"), [t.token_ids for t in trajs], temperature=0.7)  # CPU
    batches = [b.to(CUDA) for b in make_micro_batches(trajs, [0.0] * len(trajs), 64, mode=mode)]
    model = make("flex_attention" if attention == "flex" else "sdpa").to(CUDA)  # flex: block masks
    if attention == "segments":  # agentgrpo.attention's gathers and padded sdpa batch on CUDA
        use_segments(model)
    assert_per_sequence(packed_logprobs(model, batches, 0.7), trajs, ref, 1e-4)


def test_accumulated_gradient_on_cuda_equals_the_plain_cpu_computation():
    trajs, adv = batch_and_advantages()
    loss_cfg = LossConfig(kl_coef=0.1)
    cfg = LearnerConfig(micro_batch_tokens=48, grad_clip=1e9, autocast="none")
    learner = Learner(tiny_llama(), cfg, loss_cfg, temperature=TEMPERATURE)
    assert learner.accelerator.device.type == "cuda"
    grads = record_grads(learner)
    learner.train_step(trajs, adv)
    want = one_big_batch_grads(trajs, adv, loss_cfg)
    for name, g in want.items():
        torch.testing.assert_close(grads[0][name].cpu(), g, atol=1e-5, rtol=1e-3, msg=name)


def test_flex_attention_on_cuda_trains_with_the_4d_masks_gradient():
    trajs, adv = batch_and_advantages(model=flex_sized())
    grads = {}
    for impl in ("sdpa", "flex_attention"):  # block mask against the 4D mask, both on CUDA
        cfg = LearnerConfig(
            micro_batch_tokens=48, grad_clip=1e9, autocast="none", attn_implementation=impl
        )
        learner = Learner(flex_sized(), cfg, LossConfig(kl_coef=0.1), temperature=TEMPERATURE)
        grads[impl] = record_grads(learner)
        learner.train_step(trajs, adv)
    for name, g in grads["sdpa"][0].items():
        torch.testing.assert_close(
            grads["flex_attention"][0][name], g, atol=1e-5, rtol=1e-3, msg=name
        )


def test_bf16_autocast_is_the_cuda_default_close_to_fp32_and_reports_peak_memory():
    trajs, adv = batch_and_advantages()
    fp32 = Learner(
        tiny_llama(), LearnerConfig(autocast="none"), LossConfig(), temperature=TEMPERATURE
    )
    bf16 = Learner(
        tiny_llama(), LearnerConfig(), LossConfig(), temperature=TEMPERATURE
    )  # auto -> bf16
    a, b = fp32.train_step(trajs, adv), bf16.train_step(trajs, adv)
    assert a["logprob_gap_mean"] != b["logprob_gap_mean"]  # bf16 really ran
    assert abs(a["logprob_gap_mean"] - b["logprob_gap_mean"]) < 0.05
    assert math.isfinite(b["loss"]) and b["mem/peak_gb"] > 0
    assert next(bf16.unwrapped.parameters()).dtype == torch.float32  # master weights stay fp32


def test_tf32_head_is_the_bf16_default_and_close_to_the_fp32_head():
    """Under bf16 autocast the head's fp32 matmuls run on TF32 (its bf16 input is exact there): the
    logprobs stay within 1e-3 of the fp32 head's, and the flag is back as it was after the step."""
    trajs, adv = batch_and_advantages()
    on = Learner(tiny_llama(), LearnerConfig(), LossConfig(), temperature=TEMPERATURE)
    off = Learner(tiny_llama(), LearnerConfig(tf32=False), LossConfig(), temperature=TEMPERATURE)
    assert on.tf32 and not off.tf32
    assert not Learner(tiny_llama(), LearnerConfig(autocast="none"), LossConfig()).tf32
    batch = make_micro_batches(trajs, adv, 4096, mode="packed")[0].to(CUDA)
    with torch.no_grad():
        with tf32_matmuls(True):
            a = on.model(batch, TEMPERATURE)[0]
        b = off.model(batch, TEMPERATURE)[0]
    assert not torch.equal(a, b)  # TF32 really ran
    torch.testing.assert_close(a, b, atol=1e-3, rtol=0)
    assert math.isfinite(on.train_step(trajs, adv)["loss"])
    assert not torch.backends.cuda.matmul.allow_tf32
