"""The scheduler of every `max_staleness` (`agentgrpo.run.pipeline`): no group trained beyond k
updates, none lost or trained twice, slow groups moved back rather than dropped, dynamic sampling
within its budget, and no group sampled before a checkpoint trained after it."""

import asyncio
import itertools
import random

import pytest

from agentgrpo.run.pipeline import StalenessPipeline, Ticket


def positions(start=0):
    counter = itertools.count(start)
    return lambda: next(counter)


async def learn(pipe, steps, *, first=0, train_s=0.0, trained=None):
    """The learner's side: take, 'train', advance; returns [(step, ticket values)]."""
    trained = [] if trained is None else trained
    pipe.start()
    try:
        for step in range(first, steps):
            groups = (await pipe.take(step)).groups
            trained.append((step, groups))
            await asyncio.sleep(train_s)
            await pipe.settle(step + 1)
            pipe.advance(step + 1)
    finally:
        await pipe.close()
    return trained


def sampler(durations, *, log=None):
    """produce(): sleeps the position's duration, returns (position, version at admission)."""

    async def produce(t: Ticket):
        if log is not None:
            log.append(("start", t.position, t.version))
        await asyncio.sleep(durations(t.position))
        return (t.position, t.version)

    return produce


@pytest.mark.parametrize("k", [0, 1, 2, 4])
@pytest.mark.parametrize("seed", range(5))
def test_no_group_is_trained_beyond_k_and_none_is_lost_or_trained_twice(k, seed):
    """Heavy-tailed episode times (a few 30x the median) and instant 'server failures': every
    trained group's lag (step - version it started at) is <= k, and the positions trained are
    0..n-1, each once."""
    rng = random.Random(seed)
    times = {}

    def duration(p):
        if p not in times:
            r = rng.random()
            times[p] = 0.0 if r < 0.1 else 0.03 if r > 0.92 else rng.uniform(0.0005, 0.003)
        return times[p]

    steps, per_step = 12, 3
    pipe = StalenessPipeline(
        sampler(duration), positions(), per_step=per_step, max_staleness=k, steps=steps
    )
    trained = asyncio.run(learn(pipe, steps, train_s=0.002))
    lags = [step - v for step, groups in trained for _, v in groups]
    assert max(lags) <= k
    got = sorted(p for _, groups in trained for p, _ in groups)
    assert got == list(range(steps * per_step))
    assert all(len(groups) == per_step for _, groups in trained)


def test_k_0_is_the_synchronous_loop():
    log = []
    pipe = StalenessPipeline(
        sampler(lambda p: 0.001, log=log), positions(), per_step=2, max_staleness=0, steps=3
    )
    trained = asyncio.run(learn(pipe, 3))
    # each step's two groups start at that step's version, none before the learner gets there
    assert [(p, v) for _, p, v in log] == [(0, 0), (1, 0), (2, 1), (3, 1), (4, 2), (5, 2)]
    assert [sorted(g) for _, g in trained] == [[(0, 0), (1, 0)], [(2, 1), (3, 1)], [(4, 2), (5, 2)]]


def test_a_slow_group_moves_back_to_its_deadline_and_the_learner_waits_only_then():
    """Position 0 is slow: steps 0 and 1 train faster groups in its place; step 2 (its deadline
    with k = 2) waits for it. It is trained, not dropped."""
    pipe = StalenessPipeline(
        sampler(lambda p: 0.3 if p == 0 else 0.001),
        positions(),
        per_step=1,
        max_staleness=2,
        steps=4,
    )
    trained = asyncio.run(learn(pipe, 4))
    by_step = {step: groups for step, groups in trained}
    assert by_step[2] == [(0, 0)]  # lag 2 = k
    assert (0, 0) not in by_step[0] + by_step[1] + by_step[3]


def test_without_trades_every_group_is_trained_in_the_slot_it_was_admitted_for():
    """trade=False (deterministic runs): the slow position 0 holds step 0 instead of moving back,
    and every step trains the positions admitted for it, whatever finished first."""
    pipe = StalenessPipeline(
        sampler(lambda p: 0.1 if p == 0 else 0.001),
        positions(),
        per_step=1,
        max_staleness=2,
        steps=4,
        trade=False,
    )
    trained = asyncio.run(learn(pipe, 4))
    assert [groups for _, groups in trained] == [[(0, 0)], [(1, 0)], [(2, 0)], [(3, 1)]]


def test_the_producer_keeps_k_plus_one_steps_of_groups_ahead_and_no_more():
    pipe = StalenessPipeline(
        sampler(lambda p: 10.0), positions(), per_step=2, max_staleness=3, steps=100
    )

    async def main():
        pipe.start()
        await asyncio.sleep(0.05)
        n = pipe.in_flight()
        await pipe.close()
        return n

    assert asyncio.run(main()) == 2 * (3 + 1)


def test_rejected_groups_are_replaced_up_to_max_replaced_per_step():
    """keep() rejects even positions: their slots are filled again; with max_replaced=1 a step
    replaces one rejected group, and the next rejection shrinks it: it trains on fewer groups."""
    keep = lambda g: g[0] % 2 == 1  # noqa: E731
    pipe = StalenessPipeline(
        sampler(lambda p: 0.001), positions(), per_step=2, max_staleness=0, steps=3, keep=keep
    )
    trained = asyncio.run(learn(pipe, 3))
    assert [len(g) for _, g in trained] == [2, 2, 2]
    assert all(p % 2 == 1 for _, g in trained for p, _ in g)
    assert pipe.rejected == 6

    for finish_first in (0, 1):  # the same positions, whichever rejection is judged first
        log = []
        pipe = StalenessPipeline(
            sampler(lambda p, f=finish_first: 0.001 if p == f else 0.01, log=log),
            positions(),
            per_step=2,
            max_staleness=0,
            steps=1,
            keep=lambda g: g[0] >= 2,  # 0 and 1 rejected, 2 kept
            max_replaced=1,
        )
        taken = asyncio.run(take_first(pipe))
        assert [p for p, _ in taken.groups] == [2]
        assert (taken.rejected, taken.replaced) == (2, 1)
        assert sorted(p for _, p, _ in log) == [0, 1, 2]


async def take_first(pipe):
    pipe.start()
    try:
        return await pipe.take(0)
    finally:
        await pipe.close()


def test_a_group_is_judged_before_it_is_trained():
    """Group 1 finishes on the tick that runs group 0's done-callback, which wakes the learner:
    the learner must not take group 1 before keep() judged it (its job is done by then, its own
    callback not yet run)."""
    tickets = {}

    async def produce(t):
        tickets[t.position] = t
        if t.position == 1:
            await tickets[0].job  # woken right after group 0's callback, on the same tick
        else:
            await asyncio.sleep(0.01)
        return (t.position, t.version)

    pipe = StalenessPipeline(
        produce,
        positions(),
        per_step=2,
        max_staleness=0,
        steps=1,
        keep=lambda g: g[0] != 1,
        max_replaced=0,
    )
    taken = asyncio.run(take_first(pipe))
    assert [p for p, _ in taken.groups] == [0]
    assert (taken.rejected, taken.replaced) == (1, 0)


@pytest.mark.parametrize("k", [1, 2])
def test_settle_waits_for_the_groups_the_next_step_needs_and_no_others(k):
    """Before the push for step s + 1 the learner waits for the groups whose deadline is s + 1,
    so they never sample across it: at k = 1 every group in flight; at k = 2 younger ones (a
    deadline after s + 1) sample on."""
    in_flight_at_push = []

    async def main():
        pipe = StalenessPipeline(
            sampler(lambda p: 0.1 if p % 4 == 3 else 0.001),
            positions(),
            per_step=2,
            max_staleness=k,
            steps=6,
        )
        pipe.start()
        try:
            for step in range(6):
                await pipe.take(step)
                await pipe.settle(step + 1)
                late = [t for t in pipe.tickets if not t.finished]
                assert all(t.deadline > step + 1 for t in late)
                in_flight_at_push.append(len(late))
                pipe.advance(step + 1)
        finally:
            await pipe.close()

    asyncio.run(main())
    assert (max(in_flight_at_push) == 0) == (k == 1)


def test_a_planned_checkpoint_fences_the_slots_after_it():
    """save_every = 2 with k = 1: nothing is admitted for step 2 before the learner is at 2, so
    steps 0 and 2 train groups of their own weights (lag 0) and steps 1 and 3 lag 1."""
    pipe = StalenessPipeline(
        sampler(lambda p: 0.001),
        positions(),
        per_step=2,
        max_staleness=1,
        steps=4,
        fenced=lambda step: (step + 1) % 2 == 0,
    )
    trained = asyncio.run(learn(pipe, 4, train_s=0.01))
    assert [max(step - v for _, v in g) for step, g in trained] == [0, 1, 0, 1]
    assert sorted(p for _, g in trained for p, _ in g) == list(range(8))


def test_an_unplanned_checkpoint_withdraws_the_groups_sampled_ahead():
    """fence(step) after take(step): the groups admitted for later steps are cancelled and
    admitted again first, with the next weights; pending() meanwhile lists them, in order."""
    log = []
    pipe = StalenessPipeline(
        sampler(lambda p: 0.001, log=log), positions(), per_step=2, max_staleness=2, steps=4
    )

    async def main():
        pipe.start()
        try:
            first = (await pipe.take(0)).groups
            await asyncio.sleep(0.02)  # steps 1 and 2's groups are admitted and finished
            assert len(pipe.tickets) == 4
            withdrawn = pipe.fence(0)
            assert withdrawn == pipe.pending() == [2, 3, 4, 5]
            await asyncio.sleep(0.02)
            assert pipe.in_flight() == 0 and not pipe.tickets  # nothing admitted past the fence
            pipe.advance(1)
            rest = [(await pipe.take(1)).groups]
            return first, rest
        finally:
            await pipe.close()

    first, rest = asyncio.run(main())
    assert [v for _, v in first] == [0, 0]
    assert rest == [[(2, 1), (3, 1)]]  # re-sampled after the fence, with the weights it saves
    assert [(p, v) for _, p, v in log[6:10]] == [(2, 1), (3, 1), (4, 1), (5, 1)]


def test_a_stop_and_resume_re_admits_the_pending_groups_first_and_loses_none():
    """Stop after step 2 of 6 with groups in flight and finished ahead; a new pipeline resumed
    from `pending()` and the stream position trains the rest: every position once overall."""
    duration = lambda p: 0.02 if p % 3 == 0 else 0.001  # noqa: E731
    next_new = positions()
    pipe = StalenessPipeline(sampler(duration), next_new, per_step=2, max_staleness=2, steps=6)
    first = asyncio.run(learn(pipe, 3))  # steps 0, 1, 2
    pending, stream_at = pipe.pending(), next_new()
    assert pending and len(pending) == len(set(pending))
    log = []
    resumed = StalenessPipeline(
        sampler(duration, log=log),
        positions(stream_at),
        per_step=2,
        max_staleness=2,
        steps=6,
        version=3,
        resume=pending,
    )
    second = asyncio.run(learn(resumed, 6, first=3))
    assert [p for _, p, _ in log[: len(pending)]] == pending  # the pending ones come first
    # what the interrupted run admitted but never trained is trained after resuming, and the
    # stream goes on where it stopped: positions 0..11 once each, as in an uninterrupted run
    assert sorted(p for _, g in first + second for p, _ in g) == list(range(12))
    assert all(step - v <= 2 for step, g in second for _, v in g if v >= 3)


def test_take_raises_what_sampling_raised():
    async def produce(t):
        raise RuntimeError("rollout bug")

    pipe = StalenessPipeline(produce, positions(), per_step=1, max_staleness=2, steps=3)
    with pytest.raises(RuntimeError, match="rollout bug"):
        asyncio.run(learn(pipe, 3))


def test_take_refuses_a_step_the_learner_is_not_at():
    pipe = StalenessPipeline(
        sampler(lambda p: 0.0), positions(), per_step=1, max_staleness=1, steps=3
    )
    with pytest.raises(ValueError, match=r"take\(1\) while the learner is at version 0"):
        asyncio.run(pipe.take(1))
