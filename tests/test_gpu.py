"""On a CUDA GPU (skipped without one; `bash scripts/gpu-check.sh` runs these and the GPU
benchmark): packed layouts give the per-sequence logprobs with CUDA's attention kernels (flex
attention's block masks too, whose gradient equals the 4D mask's), varlen attention (torch's
variable-length flash kernel, `learner.attention: auto` on CUDA) gives the masked kernel's logprobs
and gradients within bf16 rounding, the learner's accumulated gradient on the GPU equals the plain
CPU computation, and bf16 autocast (the GPU default) stays close to fp32 and reports the step's
peak memory."""

from __future__ import annotations

import math
import random
from functools import partial

import pytest
import torch

from agentgrpo.algo.loss import LossConfig
from agentgrpo.learner import attention
from agentgrpo.learner.attention import use_segments, use_varlen
from agentgrpo.learner.batch import make_micro_batches
from agentgrpo.learner.learner import Learner, LearnerConfig
from agentgrpo.learner.logprobs import PolicyForward, sequence_logprobs, tf32_matmuls
from tests.test_batch import assert_per_sequence, packed_logprobs
from tests.test_learner import TEMPERATURE, batch_and_advantages, one_big_batch_grads, record_grads
from tests.tiny import V, groups_of_trajectories, rows, tiny_llama, traj
from tests.varlen_reference import reference_varlen_attn

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
    batches = [
        b.to(CUDA) for b in make_micro_batches(rows(trajs, [0.0] * len(trajs)), 64, mode=mode)
    ]
    model = make("flex_attention" if attention == "flex" else "sdpa").to(CUDA)  # flex: block masks
    if (
        attention == "segments"
    ):  # agentgrpo.learner.attention's gathers and padded sdpa batch on CUDA
        use_segments(model)
    assert_per_sequence(packed_logprobs(model, batches, 0.7), trajs, ref, 1e-4)


def test_accumulated_gradient_on_cuda_equals_the_plain_cpu_computation():
    trajs, adv = batch_and_advantages()
    loss_cfg = LossConfig(kl_coef=0.1)
    cfg = LearnerConfig(micro_batch_tokens=48, grad_clip=1e9, autocast="none")
    learner = Learner(tiny_llama(), cfg, loss_cfg, temperature=TEMPERATURE)
    assert learner.accelerator.device.type == "cuda"
    grads = record_grads(learner)
    learner.train_step(rows(trajs, adv))
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
        learner.train_step(rows(trajs, adv))
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
    a, b = fp32.train_step(rows(trajs, adv)), bf16.train_step(rows(trajs, adv))
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
    batch = make_micro_batches(rows(trajs, adv), 4096, mode="packed")[0].to(CUDA)
    with torch.no_grad():
        with tf32_matmuls(True):
            a = on.model(batch, TEMPERATURE)[0]
        b = off.model(batch, TEMPERATURE)[0]
    assert not torch.equal(a, b)  # TF32 really ran
    torch.testing.assert_close(a, b, atol=1e-3, rtol=0)
    assert math.isfinite(on.train_step(rows(trajs, adv))["loss"])
    assert not torch.backends.cuda.matmul.allow_tf32


needs_varlen = pytest.mark.skipif(
    attention.VARLEN_KERNEL is None, reason="torch < 2.10 has no torch.nn.attention.varlen"
)
varlen_sized = partial(tiny_llama, head_dim=32)  # a head dim flash attention runs natively


def _spread_groups(seed=0) -> list:
    """GRPO groups of 4 sharing a prompt, whole lengths 20..480 (several flash blocks of 128)."""
    rng = random.Random(seed)
    out = []
    for g in range(6):
        prompt = [rng.randrange(V) for _ in range(rng.randint(5, 120))]
        for _ in range(4):
            own = [rng.randrange(V) for _ in range(rng.randint(10, 360))]
            out.append(traj(prompt + own, [0] * len(prompt) + [1] * len(own), group=f"g{g}"))
    return out


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


@needs_varlen
def test_torch_varlen_attn_keeps_the_references_contract_on_cuda():
    # runs of 1..300 queries, with 0..100 more keys than queries (a shared prompt's), GQA 4:2;
    # forward and gradients against the per-sequence sdpa reference on the same bf16 inputs.
    g = torch.Generator().manual_seed(0)
    lq = torch.randint(1, 300, (9,), generator=g)
    lk = lq + torch.randint(0, 100, (9,), generator=g)
    cu_q, cu_k = (torch.cat([torch.zeros(1), x.cumsum(0)]).int().to(CUDA) for x in (lq, lk))
    q = torch.randn(int(lq.sum()), 4, 32, generator=g).to(CUDA, torch.bfloat16)
    k, v = (torch.randn(int(lk.sum()), 2, 32, generator=g).to(CUDA, torch.bfloat16) for _ in "kv")
    outs, grads = [], []
    scale = 32**-0.5  # (torch 2.10 takes no scale: its default)
    run_torchs = partial(attention.causal_varlen, scale=scale)  # as varlen_attention calls it
    run_reference = partial(
        reference_varlen_attn, scale=scale, window_size=(-1, 0), enable_gqa=True
    )
    for kernel in (run_torchs, run_reference):
        qkv = [x.clone().requires_grad_() for x in (q, k, v)]
        out = kernel(*qkv, cu_q, cu_k, int(lq.max()), int(lk.max()))
        out.float().pow(2).sum().backward()
        outs.append(out)
        grads.append([x.grad for x in qkv])
    assert _rel_err(outs[0], outs[1]) < 1e-2
    for got, want in zip(*grads, strict=True):
        assert _rel_err(got, want) < 2e-2


@needs_varlen
@pytest.mark.parametrize("mode", ["packed", "shared_prefix"])
def test_varlen_logprobs_and_gradients_equal_the_masked_kernels_on_cuda(mode):
    trajs = _spread_groups()
    batches = make_micro_batches(rows(trajs, [0.0] * len(trajs)), 4096, mode=mode)
    assert len(batches) > 1 and any(mb.input_ids_RS.shape[0] > 1 for mb in batches)
    results = {}
    for path in ("mask", "varlen"):
        model = varlen_sized().to(CUDA).train()
        if path == "varlen":
            use_varlen(model)
        forward = PolicyForward(model, autocast_bf16=True)
        lps = []
        for mb in batches:
            lp, ent = forward(mb.to(CUDA), 0.7, entropy_grad=True)
            (lp.sum() + 0.1 * ent.sum()).backward()
            lps.append(lp.detach())
        results[path] = torch.cat(lps), {n: p.grad for n, p in model.named_parameters()}
    (lp_m, g_m), (lp_v, g_v) = results["mask"], results["varlen"]
    # bf16 hidden states: logprobs within 0.05 nats (measured on the CPU reference: ~1e-2)
    torch.testing.assert_close(lp_v, lp_m, atol=0.05, rtol=0)
    for name, g in g_m.items():
        assert _rel_err(g_v[name], g) < 3e-2, name


@needs_varlen
def test_auto_trains_with_varlen_on_cuda_as_with_the_mask():
    trajs = _spread_groups(seed=1)
    adv = [((i * 7) % 5 - 2) / 2 for i in range(len(trajs))]
    learners, metrics, grads = {}, {}, {}
    for setting in ("auto", "mask"):
        cfg = LearnerConfig(micro_batch_tokens=2048, grad_clip=1e9, attention=setting)
        learners[setting] = Learner(varlen_sized(), cfg, LossConfig(kl_coef=0.1), temperature=0.7)
        grads[setting] = record_grads(learners[setting])
        metrics[setting] = learners[setting].train_step(rows(trajs, adv))
    assert learners["auto"].attention.path == "varlen", learners["auto"].attention
    assert learners["auto"].packing == "shared_prefix" and learners["auto"].pair_cost == 0
    for key in ("loss", "grad_norm", "logprob_gap_mean"):
        assert metrics["auto"][key] == pytest.approx(metrics["mask"][key], rel=3e-2, abs=1e-2), key
    for name, g in grads["mask"][0].items():
        assert _rel_err(grads["auto"][0][name], g) < 3e-2, name


async def test_the_local_engine_decodes_on_cuda_and_takes_weights_from_either_device():
    """`engine.device` (auto: the learner's, so CUDA in a GPU run): batched sampling with the
    prefix cache on the GPU gives the logprobs of a fresh fp32 forward on the CPU, and weight
    updates land whether the state dict lives on the CPU or the GPU."""
    from agentgrpo.engine import LocalEngine, SamplingParams
    from tests.test_local_engine import fresh_logprobs, tiny_model

    cpu_model, other = tiny_model(0), tiny_model(1)
    prompts = [[5], list(range(10, 40)), [9] * 12, list(range(10, 40))]  # one shared prompt
    with LocalEngine(tiny_model(0), device="cuda", seed=0, eos_token_ids=()) as eng:
        assert next(eng.model.parameters()).device.type == "cuda"
        for state, model in [
            (None, cpu_model),
            ({k: v.to(CUDA) for k, v in other.state_dict().items()}, other),
            (cpu_model.state_dict(), cpu_model),
        ]:
            if state is not None:
                await eng.update_weights(state, version=str(id(state)))
            outs = [
                await eng.generate(p, SamplingParams(max_new_tokens=16, seed=i))
                for i, p in enumerate(prompts)
            ]
            for prompt, out in zip(prompts, outs, strict=True):
                assert len(out.token_ids) == 16
                expected = fresh_logprobs(model, prompt, out.token_ids, 1.0)
                assert torch.allclose(torch.tensor(out.logprobs), expected, atol=1e-3, rtol=0)
            scored = await eng.score(prompts[0], outs[0].token_ids)
            assert torch.allclose(torch.tensor(scored), torch.tensor(outs[0].logprobs), atol=1e-3)
        assert eng.stats["cached_tokens"] > 0  # the repeated prompt came from the prefix cache
