"""Packing: packed, head-only logprobs equal per-sequence logprobs; layouts, budgets and shards."""

from __future__ import annotations

import random

import pytest
import torch

from agentgrpo.learner.attention import flex_block_mask, use_segments
from agentgrpo.learner.batch import attention_pair_cost, balanced_parts, make_micro_batches
from agentgrpo.learner.logprobs import PolicyForward, sequence_logprobs, to_loss_layout
from agentgrpo.types import TrainingRow
from tests.tiny import V, groups_of_trajectories, rows, tiny_llama, traj


def packed_logprobs(model, batches, temperature):
    """trajectory index -> {token position: logprob} from the packed, head-only path."""
    pf = PolicyForward(model)
    out: dict[int, dict[int, float]] = {}
    with torch.no_grad():
        for mb in batches:
            lp_BT = to_loss_layout(pf(mb, temperature)[0], mb)
            for n, i in enumerate(mb.rows):
                out[i] = {
                    "lp_BT": lp_BT[n],
                    "mask_BT": mb.loss_mask_BT[n],
                    "rollout_BT": mb.rollout_logprobs_BT[n],
                }
    return out


def assert_per_sequence(got, trajs, ref, tol):
    """Every loss token's packed logprob (`packed_logprobs`) equals the per-sequence one in
    `ref`."""
    for i, t in enumerate(trajs):
        first = t.loss_mask.index(1)
        for j in (j for j, m in enumerate(t.loss_mask) if m):
            assert got[i]["lp_BT"][j - first].item() == pytest.approx(ref[i][j], abs=tol), (i, j)


@pytest.mark.parametrize("attn", ["sdpa", "eager", "segments"])
@pytest.mark.parametrize("mode", ["padded", "packed", "shared_prefix"])
@pytest.mark.parametrize("budget", [40, 4096])
def test_packed_logprobs_equal_per_sequence_logprobs(attn, mode, budget):
    model = tiny_llama("sdpa" if attn == "segments" else attn)
    if attn == "segments":  # the per-sequence reference below then runs the fallback (no segments)
        use_segments(model)
    trajs = groups_of_trajectories()
    ref = sequence_logprobs(model, [t.token_ids for t in trajs], temperature=0.7)
    got = packed_logprobs(
        model, make_micro_batches(rows(trajs, [0.0] * len(trajs)), budget, mode=mode), 0.7
    )
    assert sorted(got) == list(range(len(trajs)))  # every trajectory exactly once
    for i, t in enumerate(trajs):
        first = t.loss_mask.index(1)
        loss_pos = [j for j, m in enumerate(t.loss_mask) if m]
        lp_BT, mask_BT, rollout_BT = got[i]["lp_BT"], got[i]["mask_BT"], got[i]["rollout_BT"]
        for j in loss_pos:
            assert lp_BT[j - first].item() == pytest.approx(ref[i][j], abs=2e-5)
            assert rollout_BT[j - first].item() == t.logprobs[j]
        assert mask_BT.sum().item() == len(loss_pos)  # tool tokens inside the span stay masked


@pytest.mark.parametrize("mode", ["packed", "shared_prefix"])
def test_the_flex_block_mask_is_the_4d_mask_and_skips_the_blocks_across_sequences(mode):
    from torch.nn.attention.flex_attention import create_mask

    rng = random.Random(0)
    prompt = [rng.randrange(V) for _ in range(100)]
    trajs = [
        traj(prompt + [rng.randrange(V) for _ in range(150)], [0] * 100 + [1] * 150)
        for _ in range(8)
    ]
    trajs.append(traj([rng.randrange(V) for _ in range(1200)], [0] * 20 + [1] * 1180, group="long"))
    for mb in make_micro_batches(rows(trajs, [0.0] * len(trajs)), 4096, mode=mode):
        bm = flex_block_mask(mb)
        B, T = mb.input_ids_RS.shape
        assert torch.equal(
            create_mask(bm.mask_mod, B, 1, T, T, device="cpu"), mb.attention_mask_R1SS()
        )
        blocks = -(-T // 128)
        visited_B = (bm.kv_num_blocks + bm.full_kv_num_blocks).sum(-1).flatten()  # per row
        assert visited_B.max() <= blocks * (blocks + 1) // 2  # never more than causal
        assert (
            visited_B.min() < blocks * (blocks + 1) // 4
        )  # a row of several sequences: under half


def test_packed_logprobs_under_flex_attention_equal_per_sequence_logprobs():
    trajs = groups_of_trajectories()
    ref = sequence_logprobs(tiny_llama("sdpa"), [t.token_ids for t in trajs], temperature=0.7)
    model = tiny_llama("flex_attention")  # the same weights (same seed)
    for mode in ("packed", "shared_prefix"):  # micro-batches of several lengths: recompiles and all
        got = packed_logprobs(
            model, make_micro_batches(rows(trajs, [0.0] * len(trajs)), 40, mode=mode), 0.7
        )
        assert sorted(got) == list(range(len(trajs)))
        assert_per_sequence(got, trajs, ref, 2e-5)


def test_a_chunked_head_gives_the_same_logprobs_entropy_and_gradients():
    trajs = groups_of_trajectories()
    (mb,) = make_micro_batches(rows(trajs, [0.0] * len(trajs)), 4096)
    out = {}
    for chunk in (None, 7):
        model = tiny_llama("sdpa")
        lp, ent = PolicyForward(model, head_chunk_tokens=chunk)(mb, 0.7, entropy_grad=True)
        (lp.sum() + 0.1 * ent.sum()).backward()
        out[chunk] = lp.detach(), ent.detach(), {n: p.grad for n, p in model.named_parameters()}
    assert len(mb.target_ids_M) > 7 * 3  # several chunks
    torch.testing.assert_close(out[7][0], out[None][0], atol=1e-6, rtol=0)
    torch.testing.assert_close(out[7][1], out[None][1], atol=1e-6, rtol=0)
    for name, g in out[None][2].items():  # chunks sum the head's gradient in another order: float32
        # rounding of a sum of magnitude ~10 (1.4e-6 seen on this CPU's kernels), so the bound
        # scales with it
        torch.testing.assert_close(
            out[7][2][name], g, atol=1e-6 * max(1.0, g.abs().max().item()), rtol=1e-5, msg=name
        )
    with torch.no_grad():  # scoring chunks too, without checkpointing
        lp, _ = PolicyForward(tiny_llama("sdpa"), head_chunk_tokens=7)(mb, 0.7)
    torch.testing.assert_close(lp, out[None][0], atol=1e-6, rtol=0)


def test_one_row_packing_without_a_mask_is_exact_with_position_ids():
    # The flash-attention layout (one row, positions reset, no mask); under sdpa transformers
    # derives the block-diagonal mask from the position ids, so this checks the layout on a CPU.
    model = tiny_llama("sdpa")
    trajs = groups_of_trajectories(seed=1)
    batches = make_micro_batches(rows(trajs, [0.0] * len(trajs)), 150, mode="packed", one_row=True)
    assert all(mb.input_ids_RS.shape[0] == 1 and mb.attention_mask_R1SS() is None for mb in batches)
    ref = sequence_logprobs(model, [t.token_ids for t in trajs])
    got = packed_logprobs(model, batches, 1.0)
    for i, t in enumerate(trajs):
        first = t.loss_mask.index(1)
        for j in (j for j, m in enumerate(t.loss_mask) if m):
            assert got[i]["lp_BT"][j - first].item() == pytest.approx(ref[i][j], abs=2e-5)


def test_shared_prefix_layout_by_hand():
    # Two members share [1, 2, 3]; their own tokens are [4, 5] and [6], laid out shortest first:
    # row = 1 2 3 | 6 | 4 5, each continuation's positions continuing after the prefix.
    a = traj([1, 2, 3, 4, 5], [0, 0, 1, 1, 1], group="x")
    b = traj([1, 2, 3, 6], [0, 0, 0, 1], group="x")
    (mb,) = make_micro_batches(rows([a, b], [1.0, -1.0]), 64, mode="shared_prefix")
    assert mb.input_ids_RS.tolist() == [[1, 2, 3, 6, 4, 5]]
    assert mb.position_ids_RS.tolist() == [[0, 1, 2, 3, 3, 4]]
    assert mb.num_real_tokens == 6  # 5 + 4 tokens unshared
    allowed = mb.attention_mask_R1SS()[0, 0].int().tolist()
    assert allowed == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0, 0],
        [1, 1, 1, 0, 1, 0],  # 4 sees the prefix and itself, not 6
        [1, 1, 1, 0, 1, 1],
    ]
    # b (n=0): token 6 is predicted at row position 2. a (n=1): tokens 3, 4, 5 at positions 1, 2
    # (both in the prefix) and 4 (a's own 4).
    assert mb.rows == [1, 0] and mb.advantages_B.tolist() == [-1.0, 1.0]
    assert mb.pred_index_M.tolist() == [2, 1, 2, 4]
    assert mb.target_ids_M.tolist() == [6, 3, 4, 5]
    assert mb.loss_mask_BT.tolist() == [[1, 0, 0], [1, 1, 1]]


def test_packed_rows_never_attend_across_sequences():
    a = traj([1, 2, 3], [0, 1, 1], group="a")
    b = traj([4, 5], [0, 1], group="b")
    (mb,) = make_micro_batches(rows([a, b], [0.0, 0.0]), 64, mode="packed")
    assert mb.input_ids_RS.tolist() == [[1, 2, 3], [4, 5, 0]]  # rows as long as the longest unit
    assert mb.position_ids_RS[1, :2].tolist() == [0, 1]
    m = mb.attention_mask_R1SS()[:, 0].int().tolist()
    assert m[1] == [[1, 0, 0], [1, 1, 0], [0, 0, 1]]  # the row-tail pad sees only itself


def test_budgets_padding_and_counts():
    trajs = groups_of_trajectories(n_groups=6, size=8, seed=3)
    total_loss = sum(sum(t.loss_mask) for t in trajs)
    for mode in ("padded", "packed", "shared_prefix"):
        batches = make_micro_batches(rows(trajs, [0.0] * len(trajs)), 256, mode=mode)
        longest = max(len(t.token_ids) for t in trajs)
        assert all(mb.num_tokens <= max(256, longest * 8 + 20) for mb in batches)
        assert sum(float(mb.loss_mask_BT.sum()) for mb in batches) == total_loss
        assert sorted(i for mb in batches for i in mb.rows) == list(range(len(trajs)))
        if mode != "shared_prefix":
            assert all(mb.num_tokens <= 256 for mb in batches)
    real = {
        m: sum(
            mb.num_real_tokens for mb in make_micro_batches(rows(trajs, [0.0] * 48), 256, mode=m)
        )
        for m in ("packed", "shared_prefix")
    }
    assert real["packed"] == sum(len(t.token_ids) for t in trajs)
    assert real["shared_prefix"] < real["packed"]


def test_a_group_longer_than_the_budget_is_split_with_its_prefix():
    prompt = list(range(1, 11))
    trajs = [traj(prompt + [20 + k] * 10, [0] * 10 + [1] * 10, group="g") for k in range(4)]
    batches = make_micro_batches(rows(trajs, [0.0] * 4), 45, mode="shared_prefix")
    # prefix 10 + 3 x 10 = 40 fits, the fourth member gets a copy of the prefix in another unit.
    assert sorted(mb.num_real_tokens for mb in batches) == [20, 40]


def long_groups(n_groups=2, size=8):
    """Groups whose unit is far longer than a member: a 25-token prompt, 8 x 60 own tokens."""
    out = []
    for g in range(n_groups):
        prompt = [1 + g] * 25
        for k in range(size):
            own = [(7 * k + j) % 90 + 5 for j in range(60)]
            out.append(traj(prompt + own, [0] * 25 + [1] * 60, group=f"g{g}"))
    return out


def test_a_row_cap_splits_groups_and_keeps_logprobs_exact():
    model = tiny_llama("sdpa")
    trajs = long_groups()
    (whole,) = make_micro_batches(rows(trajs, [0.0] * 16), 2048)  # two units of 25 + 8 x 60 = 505
    assert whole.input_ids_RS.shape == (2, 505)
    batches = make_micro_batches(rows(trajs, [0.0] * 16), 2048, row_tokens=150)
    # pieces of 25 + 2 x 60 = 145: 4 per group, each with its own copy of the prompt
    assert [tuple(mb.input_ids_RS.shape) for mb in batches] == [(8, 145)]
    assert batches[0].num_real_tokens == 8 * 145
    ref = sequence_logprobs(model, [t.token_ids for t in trajs], temperature=0.7)
    got = packed_logprobs(model, batches, 0.7)
    assert sorted(got) == list(range(16))
    for i in range(16):
        lp = got[i]["lp_BT"]
        assert lp.tolist() == pytest.approx(ref[i][25:], abs=2e-5)


def test_the_cost_model_splits_long_groups_only_when_attention_costs():
    cfg = type(
        "Cfg",
        (),
        dict(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536),
    )  # SmolLM2-135M's shape
    r = attention_pair_cost(cfg)
    assert r == pytest.approx(1 / 3072)
    assert attention_pair_cost(None) == 0.0
    trajs = long_groups()

    def auto(batch, pair_cost, mode="shared_prefix"):
        return [
            mb.input_ids_RS.tolist()
            for mb in make_micro_batches(
                rows(batch, [0.0] * len(batch)),
                2048,
                mode=mode,
                row_tokens="auto",
                pair_cost=pair_cost,
            )
        ]

    def capped(batch, cap, mode="shared_prefix"):
        return [
            mb.input_ids_RS.tolist()
            for mb in make_micro_batches(
                rows(batch, [0.0] * len(batch)), 2048, mode=mode, row_tokens=cap
            )
        ]

    assert auto(trajs, 0.0) == capped(trajs, None)  # attention free: share the whole prompt
    assert auto(trajs, r, mode="packed") == capped(trajs, None, mode="packed")  # nothing to split
    # rows of 505 cost 1 + 505 r per token; pieces cost more tokens but shorter rows
    chosen = make_micro_batches(rows(trajs, [0.0] * 16), 2048, row_tokens="auto", pair_cost=100 * r)
    cheap = max(mb.input_ids_RS.shape[1] for mb in chosen)  # the cap, as the rows show it
    assert 85 <= cheap < 505

    def modeled(cap):
        return sum(
            mb.num_tokens * (1 + 100 * r * mb.input_ids_RS.shape[1])
            for mb in make_micro_batches(rows(trajs, [0.0] * 16), 2048, row_tokens=cap)
        )

    assert modeled(cheap) < modeled(None)
    assert auto(trajs, 100 * r) == capped(trajs, cheap)
    # a tool-env shape (a 170-token prompt, 40 own tokens each): a copy of the prompt costs more
    # than attention over 490 tokens saves
    tool = [traj([3] * 170 + [5 + k] * 40, [0] * 170 + [1] * 40, group="t") for k in range(8)]
    assert auto(tool, r) == capped(tool, None)


def test_bad_input_is_rejected():
    with pytest.raises(ValueError, match="token 0"):
        TrainingRow("t", "g", [1, 2], [1, 1], [-1.0, -1.0], 0.0)
    (row,) = rows([traj([1, 2], [0, 1])], [0.0])
    with pytest.raises(ValueError, match="shared prefix"):
        make_micro_batches([row], 64, mode="shared_prefix", one_row=True)
    with pytest.raises(ValueError, match="packing mode"):
        make_micro_batches([row], 64, mode="unpacked")


def test_rank_parts_keep_groups_together_and_cover_everything():
    def shard(trajs, rank, world):  # what the learner gives rank `rank` of `world`
        return balanced_parts(trajs, world, exactly_k=True)[rank]

    trajs = groups_of_trajectories(n_groups=5, size=3, seed=2)
    parts = [shard(trajs, r, 2) for r in range(2)]
    assert sorted(parts[0] + parts[1]) == list(range(15)) and not set(parts[0]) & set(parts[1])
    for p in parts:
        groups = {trajs[i].group_id for i in p}
        assert sum(1 for t in trajs if t.group_id in groups) == len(p)  # whole groups only
    assert shard(trajs, 0, 2) == parts[0]  # deterministic
    # fewer groups than ranks: trajectories are dealt one by one
    one = groups_of_trajectories(n_groups=1, size=3)
    assert sorted(shard(one, 0, 2) + shard(one, 1, 2)) == [0, 1, 2] and shard(one, 1, 2)
    assert shard(one, 0, 1) == [0, 1, 2]
    assert balanced_parts(one[:1], 3, exactly_k=True) == [[0], [], []]  # a rank may get nothing


def _loss_logprobs(model, trajs, mode):
    b = make_micro_batches(rows(trajs, [1.0] * len(trajs)), 4096, mode=mode)[0]
    with torch.no_grad():
        lp_BT = to_loss_layout(PolicyForward(model)(b, 1.0)[0], b)
    start = [t.loss_mask.index(1) for t in trajs]
    return {
        i: lp_BT[n, : len(trajs[i].token_ids) - start[i]].tolist() for n, i in enumerate(b.rows)
    }


def _reference(model, trajs):
    ref = sequence_logprobs(model, [t.token_ids for t in trajs])
    return {i: ref[i][t.loss_mask.index(1) :] for i, t in enumerate(trajs)}


def test_a_sequence_longer_than_a_sliding_window_is_refused_in_packed_layouts():
    # The packed masks say "causal, same sequence" and transformers uses a given 4D mask as it is,
    # so a Mistral-style window was dropped: logprobs 0.07 off. Padded keeps the model's own masks.
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    model = MistralForCausalLM(
        MistralConfig(
            vocab_size=V,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            sliding_window=4,
            attn_implementation="sdpa",
        )
    ).eval()
    ids = torch.randint(0, V, (16,), generator=torch.Generator().manual_seed(1)).tolist()
    mask = [0] * 3 + [1] * 13
    trajs = [traj(ids, mask), traj(ids[:12] + [1, 2, 3, 4], mask)]
    got, want = _loss_logprobs(model, trajs, "padded"), _reference(model, trajs)
    for i in want:
        assert got[i] == pytest.approx(want[i], abs=1e-5)
    for mode in ("packed", "shared_prefix"):
        with pytest.raises(
            ValueError, match="sliding window of 4 tokens .* a sequence of 16.*packing: padded"
        ):
            _loss_logprobs(model, trajs, mode)
    short = [traj(ids[:4], [0, 1, 1, 1]), traj(ids[4:8], [0, 1, 1, 1])]  # within the window: exact
    got, want = _loss_logprobs(model, short, "packed"), _reference(model, short)
    for i in want:
        assert got[i] == pytest.approx(want[i], abs=1e-5)


def test_granite_logits_scaling_is_applied_by_the_head_only_path():
    from transformers import GraniteConfig, GraniteForCausalLM

    torch.manual_seed(0)
    model = GraniteForCausalLM(
        GraniteConfig(
            vocab_size=V,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            logits_scaling=8.0,
            attn_implementation="sdpa",
        )
    ).eval()
    trajs = [traj([3, 14, 15, 92 % V, 65, 35, 89 % V, 79 % V], [0, 0, 0, 1, 1, 1, 1, 1])]
    got, want = _loss_logprobs(model, trajs, "padded"), _reference(model, trajs)
    assert got[0] == pytest.approx(want[0], abs=1e-5)  # the divisor was ignored: 0.09 off


def test_token_advantages_map_each_run_of_sampled_tokens_to_its_turn():
    from agentgrpo.learner.batch import token_advantages

    t = traj([5, 6, 7, 8, 9, 10, 11, 12, 13], [0, 0, 1, 1, 0, 1, 0, 1, 1])
    (row,) = rows([t], [0.5])
    assert row.token_advantages is None and row.advantage == 0.5  # one value for every token
    (row,) = rows([t], [0.5], [[1.0, -2.0, 0.25]])
    assert row.token_advantages == (0, 0, 1.0, 1.0, 0, -2.0, 0, 0.25, 0.25)
    with pytest.raises(ValueError, match="3 sampled turns but 2 turn advantages"):
        token_advantages(t.loss_mask, [1.0, -2.0])


def test_micro_batches_carry_per_token_advantages_only_with_turn_advantages():
    trajs = groups_of_trajectories()
    adv = [float(i) for i in range(len(trajs))]
    for mb in make_micro_batches(rows(trajs, adv), 64):
        assert mb.token_advantages_BT is None and mb.loss_advantages is mb.advantages_B
    # one row with turn advantages: the whole micro-batch goes per token, the other rows' tokens
    # holding their scalar
    (first,) = rows(trajs[:1], adv[:1], [[-3.0] * trajs[0].segments[0].num_turns])
    (mb,) = make_micro_batches([first, *rows(trajs[1:], adv[1:])], 100_000)
    for n, i in enumerate(mb.rows):
        on = mb.loss_mask_BT[n] > 0
        want = -3.0 if i == 0 else adv[i]
        assert (mb.token_advantages_BT[n][on] == want).all()
        assert (mb.token_advantages_BT[n][~on] == 0).all()
