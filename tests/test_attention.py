"""Segment and varlen attention: the same logprobs and gradients as the masked kernel, a correct
fallback for every other use of the switched model, and loud failures where they cannot apply; and
how `learner.attention` chooses among them. varlen's kernel is CUDA-only: here a per-sequence sdpa
reference of its call contract (tests/varlen_reference.py) stands in for it, so these tests check
the wiring; tests/test_gpu.py checks the kernel itself."""

from __future__ import annotations

import functools
import re

import pytest
import torch

from agentgrpo.algo.loss import LossConfig
from agentgrpo.learner import attention as attention_module
from agentgrpo.learner import learner as learner_module
from agentgrpo.learner.attention import (
    SEGMENTS,
    VARLEN,
    Segments,
    Varlen,
    choose_attention,
    register,
    segment_attention,
    use_segments,
    use_varlen,
    varlen_attention,
)
from agentgrpo.learner.batch import make_micro_batches
from agentgrpo.learner.learner import Learner, LearnerConfig
from agentgrpo.learner.logprobs import PolicyForward
from tests.tiny import groups_of_trajectories, rows, tiny_llama, traj
from tests.varlen_reference import reference_varlen_attn, top_left_varlen_attn


def _forward_backward(model, mb, bf16=False):
    lp, ent = PolicyForward(model, autocast_bf16=bf16)(mb, 0.7, entropy_grad=True)
    (lp.sum() + 0.1 * ent.sum()).backward()
    return lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode", ["shared_prefix", "packed"])
def test_segments_give_the_masked_kernels_logprobs_and_gradients(mode):
    trajs = groups_of_trajectories(n_groups=4, size=4, seed=2)
    batches = make_micro_batches(rows(trajs, [0.0] * len(trajs)), 300, mode=mode)
    tails = [int((mb.segment_ids_RS == 0).sum()) for mb in batches]
    assert (
        any(mb.input_ids_RS.shape[0] > 1 for mb in batches) and sum(tails) > 0
    )  # rows and row tails
    for mb in batches:
        masked = _forward_backward(tiny_llama("sdpa"), mb)
        seg_model = tiny_llama("sdpa")
        use_segments(seg_model)
        seg = _forward_backward(seg_model, mb)
        torch.testing.assert_close(seg[0], masked[0], atol=1e-5, rtol=0)
        for name, g in masked[1].items():
            torch.testing.assert_close(seg[1][name], g, atol=1e-5, rtol=1e-4, msg=name)


def test_segments_under_bf16_autocast_agree_with_the_mask_to_bf16_rounding():
    trajs = groups_of_trajectories(n_groups=2, size=4, seed=3)
    (mb,) = make_micro_batches(rows(trajs, [0.0] * len(trajs)), 4096)
    masked = _forward_backward(tiny_llama("sdpa"), mb, bf16=True)
    seg_model = tiny_llama("sdpa")
    use_segments(seg_model)
    seg = _forward_backward(seg_model, mb, bf16=True)
    torch.testing.assert_close(seg[0], masked[0], atol=0.05, rtol=0)
    for name, g in masked[1].items():
        torch.testing.assert_close(seg[1][name], g, atol=0.05, rtol=0.05, msg=name)


def test_spans_of_a_shared_prefix_row():
    a = traj([1, 2, 3, 4, 5], [0, 0, 1, 1, 1], group="x")
    b = traj([1, 2, 3, 6], [0, 0, 0, 1], group="x")
    c = traj([7, 8], [0, 1], group="y")
    batches = make_micro_batches(rows([a, b, c], [0.0] * 3), 64, mode="shared_prefix")
    (mb,) = batches  # row 0 = 1 2 3 | 6 | 4 5 ; row 1 = 7 8 + tail
    seg = Segments.of(mb)
    assert seg.spans == [(0, 0, 3, 0, 0), (0, 3, 4, 0, 3), (0, 4, 6, 0, 3), (1, 0, 2, 0, 0)]
    T = mb.input_ids_RS.shape[1]
    assert sorted(seg.dest.tolist()) == [
        0,
        1,
        2,
        3,
        4,
        5,
        T,
        T + 1,
    ]  # every real token once, no tail
    # The span of a's own 4 5 (row positions 4, 5) against keys [1 2 3 | 4 5]: the prefix, then
    # causal.
    ((bk, j),) = [
        (bk, j) for bk in seg.buckets for j, q in enumerate(bk.q_idx.tolist()) if q[:2] == [4, 5]
    ]
    assert bk.k_idx[j].tolist()[:5] == [0, 1, 2, 4, 5]
    assert bk.mask[j, 0, :2, :5].int().tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert not bk.mask[j, 0, :2, 5:].any()  # key padding is never seen


def test_the_switched_model_stays_correct_without_segments():
    # A left-padded batch with a 2D mask (how an engine or a probe would run the model): the
    # fallback must apply the padding mask exactly as sdpa does.
    ids = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]])
    attn = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    plain, switched = tiny_llama("sdpa"), tiny_llama("sdpa")
    use_segments(switched)
    assert switched.config._attn_implementation == SEGMENTS
    with torch.no_grad():
        want = plain(input_ids=ids, attention_mask=attn).logits
        got = switched(input_ids=ids, attention_mask=attn).logits
    torch.testing.assert_close(got[attn.bool()], want[attn.bool()], atol=1e-6, rtol=0)


def _layout_dropped_before_attention(switch, key: str, kernel, layout: str, match: str) -> None:
    """A decoder that loses the layout kwarg on its way to `kernel` (registered under `key` for
    the test): the forward raises `match`; registered again, it runs."""
    from transformers import AttentionInterface

    def drops_the_layout(module, q, k, v, mask, **kw):
        kw.pop(layout, None)
        return kernel(module, q, k, v, mask, **kw)

    trajs = groups_of_trajectories()
    (mb,) = make_micro_batches(rows(trajs, [0.0] * len(trajs)), 4096)
    model = tiny_llama("sdpa")
    switch(model)
    AttentionInterface.register(key, drops_the_layout)
    try:
        with pytest.raises(RuntimeError, match=match):
            PolicyForward(model)(mb, 1.0)
    finally:
        register()
    PolicyForward(model)(mb, 1.0)  # registered again: runs


def test_a_layout_that_never_reaches_attention_raises():
    _layout_dropped_before_attention(
        use_segments, SEGMENTS, segment_attention, "segments", "ran in 0 of 2 layers"
    )


def test_features_it_does_not_implement_are_named():
    (mb,) = make_micro_batches(
        rows([traj([1, 2, 3], [0, 1, 1]), traj([4, 5, 6], [0, 1, 1], group="h")], [0.0, 0.0]),
        64,
        mode="packed",
    )
    seg = Segments.of(mb)
    q = torch.zeros(2, 4, 3, 8)
    kv = torch.zeros(2, 2, 3, 8)
    with pytest.raises(ValueError, match="sliding_window"):
        segment_attention(torch.nn.Module(), q, kv, kv, None, segments=seg, sliding_window=4096)
    out, _ = segment_attention(
        torch.nn.Module(), q, kv, kv, None, segments=seg, sliding_window=None
    )
    assert out.shape == (2, 3, 4, 8)


def test_a_model_that_cannot_switch_is_refused():
    class Stubborn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = type("C", (), {"_attn_implementation": "sdpa"})()

        def set_attn_implementation(self, name):  # transformers warns and keeps the old one
            pass

    with pytest.raises(ValueError, match="AttentionInterface"):
        use_segments(Stubborn())


def test_the_learner_picks_segments_on_the_cpu_and_trains_the_same_as_the_mask():
    trajs = groups_of_trajectories(n_groups=3, size=4, seed=5)
    adv = [float(t.reward) - 0.5 for t in trajs]
    weights, learners, metrics = {}, {}, {}
    for attention in ("auto", "mask"):
        learner = Learner(
            tiny_llama("sdpa"),
            LearnerConfig(lr=1e-3, micro_batch_tokens=200, attention=attention),
            LossConfig(kl_coef=0.05),
            temperature=0.7,
        )
        metrics[attention] = learner.train_step(rows(trajs, adv))
        learners[attention] = learner
        weights[attention] = {
            n: p.detach().clone() for n, p in learner.unwrapped.named_parameters()
        }
    assert learners["auto"].unwrapped.config._attn_implementation == SEGMENTS
    assert (
        learners["auto"].ref.model.config._attn_implementation == SEGMENTS
    )  # the KL reference too
    assert learners["auto"].pair_cost == 0 and learners["mask"].pair_cost > 0
    assert learners["mask"].unwrapped.config._attn_implementation == "sdpa"
    for key in ("loss", "grad_norm", "kl", "logprob_gap_mean"):
        assert metrics["auto"][key] == pytest.approx(metrics["mask"][key], rel=1e-5, abs=1e-7), key
    # AdamW's first step is ~lr * sign(g): float noise on a ~0 gradient moves a weight by up to 2e-6
    # here, a real difference by ~lr = 1e-3.
    for name, w in weights["mask"].items():
        torch.testing.assert_close(weights["auto"][name], w, atol=1e-5, rtol=0, msg=name)


def test_flash_kernels_take_neither_segments_nor_a_mask():
    model = tiny_llama("sdpa")
    model.config._attn_implementation_internal = "flash_attention_2"  # no flash kernel on a CPU
    for attention in ("segments", "mask"):
        with pytest.raises(ValueError, match="flash"):
            Learner(
                model, LearnerConfig(lr=1e-3, attention=attention), LossConfig(), temperature=1.0
            )


def test_flex_attention_is_refused_for_training_on_the_cpu_and_with_segments_or_a_mask():
    # (on a GPU it trains on block masks: tests/test_gpu.py; its CPU forward: tests/test_batch.py)
    with pytest.raises(ValueError, match="no flex-attention backward on the CPU"):
        Learner(tiny_llama("flex_attention"), LearnerConfig(), LossConfig(), temperature=1.0)
    for attention in ("segments", "mask"):
        with pytest.raises(ValueError, match="flex by a block mask"):
            Learner(tiny_llama("flex_attention"), LearnerConfig(attention=attention), LossConfig())


def test_auto_runs_segments_only_on_rows_long_enough_to_pay():
    from agentgrpo.learner.attention import AUTO_MIN_SHARE
    from agentgrpo.learner.batch import attention_pair_cost
    from agentgrpo.learner.logprobs import _layout_kwargs

    model = tiny_llama("sdpa")
    use_segments(model)
    r = attention_pair_cost(model.config)
    short = int(AUTO_MIN_SHARE / r) - 4  # rows whose masked attention costs less than the threshold
    for T, want in ((short, "mask"), (short + 8, "segments")):
        (mb,) = make_micro_batches(
            rows([traj(list(range(T)), [0] + [1] * (T - 1))], [0.0]), 4096, mode="packed"
        )
        mb.needs_mask = True  # a lone row needs none; force the choice
        got = _layout_kwargs(model, mb, False, AUTO_MIN_SHARE)
        assert ("segments" in got) == (want == "segments"), T
        assert (got["attention_mask"] is not None) == (want == "mask"), T
        assert "segments" in _layout_kwargs(model, mb, False, 0.0)  # attention: segments, any row
        lp = PolicyForward(model, segment_min_share=AUTO_MIN_SHARE)(mb, 1.0)[0]
        torch.testing.assert_close(lp, PolicyForward(model)(mb, 1.0)[0], atol=1e-5, rtol=0)


def test_take_rows_adds_repeated_rows_gradients_in_index_order():
    """A shared prompt's keys (and its last hidden state) are gathered once per continuation, so
    the gradient adds several rows into one. On the CPU, `x[idx]`'s backward adds them with atomic
    adds from all threads once the tensor is large, in an order that changes from run to run (one
    of the two reasons two runs of a config drifted apart: docs/learner.md); `take_rows` adds them
    in index order, every time."""
    from agentgrpo.learner.attention import take_rows

    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 9, 64, generator=g).requires_grad_()  # 36864 values: torch's parallel path
    idx = torch.randint(0, 8, (4, 96), generator=g)  # 384 gathers of 8 rows: heavy repetition
    upstream = torch.randn(4, 96, 9, 64, generator=g) * torch.logspace(-6, 6, 64)  # order-sensitive
    torch.testing.assert_close(take_rows(x, idx), x[idx], atol=0, rtol=0)
    expected = torch.zeros_like(x)
    for i, row in enumerate(idx.reshape(-1).tolist()):  # one index after another
        expected[row] += upstream.reshape(-1, 9, 64)[i]
    for _ in range(5):
        (grad,) = torch.autograd.grad(take_rows(x, idx), x, upstream)
        assert torch.equal(grad, expected)


# --- varlen attention --------------------------------------------------------------------------


@pytest.fixture
def reference_kernel(monkeypatch):
    """The CPU reference in place of torch's CUDA-only varlen_attn."""
    monkeypatch.setattr(attention_module, "VARLEN_KERNEL", reference_varlen_attn)


def test_varlen_offsets_and_positions_of_packed_rows():
    c = traj([1, 2, 3, 4, 5], [0, 1, 1, 1, 1], group="c")
    a = traj([6, 7, 8], [0, 1, 1], group="a")
    b = traj([9, 10], [0, 1], group="b")
    e = traj([11, 12], [0, 1], group="e")
    (mb,) = make_micro_batches(rows([c, a, b, e], [0.0] * 4), 64, mode="packed")
    # First fit decreasing into rows of 5: [c], [a b], [e + a tail of 3]; flat runs c [0, 5),
    # a [5, 8), b [8, 10), e [10, 12), tail [12, 15).
    assert mb.input_ids_RS.tolist() == [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [11, 12, 0, 0, 0]]
    assert mb.position_ids_RS.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 0, 1], [0, 1, 2, 3, 4]]
    v = Varlen.of(mb)
    assert v.cu_seq_q.tolist() == [0, 5, 8, 10, 12, 15] and v.cu_seq_q.dtype == torch.int32
    assert v.cu_seq_k.tolist() == v.cu_seq_q.tolist() and v.k_idx is None  # keys = the queries
    assert (v.max_q, v.max_k) == (5, 5)


def test_varlen_offsets_of_a_shared_prefix_row():
    a = traj([1, 2, 3, 4, 5], [0, 0, 1, 1, 1], group="x")
    b = traj([1, 2, 3, 6], [0, 0, 0, 1], group="x")
    c = traj([7, 8], [0, 1], group="y")
    (mb,) = make_micro_batches(rows([a, b, c], [0.0] * 3), 64, mode="shared_prefix")
    # row 0 = 1 2 3 | 6 | 4 5 (prompt, b's own, a's own), row 1 = 7 8 + a tail of 4; rows of 6.
    assert mb.input_ids_RS.tolist() == [[1, 2, 3, 6, 4, 5], [7, 8, 0, 0, 0, 0]]
    # continuations count on after their prompt: b's 6 at 3, a's 4 5 at 3 4
    assert mb.position_ids_RS.tolist() == [[0, 1, 2, 3, 3, 4], [0, 1, 2, 3, 4, 5]]
    v = Varlen.of(mb)
    # query runs: prompt [0, 3), b [3, 4), a [4, 6), c [6, 8), tail [8, 12)
    assert v.cu_seq_q.tolist() == [0, 3, 4, 6, 8, 12]
    # keys: the prompt 3; b 3 + 1; a 3 + 2; c 2; tail 4 -> offsets 0 3 7 12 14 18
    assert v.cu_seq_k.tolist() == [0, 3, 7, 12, 14, 18]
    assert v.k_idx.tolist() == [0, 1, 2, 0, 1, 2, 3, 0, 1, 2, 4, 5, 6, 7, 8, 9, 10, 11]
    assert (v.max_q, v.max_k) == (4, 5)


def test_the_reference_kernel_aligns_causal_to_the_bottom_right():
    # one sequence of 2 queries against 3 keys (a prompt of 1, then the 2 queries themselves): the
    # first query sees keys 0 1, the second all 3; values one-hot, so outputs are the weights.
    q = torch.zeros(2, 1, 4)
    k = torch.zeros(3, 1, 4)
    v = torch.eye(3, 4)[:, None, :]
    cu_q, cu_k = torch.tensor([0, 2], dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32)
    out = reference_varlen_attn(q, k, v, cu_q, cu_k, 2, 3, window_size=(-1, 0))
    want = torch.tensor([[0.5, 0.5, 0.0], [1 / 3, 1 / 3, 1 / 3]])
    torch.testing.assert_close(out[:, 0, :3], want)


@pytest.mark.parametrize("mode", ["shared_prefix", "packed"])
def test_varlen_gives_the_masked_kernels_logprobs_and_gradients(mode, reference_kernel):
    trajs = groups_of_trajectories(n_groups=4, size=4, seed=2)
    batches = make_micro_batches(rows(trajs, [0.0] * len(trajs)), 300, mode=mode)
    assert any(mb.input_ids_RS.shape[0] > 1 for mb in batches)  # several rows, row tails
    for mb in batches:
        masked = _forward_backward(tiny_llama("sdpa"), mb)
        model = tiny_llama("sdpa")
        use_varlen(model)
        got = _forward_backward(model, mb)
        torch.testing.assert_close(got[0], masked[0], atol=1e-5, rtol=0)
        for name, g in masked[1].items():
            torch.testing.assert_close(got[1][name], g, atol=1e-5, rtol=1e-4, msg=name)


def test_varlen_through_torch_2_10s_signature(monkeypatch):
    # torch 2.10's varlen_attn takes is_causal and neither window_size, scale nor enable_gqa: the
    # call adapts (GQA by copies of the key/value heads) and gives the same numbers.
    calls = []

    def torch_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False,
                   return_aux=None):  # fmt: skip
        calls.append(is_causal)
        window = (-1, 0) if is_causal else (-1, -1)
        return reference_varlen_attn(
            query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, window_size=window
        )

    monkeypatch.setattr(attention_module, "VARLEN_KERNEL", torch_2_10)
    trajs = groups_of_trajectories(n_groups=2, size=4, seed=4)
    (mb,) = make_micro_batches(rows(trajs, [0.0] * len(trajs)), 4096)
    masked = _forward_backward(tiny_llama("sdpa"), mb)
    model = tiny_llama("sdpa")
    use_varlen(model)
    got = _forward_backward(model, mb)
    assert calls and all(calls)
    torch.testing.assert_close(got[0], masked[0], atol=1e-5, rtol=0)
    for name, g in masked[1].items():
        torch.testing.assert_close(got[1][name], g, atol=1e-5, rtol=1e-4, msg=name)


def test_varlen_under_bf16_autocast_calls_the_kernel_in_bf16(monkeypatch):
    # Rotary embeddings in fp32 make fp32 queries and keys out of bf16 projections; flash takes
    # bf16 or fp16 only, so the attention function casts them as sdpa's autocast would.
    seen = []

    @functools.wraps(reference_varlen_attn)  # its signature: the keywords the call passes
    def spy(q, k, v, *args, **kw):
        seen.append((q.dtype, k.dtype, v.dtype))
        return reference_varlen_attn(q, k, v, *args, **kw)

    monkeypatch.setattr(attention_module, "VARLEN_KERNEL", spy)
    trajs = groups_of_trajectories(n_groups=2, size=4, seed=3)
    (mb,) = make_micro_batches(rows(trajs, [0.0] * len(trajs)), 4096)
    masked = _forward_backward(tiny_llama("sdpa"), mb, bf16=True)
    model = tiny_llama("sdpa")
    use_varlen(model)
    got = _forward_backward(model, mb, bf16=True)
    assert seen and set(seen) == {(torch.bfloat16,) * 3}
    torch.testing.assert_close(got[0], masked[0], atol=0.05, rtol=0)
    for name, g in masked[1].items():
        torch.testing.assert_close(got[1][name], g, atol=0.05, rtol=0.05, msg=name)


def test_the_varlen_model_stays_correct_without_the_layout():
    ids = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 5]])
    attn = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    plain, switched = tiny_llama("sdpa"), tiny_llama("sdpa")
    use_varlen(switched)
    assert switched.config._attn_implementation == VARLEN
    with torch.no_grad():
        want = plain(input_ids=ids, attention_mask=attn).logits
        got = switched(input_ids=ids, attention_mask=attn).logits
    torch.testing.assert_close(got[attn.bool()], want[attn.bool()], atol=1e-6, rtol=0)


def test_a_varlen_layout_that_never_reaches_attention_raises(reference_kernel):
    _layout_dropped_before_attention(
        use_varlen, VARLEN, varlen_attention, "varlen", "varlen attention ran in 0 of 2 layers"
    )


def test_varlen_names_the_features_it_does_not_implement(reference_kernel):
    (mb,) = make_micro_batches(
        rows([traj([1, 2, 3], [0, 1, 1]), traj([4, 5, 6], [0, 1, 1], group="h")], [0.0, 0.0]), 64
    )
    v = Varlen.of(mb)
    R, S = mb.input_ids_RS.shape
    q, kv = torch.zeros(R, 4, S, 8), torch.zeros(R, 2, S, 8)
    with pytest.raises(ValueError, match="sliding_window"):
        varlen_attention(torch.nn.Module(), q, kv, kv, None, varlen=v, sliding_window=4096)
    with pytest.raises(ValueError, match="dropout"):
        varlen_attention(torch.nn.Module(), q, kv, kv, None, dropout=0.1, varlen=v)
    out, _ = varlen_attention(torch.nn.Module(), q, kv, kv, None, varlen=v, sliding_window=None)
    assert out.shape == (R, S, 4, 8)


def _choose(setting="auto", **facts):
    """choose_attention on a CUDA H200 running bf16, unless `facts` say otherwise."""
    kw = {
        "device_type": "cuda",
        "capability": (9, 0),
        "dtype": torch.bfloat16,
        "config": tiny_llama().config,
        "kernel": "sdpa",
        "sliding_window": None,
    }
    return choose_attention(setting, **{**kw, **facts})


def test_auto_chooses_varlen_only_where_it_runs(reference_kernel):
    assert _choose().path == "varlen"
    assert "torch varlen_attn" in _choose().reason
    cpu = _choose(device_type="cpu", capability=None)
    assert cpu.path == "segments" and "CPU" in cpu.reason  # today's CPU path
    for facts, why in (
        ({"capability": (7, 5)}, "sm_80"),
        ({"dtype": torch.float32}, "bf16 or fp16"),
        ({"config": tiny_llama(head_dim=320).config}, "head dim 320"),
        ({"sliding_window": 4096}, "sliding-window"),
        ({"config": tiny_llama(attention_dropout=0.1).config}, "dropout"),
    ):
        got = _choose(**facts)
        assert got.path == "mask" and why in got.reason, (facts, got)  # today's GPU path
        with pytest.raises(ValueError, match=f"learner.attention=varlen cannot run here: .*{why}"):
            _choose("varlen", **facts)
    assert _choose("mask").path == "mask" and _choose("segments").path == "segments"
    flash = _choose(kernel="flash_attention_2")
    assert flash.path == "flash_attention_2" and "position ids" in flash.reason
    with pytest.raises(ValueError, match="flash by position ids"):
        _choose("varlen", kernel="flash_attention_2")


def test_a_torch_without_varlen_keeps_todays_path(monkeypatch):
    monkeypatch.setattr(attention_module, "VARLEN_KERNEL", None)  # torch < 2.10
    got = _choose()
    assert got.path == "mask" and "no torch.nn.attention.varlen" in got.reason
    with pytest.raises(ValueError, match="no torch.nn.attention.varlen"):
        _choose("varlen")


# The first thing against varlen here: the CPU, or (the dependency floors) a torch without it.
CPU_REASON = (
    r"learner.attention=varlen cannot run here: (the learner runs on cpu|torch \S+ has no "
    r"torch.nn.attention.varlen)"
)


def test_varlen_asked_for_on_the_cpu_is_refused_with_the_reason():
    with pytest.raises(ValueError, match=CPU_REASON):
        Learner(tiny_llama(), LearnerConfig(attention="varlen"), LossConfig())
    learner = Learner(tiny_llama(), LearnerConfig(), LossConfig())  # auto on the CPU
    assert learner.attention.path == "segments"
    assert learner.unwrapped.config._attn_implementation == SEGMENTS


def test_the_learner_trains_with_varlen_as_with_the_mask(monkeypatch, reference_kernel):
    # The learner's choice as on a bf16 GPU (the kernel: the CPU reference, in fp32): the policy and
    # the KL reference switched, groups never split, and one step equal to the masked learner's.
    def as_on_a_gpu(setting, **facts):
        gpu = {"device_type": "cuda", "capability": (9, 0), "dtype": torch.bfloat16}
        return choose_attention(setting, **{**facts, **gpu})

    trajs = groups_of_trajectories(n_groups=3, size=4, seed=5)
    adv = [float(t.reward) - 0.5 for t in trajs]
    weights, learners, metrics = {}, {}, {}
    for setting in ("mask", "varlen"):
        with monkeypatch.context() as m:
            m.setattr(learner_module, "choose_attention", as_on_a_gpu)
            learner = Learner(
                tiny_llama("sdpa"),
                LearnerConfig(lr=1e-3, micro_batch_tokens=200, attention=setting),
                LossConfig(kl_coef=0.05),
                temperature=0.7,
            )
        metrics[setting] = learner.train_step(rows(trajs, adv))
        learners[setting] = learner
        weights[setting] = {n: p.detach().clone() for n, p in learner.unwrapped.named_parameters()}
    varlen = learners["varlen"]
    assert varlen.attention.path == "varlen" and varlen.pair_cost == 0
    assert learners["mask"].pair_cost > 0
    assert varlen.unwrapped.config._attn_implementation == VARLEN
    assert varlen.ref.model.config._attn_implementation == VARLEN  # the KL reference too
    assert varlen.packing == "shared_prefix"  # prompts still shared
    for key in ("loss", "grad_norm", "kl", "logprob_gap_mean"):
        got, want = metrics["varlen"][key], metrics["mask"][key]
        assert got == pytest.approx(want, rel=1e-5, abs=1e-7), key
    for name, w in weights["mask"].items():  # as in the segments test above: AdamW's ~lr * sign(g)
        torch.testing.assert_close(weights["varlen"][name], w, atol=1e-5, rtol=0, msg=name)


# --- the start-up check of `auto`'s pick --------------------------------------------------------


def _learner(attention="auto", kl_coef=0.05):
    return Learner(
        tiny_llama("sdpa"),
        LearnerConfig(lr=1e-3, micro_batch_tokens=200, attention=attention),
        LossConfig(kl_coef=kl_coef),
        temperature=0.7,
    )


def test_auto_keeps_a_path_that_passes_its_check():
    learner = _learner()
    assert learner.attention.path == "segments"
    assert "checked against the 4D mask on a probe batch" in learner.attention.reason
    assert learner.unwrapped.config._attn_implementation == SEGMENTS
    # asked for by name: not second-guessed, not probed
    assert "checked" not in _learner("segments").attention.reason


def test_the_probe_holds_every_layout_the_paths_must_keep_apart():
    from agentgrpo.learner.attention import probe_rows, probe_trajectories

    trajs = probe_trajectories(vocab_size=100)
    (mb,) = make_micro_batches(probe_rows(vocab_size=100), 4096, mode="shared_prefix")
    spans = Segments.of(mb).spans
    assert mb.input_ids_RS.shape[0] > 1 and mb.needs_mask  # packed rows, one micro-batch
    assert sum(ps < pe for _, _, _, ps, pe in spans) == 6  # six continuations of shared prompts
    assert (mb.segment_ids_RS == 0).any()  # and row tails
    assert any(0 in t.loss_mask[t.prompt_len :] for t in trajs)  # a tool output between turns


@pytest.mark.parametrize("broken", ["wrong values", "raises"])
def test_auto_falls_back_to_the_mask_when_its_kernel_fails_the_check(monkeypatch, broken):
    real = attention_module.segment_attention

    def bad_segments(module, query, key, value, attention_mask, *a, segments=None, **kw):
        out, w = real(module, query, key, value, attention_mask, *a, segments=segments, **kw)
        if segments is None:  # only the segment kernel itself is broken
            return out, w
        if broken == "raises":
            raise RuntimeError("no kernel image is available for execution on the device")
        return out * 1.5, w

    monkeypatch.setattr(attention_module, "segment_attention", bad_segments)
    learner = _learner()
    choice = learner.attention
    assert choice.path == "mask", choice
    assert choice.reason.startswith("auto: segments failed its start-up check: "), choice
    expect = (
        "no kernel image"
        if broken == "raises"
        else r"its logprobs lie \S+ from the 4D mask's on average \(tolerance 0.001 in float32\)"
    )
    assert re.search(expect, choice.reason), choice.reason
    assert choice.reason.endswith("; the 4D mask instead")
    # policy and KL reference back on sdpa, the cost model pricing cross-sequence pairs again
    assert learner.unwrapped.config._attn_implementation == "sdpa"
    assert learner.ref.model.config._attn_implementation == "sdpa"
    assert learner.pair_cost > 0
    # and it trains as a learner on the mask does
    trajs = groups_of_trajectories(n_groups=3, size=4, seed=5)
    adv = [float(t.reward) - 0.5 for t in trajs]
    got, want = learner.train_step(rows(trajs, adv)), _learner("mask").train_step(rows(trajs, adv))
    for key in ("loss", "grad_norm", "kl"):
        assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-8), key


@pytest.mark.parametrize("kernel", ["reference", "top-left causal"])
def test_auto_checks_varlen_as_on_a_gpu(monkeypatch, kernel):
    def as_on_a_gpu(setting, **facts):
        gpu = {"device_type": "cuda", "capability": (9, 0), "dtype": torch.bfloat16}
        return choose_attention(setting, **{**facts, **gpu})

    wrong = kernel != "reference"
    fn = top_left_varlen_attn if wrong else reference_varlen_attn
    monkeypatch.setattr(attention_module, "VARLEN_KERNEL", fn)
    monkeypatch.setattr(
        attention_module,
        "_kernel_params",
        lambda k: frozenset({"window_size", "scale", "enable_gqa"}),
    )
    monkeypatch.setattr(learner_module, "choose_attention", as_on_a_gpu)
    learner = _learner()
    assert learner.attention.path == ("mask" if wrong else "varlen"), learner.attention
    if wrong:
        assert "varlen failed its start-up check" in learner.attention.reason
        assert learner.unwrapped.config._attn_implementation == "sdpa"
    else:
        assert learner.unwrapped.config._attn_implementation == VARLEN


def test_train_with_varlen_on_the_cpu_is_a_config_error(tmp_path, capsys, monkeypatch):
    import agentgrpo.models.embedded as models
    from agentgrpo.cli import main

    monkeypatch.setattr(models, "load_policy", lambda path: tiny_llama())  # no model to load
    config = tmp_path / "c.yaml"
    config.write_text(f"learner: {{attention: varlen}}\noutput_dir: {tmp_path / 'run'}\n")
    assert main(["train", str(config)]) == 2
    err = capsys.readouterr().err
    assert re.search("error: " + CPU_REASON, err), err
    assert "Traceback" not in err
