"""Training rows -> micro-batches for the learner: packed rows in, per-sequence loss tensors out.

A micro-batch has two layouts. The model layout `[R, S]` is what the model runs on: several
sequences packed one after the other in a row, position ids restarting for each, a mask (or spans)
that lets a token see only its own sequence, padding only at a row's tail. The loss layout
`[B, T]` is one row per training row, from its first to its last loss token: what
`loss.compute_loss` expects, so packing never changes what the loss sees. `pred_index_M`,
`target_ids_M` and `dest_index_M` join them, so the LM head runs on the loss tokens only.

What is trained is a list of `TrainingRow`s (`training_rows`: one per segment with a sampled token
of each trajectory that has an `Advantage`); a row with `token_advantages` weighs each token by its
turn's advantage (`TrainBatch.token_advantages_BT`). `shared_prefix` (default) lays a group out as
its common prompt once, then each member's continuation: exactly the unshared logprobs and
gradients. Modes, attention and costs: docs/learner.md ("Packing, and the prompt computed once").
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from agentgrpo.types import Advantage, TrainingRow, Trajectory

PackingMode = Literal["shared_prefix", "packed", "padded"]
PACKING_MODES = ("shared_prefix", "packed", "padded")


@dataclass
class TrainBatch:
    """One micro-batch in model layout [R, S] and loss layout [B, T] (see the module docstring)."""

    input_ids_RS: torch.Tensor  # [R, S] long, pad_id in row tails
    position_ids_RS: torch.Tensor  # [R, S] long, restarts at 0 for every sequence / prefix
    segment_ids_RS: torch.Tensor  # [R, S] long, one id per sequence, prefix or row tail in a row
    visible_ids_RS: (
        torch.Tensor
    )  # [R, S] long, the other segment a token may see (its prefix) or its own
    pred_index_M: (
        torch.Tensor
    )  # [M] long, flat index into [R*S] of the hidden state predicting token m
    target_ids_M: torch.Tensor  # [M] long, the token id of loss token m
    dest_index_M: torch.Tensor  # [M] long, flat index into [B*T] of loss token m
    loss_mask_BT: torch.Tensor  # [B, T] float, 1 on sampled tokens
    rollout_logprobs_BT: torch.Tensor  # [B, T] float, the engine's sampling logprobs (0 elsewhere)
    advantages_B: torch.Tensor  # [B] float
    rows: list[int]  # index of each sequence n in the list given to `make_micro_batches`
    needs_mask: bool = True  # False when plain causal attention is already exact (padded, one row)
    # [B, T] float, per loss token, when some member has `turn_advantages` (a turn-level
    # estimator); None: `advantages_B` is broadcast over each row, as for outcome-only estimators
    token_advantages_BT: torch.Tensor | None = None

    @property
    def loss_advantages(self) -> torch.Tensor:
        """What the loss weighs each token by: [B, T] per token, or [B] per row."""
        return self.advantages_B if self.token_advantages_BT is None else self.token_advantages_BT

    @property
    def num_tokens(self) -> int:
        """Token slots the model runs on (R*S, padding included)."""
        return self.input_ids_RS.numel()

    @property
    def num_real_tokens(self) -> int:
        """Slots holding a token (not row-tail padding); a shared prefix counts once."""
        tail = self.segment_ids_RS == 0
        return int((~tail).sum())

    def attention_mask_R1SS(self) -> torch.Tensor | None:
        """[R, 1, S, S] bool, True where query t may attend to key s: s <= t and s is in t's own
        segment or in the prefix it continues. Row-tail padding is its own segment, so no query row
        is all-masked (an all-masked row gives NaN that 0-weights would still spread). None when
        causal attention alone is exact."""
        if not self.needs_mask:
            return None
        S = self.input_ids_RS.shape[1]
        seg_RS, vis_RS = self.segment_ids_RS, self.visible_ids_RS
        key_R1S = seg_RS[:, None, :]
        same_RSS = (key_R1S == seg_RS[:, :, None]) | (key_R1S == vis_RS[:, :, None])
        causal_SS = torch.ones(S, S, dtype=torch.bool, device=seg_RS.device).tril()
        return (same_RSS & causal_SS)[:, None]

    def to(self, device: torch.device | str) -> TrainBatch:
        fields = {
            k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in vars(self).items()
        }
        return TrainBatch(**fields)

    @staticmethod
    def empty(pad_id: int, device: torch.device) -> TrainBatch:
        """A micro-batch with no loss token (one row of 2 pads): what a rank with no data left runs,
        so that its forward and backward still meet the other ranks' collectives."""
        none = torch.zeros(0, dtype=torch.long, device=device)
        two = torch.tensor([[0, 1]], device=device)
        return TrainBatch(
            two * 0 + pad_id,
            two,
            two * 0,
            two * 0,
            none,
            none,
            none,
            torch.zeros(0, 1, device=device),
            torch.zeros(0, 1, device=device),
            torch.zeros(0, device=device),
            [],
            needs_mask=False,
        )


@dataclass
class _Unit:
    """Trajectories laid out together in one row: a shared prefix, then each member's own tokens."""

    members: list[int]
    prefix_len: int  # 0 for a lone trajectory
    length: int  # tokens the unit occupies in a row


def training_rows(
    trajectories: Sequence[Trajectory], advantages: Mapping[str, Advantage]
) -> list[TrainingRow]:
    """What the learner trains on: one row per segment that holds a sampled token, of every
    trajectory that has an advantage (joined by trajectory id; one without is not trained on).

    A single-sequence trajectory is one row; a step-wise one's segments become one row each, with
    the episode's advantage and group, so shared-prefix packing finds the prefix a group's
    segments share (the task's prompt, or an episode's history where two segments render it
    alike). Under a turn-level estimator (`Advantage.per_turn`) each row carries one advantage per
    token: the k-th run of loss_mask == 1 of the episode gets the k-th turn's."""
    rows = []
    for t in trajectories:
        adv = advantages.get(t.id)
        if adv is None:
            continue
        turn = 0  # the episode's index of the segment's first sampled turn
        for seg in t.segments:
            n = seg.num_turns
            if seg.num_sampled:
                per_turn = None if adv.per_turn is None else adv.per_turn[turn : turn + n]
                rows.append(
                    TrainingRow(
                        t.id,
                        t.group_id,
                        seg.token_ids,
                        seg.loss_mask,
                        seg.logprobs,
                        adv.value,
                        None if per_turn is None else token_advantages(seg.loss_mask, per_turn),
                    )
                )
            turn += n
    return rows


def token_advantages(loss_mask: Sequence[int], per_turn: Sequence[float]) -> tuple[float, ...]:
    """One advantage per token: the k-th run of loss_mask == 1 gets `per_turn[k]`, tokens the
    loss ignores 0."""
    mask = np.asarray(loss_mask, dtype=bool)
    starts = mask & ~np.concatenate([[False], mask[:-1]])  # the first token of each turn
    if int(starts.sum()) != len(per_turn):
        raise ValueError(f"{int(starts.sum())} sampled turns but {len(per_turn)} turn advantages")
    turn_of_token = np.cumsum(starts) - 1
    per_turn_arr = np.asarray(per_turn, dtype=np.float32)
    values = np.where(mask, per_turn_arr[np.clip(turn_of_token, 0, None)], np.float32(0.0))
    return tuple(values.tolist())


def _common_prefix(seqs: Sequence[np.ndarray]) -> int:
    n = min(len(s) for s in seqs)
    same_B = np.logical_and.reduce([s[:n] == seqs[0][:n] for s in seqs[1:]])
    return n if same_B.all() else int(np.argmin(same_B))


def _groups(seqs: Sequence[TrainingRow], mode: PackingMode) -> list[tuple[list[int], int]]:
    """(members, shared prefix length) of every unit-to-be: a GRPO group with its common prefix
    under `shared_prefix`, else (and for a group with nothing to share) each trajectory alone
    with 0."""
    if mode != "shared_prefix":
        return [([i], 0) for i in range(len(seqs))]
    by_id: dict[str, list[int]] = defaultdict(list)
    for i, t in enumerate(seqs):
        by_id[t.group_id].append(i)
    out = []
    for members in by_id.values():
        # Every member keeps >= 1 token of its own, so each has a row position after the prefix.
        n = min(len(seqs[i].token_ids) for i in members)
        P = min(_common_prefix([np.asarray(seqs[i].token_ids[:n]) for i in members]), n - 1)
        out += [(members, P)] if len(members) > 1 and P >= 1 else [([i], 0) for i in members]
    return out


def _units(
    seqs: Sequence[TrainingRow], groups: list[tuple[list[int], int]], budget: int
) -> list[_Unit]:
    """A unit must sit in one row; a group longer than `budget` is split, each part with its own
    copy of the prefix (shortest members first)."""
    units = []
    for members, P in groups:
        lens = {i: len(seqs[i].token_ids) for i in members}
        if not P:
            units.append(_Unit(members, 0, lens[members[0]]))
            continue
        cur: list[int] = []
        size = P
        for i in sorted(members, key=lambda i: lens[i]):
            if cur and size + lens[i] - P > budget:
                units.append(_Unit(cur, P, size))
                cur, size = [], P
            cur.append(i)
            size += lens[i] - P
        units.append(_Unit(cur, P, size))
    return [
        u if len(u.members) > 1 else _Unit(u.members, 0, len(seqs[u.members[0]].token_ids))
        for u in units
    ]


def _first_fit_decreasing(units: list[_Unit], capacity: int) -> list[list[_Unit]]:
    rows: list[list[_Unit]] = []
    free: list[int] = []
    for u in sorted(units, key=lambda u: -u.length):
        for r, room in enumerate(free):
            if u.length <= room:
                rows[r].append(u)
                free[r] -= u.length
                break
        else:
            rows.append([u])
            free.append(capacity - u.length)
    return rows


def make_micro_batches(
    rows: Sequence[TrainingRow],
    token_budget: int,
    pad_id: int = 0,
    *,
    mode: PackingMode = "shared_prefix",
    one_row: bool = False,
    row_tokens: int | Literal["auto"] | None = None,
    pair_cost: float = 0.0,
) -> list[TrainBatch]:
    """Split one step's training rows into micro-batches of about `token_budget` token slots.

    `padded`: rows sorted by length, as many per micro-batch as fit padded (a sequence longer than
    the budget gets a micro-batch of its own). `packed` / `shared_prefix`: units (sequences, or
    a group's prefix + continuations) are bin-packed into rows as long as the longest unit, and
    `token_budget // row_length` rows make a micro-batch. `row_tokens` (shared_prefix): the longest
    a group's unit may be; longer groups are split, each piece with its own copy of the prefix;
    None = the budget; "auto" = the cap whose modelled cost for `pair_cost` is least
    (`_cheapest_plan`). `one_row`: each micro-batch is a single row of up to `token_budget` tokens
    with no mask (flash-attention varlen; not with `shared_prefix`). A `TrainingRow` has at least
    one loss token and none at position 0 (checked when it is made).
    """
    if mode not in PACKING_MODES:
        raise ValueError(f"unknown packing mode {mode!r}; valid: {list(PACKING_MODES)}")
    if one_row and mode == "shared_prefix":
        raise ValueError("one_row (flash varlen) cannot express a shared prefix; use mode='packed'")
    if not rows:
        return []
    groups = _groups(rows, mode)
    if row_tokens == "auto":
        plan = _cheapest_plan(rows, groups, token_budget, pair_cost, mode, one_row)[1]
    else:
        plan = _plan(rows, groups, token_budget, mode, one_row, row_tokens)
    needs_mask = mode != "padded" and not one_row
    return [_build(rows, b, pad_id, needs_mask) for b in plan]


def _plan(
    seqs: Sequence[TrainingRow],
    groups: list[tuple[list[int], int]],
    budget: int,
    mode: PackingMode,
    one_row: bool,
    row_tokens: int | None,
) -> list[list[list[_Unit]]]:
    """Micro-batches, each a list of rows, each a list of units."""
    units = _units(seqs, groups, min(budget, row_tokens or budget))
    if mode == "padded":
        batches: list[list[list[_Unit]]] = []
        cur: list[list[_Unit]] = []
        for u in sorted(units, key=lambda u: u.length):  # ascending: the newest row is the longest
            if cur and (len(cur) + 1) * u.length > budget:
                batches.append(cur)
                cur = []
            cur.append([u])
        batches.append(cur)
        return batches
    longest = max(u.length for u in units)
    rows = _first_fit_decreasing(units, max(budget, longest) if one_row else longest)
    per_batch = 1 if one_row else max(1, budget // longest)
    return [rows[i : i + per_batch] for i in range(0, len(rows), per_batch)]


def attention_pair_cost(config) -> float:
    """What one (query, key) pair of attention costs, relative to one token's matmuls, for a
    transformers decoder config: QK^T and AV take 2 * heads * head_dim multiply-adds per pair; a
    token's q/k/v/o projections and gated MLP take h * (2 * heads + 2 * kv_heads) * head_dim +
    3 * h * ff (the layer count cancels; the LM head runs on loss tokens only and is left out).
    Under a 4D mask every pair of a row is computed, so a token in a row of T costs about
    `1 + r * T`. SmolLM2-135M: r = 3.3e-4 (attention equals the matmuls at T ~ 3000); Qwen2-0.5B:
    1.2e-4. 0.0 for a config without these fields (rows are then as long as the budget allows)."""
    h = getattr(config, "hidden_size", None)
    heads = getattr(config, "num_attention_heads", None)
    if not h or not heads:
        return 0.0
    head_dim = getattr(config, "head_dim", None) or h // heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    ff = getattr(config, "intermediate_size", None) or 4 * h
    return 2 * heads * head_dim / (h * (2 * heads + 2 * kv) * head_dim + 3 * h * ff)


def _cheapest_plan(
    seqs: Sequence[TrainingRow],
    groups: list[tuple[list[int], int]],
    budget: int,
    pair_cost: float,
    mode: PackingMode,
    one_row: bool,
) -> tuple[int | None, list[list[list[_Unit]]]]:
    """(cap, plan): the group-unit cap whose plan costs least (`row_tokens="auto"`), in units of
    one token's matmuls: every micro-batch of B rows of T slots costs B * T * (1 + pair_cost * T).
    Each plan is built once; cap None = no cap.

    Sharing a group's prompt saves (G - 1) * prompt tokens but makes one row of the whole group, and
    under a mask attention costs the square of the row: python_math-shaped groups (8 x ~870 tokens,
    a 250-token prompt) become 5311-token rows, where SmolLM2's attention is 1.7x its matmuls. At
    8192 slots the cap chosen here gives rows of <= 1907 tokens, each prompt computed 4 times
    instead of once (the modeled and measured step times: docs/performance.md).
    Candidates run from the longest trajectory to the longest unit the budget allows, in steps of
    1.25x. None (no cap) outside `shared_prefix`, with `one_row`, or when pair_cost is 0, where
    nothing is gained by splitting."""
    whole = _plan(seqs, groups, budget, mode, one_row, None)
    if mode != "shared_prefix" or one_row or pair_cost <= 0:
        return None, whole

    def cost(plan: list[list[list[_Unit]]]) -> float:
        total = 0.0
        for rows in plan:
            T = max(sum(u.length for u in row) for row in rows)
            total += len(rows) * T * (1 + pair_cost * T)
        return total

    longest_unit = max(u.length for rows in whole for row in rows for u in row)
    best: tuple[float, int | None, list[list[list[_Unit]]]] = (cost(whole), None, whole)
    cap = float(max(len(t.token_ids) for t in seqs))
    while (
        cap < longest_unit
    ):  # ties go to the larger cap (fewer prompt copies): later ones must beat it
        plan = _plan(seqs, groups, budget, mode, False, int(cap))
        if (c := cost(plan)) < best[0] or (
            c == best[0] and best[1] is not None and int(cap) > best[1]
        ):
            best = (c, int(cap), plan)
        cap *= 1.25
    return best[1], best[2]


def _build(
    seqs: Sequence[TrainingRow],
    rows: list[list[_Unit]],
    pad_id: int,
    needs_mask: bool,
) -> TrainBatch:
    # numpy throughout (torch.tensor on Python lists is the slow part at GPU batch sizes).
    R = len(rows)
    S = max(sum(u.length for u in row) for row in rows)
    ids_RS = np.full((R, S), pad_id, dtype=np.int64)
    pos_RS = np.tile(np.arange(S), (R, 1))  # row tails keep counting: they are one causal segment
    seg_RS = np.zeros((R, S), dtype=np.int64)  # 0 = row tail
    vis_RS = np.zeros((R, S), dtype=np.int64)
    members = [i for row in rows for u in row for i in u.members]
    masks = {i: np.asarray(seqs[i].loss_mask, dtype=bool) for i in members}
    loss_pos = {i: np.flatnonzero(masks[i]) for i in members}  # positions j of the loss tokens
    B, T = len(members), max(int(p[-1] - p[0]) + 1 for p in loss_pos.values())
    loss_mask_BT = np.zeros((B, T), dtype=np.float32)
    rollout_BT = np.zeros((B, T), dtype=np.float32)
    per_turn = any(seqs[i].token_advantages is not None for i in members)
    adv_BT = np.zeros((B, T), dtype=np.float32) if per_turn else None
    pred, target, dest = [], [], []
    n = 0
    for b, row in enumerate(rows):
        start, seg = 0, 0
        for u in row:
            P = u.prefix_len
            if P:
                seg += 1
                prefix_seg = seg
                ids_RS[b, start : start + P] = seqs[u.members[0]].token_ids[:P]
                pos_RS[b, start : start + P] = np.arange(P)
                seg_RS[b, start : start + P] = vis_RS[b, start : start + P] = prefix_seg
            at = start + P
            for i in u.members:
                t = seqs[i]
                tokens = np.asarray(t.token_ids, dtype=np.int64)
                own = len(tokens) - P
                seg += 1
                ids_RS[b, at : at + own] = tokens[P:]
                pos_RS[b, at : at + own] = np.arange(P, P + own)
                seg_RS[b, at : at + own] = seg
                vis_RS[b, at : at + own] = prefix_seg if P else seg
                # row position of each token j of this trajectory: the prefix, then its own part
                where = np.concatenate([np.arange(start, start + P), np.arange(at, at + own)])
                j_M = loss_pos[i]
                lo, hi = int(j_M[0]), int(j_M[-1])
                pred.append(b * S + where[j_M - 1])
                target.append(tokens[j_M])
                dest.append(n * T + (j_M - lo))
                loss_mask_BT[n, : hi - lo + 1] = masks[i][lo : hi + 1]
                rollout_BT[n, : hi - lo + 1] = np.asarray(t.logprobs[lo : hi + 1], dtype=np.float32)
                if adv_BT is not None:
                    adv_BT[n, : hi - lo + 1] = _per_token(t)[lo : hi + 1]
                at += own
                n += 1
            start = at
    t = torch.from_numpy
    return TrainBatch(
        input_ids_RS=t(ids_RS),
        position_ids_RS=t(pos_RS),
        segment_ids_RS=t(seg_RS),
        visible_ids_RS=t(vis_RS),
        pred_index_M=t(np.concatenate(pred)),
        target_ids_M=t(np.concatenate(target)),
        dest_index_M=t(np.concatenate(dest)),
        loss_mask_BT=t(loss_mask_BT),
        rollout_logprobs_BT=t(rollout_BT),
        advantages_B=torch.tensor([seqs[i].advantage for i in members]),
        rows=members,
        needs_mask=needs_mask,
        token_advantages_BT=None if adv_BT is None else t(adv_BT),
    )


def _per_token(row: TrainingRow) -> np.ndarray:
    """[len(token_ids)] float32: each token's advantage, 0 on tokens the loss ignores."""
    if row.token_advantages is not None:
        return np.asarray(row.token_advantages, dtype=np.float32)
    return np.where(np.asarray(row.loss_mask, dtype=bool), np.float32(row.advantage), np.float32(0))


def balanced_parts(
    seqs: Sequence[TrainingRow], k: int, *, exactly_k: bool = False
) -> list[list[int]]:
    """Indices of the trajectories in each of `k` parts (the step's mini-batches, or its ranks):
    whole groups, balanced by tokens (`len(token_ids)`).

    Whole groups: a group's advantages sum to 0 (grpo, dr_grpo, rloo), so each optimizer step gets
    a baseline-centred gradient, and shared-prefix packing still computes a group's prompt once.
    (verl cuts each rank's batch by position, `data.split(ppo_mini_batch_size)`, sized in prompts
    x n but not checked to keep groups whole; TRL shuffles its generation batch and cuts it into
    `steps_per_generation` pieces, so groups straddle.) The largest group goes to the lightest part.
    Fewer groups than `k`: fewer parts, rather than an optimizer step on nothing; with `exactly_k`
    (ranks, which all take part in every step), single trajectories are dealt instead, and a part
    may be empty. Not shuffled: the partition is a function of the list alone (every rank, and a
    resume, get the same) and ignores arrival order.
    """
    groups: dict[str, list[int]] = defaultdict(list)
    for i, t in enumerate(seqs):
        groups[t.group_id].append(i)
    units = list(groups.values())
    if len(units) < k:
        if exactly_k:
            units = [[i] for i in range(len(seqs))]
        else:
            k = len(units)
    load, parts = [0] * k, [[] for _ in range(k)]
    for members in sorted(units, key=lambda g: (-sum(len(seqs[i].token_ids) for i in g), g[0])):
        j = min(range(k), key=lambda j: (load[j], j))
        parts[j] += members
        load[j] += sum(len(seqs[i].token_ids) for i in members)
    return [sorted(p) for p in parts]
