"""Rubric: validation at construction, weighted sums by hand, NaN propagation, async and groups."""

from __future__ import annotations

import asyncio
import math

import pytest

from agentgrpo.env.rubric import Rubric, Verifier, VerifierResult
from agentgrpo.types import Message, StopReason, Task, Trajectory

TASK = Task(id="t", prompt="2+2?", answer="4")


def traj(text: str) -> Trajectory:
    msgs = [Message(role="user", content="2+2?"), Message(role="assistant", content=text)]
    return Trajectory("t", [1, 2, 3], [0, 1, 1], [0.0, -0.1, -0.2], 1, msgs, StopReason.COMPLETED)


def correct(trajectory, task) -> float:
    return float(trajectory.messages[-1].content.strip() == task.answer)


def has_digit(trajectory, task) -> bool:
    return any(c.isdigit() for c in trajectory.messages[-1].content)


async def length_penalty(trajectory, task) -> VerifierResult:
    n = trajectory.num_sampled
    return VerifierResult(score=-float(n), detail=f"{n} sampled tokens")


def unscorable(trajectory, task) -> float:
    return math.nan


def broken(trajectory, task) -> float:
    raise ConnectionError("sandbox down")


def test_weighted_sum_by_hand():
    r = Rubric([("correct", correct, 1.0), ("digit", has_digit, 0.5), ("len", length_penalty, 0.1)])
    res = asyncio.run(r.ascore(traj("4"), TASK))
    # 1.0*1 + 0.5*1 + 0.1*(-2) = 1.3
    assert res.score == pytest.approx(1.3)
    assert res.parts == {"correct": 1.0, "digit": 1.0, "len": -2.0}
    assert "len: 2 sampled tokens" in res.detail
    res = r.score(traj("five"), TASK)  # sync entry point: 0 + 0 + 0.1*(-2)
    assert res.score == pytest.approx(-0.2)


def test_normalize_divides_by_total_abs_weight():
    r = Rubric([("correct", correct, 3.0), ("digit", has_digit, -1.0)], normalize=True)
    # (3*1 + -1*1) / 4 = 0.5
    assert r.score(traj("4"), TASK).score == pytest.approx(0.5)


def test_nan_propagates_and_errors_are_unscorable_not_zero():
    r = Rubric([("correct", correct, 1.0), ("nan", unscorable, 0.2)])
    res = r.score(traj("4"), TASK)
    assert math.isnan(res.score) and res.unscorable and res.parts["correct"] == 1.0
    r = Rubric([("correct", correct, 1.0), ("sandbox", broken, 1.0)])
    res = r.score(traj("4"), TASK)
    assert math.isnan(res.score) and "sandbox: ConnectionError: sandbox down" in res.detail
    # a zero weight switches a verifier off, NaN included
    assert (
        Rubric([("correct", correct, 1.0), ("nan", unscorable, 0.0)]).score(traj("4"), TASK).score
        == 1.0
    )
    with pytest.raises(ConnectionError):
        Rubric([("sandbox", broken, 1.0)], strict=True).score(traj("4"), TASK)


@pytest.mark.parametrize(
    ("verifiers", "error"),
    [
        ([], "at least one"),
        ([("a", correct)], "tuples"),
        ([("", correct, 1.0)], "non-empty"),
        ([("a", correct, 1.0), ("a", has_digit, 1.0)], "duplicate"),
        ([("a", "not callable", 1.0)], "not callable"),
        ([("a", lambda t: 1.0, 1.0)], "accept \\(trajectory, task\\)"),
        ([("a", correct, float("nan"))], "finite"),
        ([("a", correct, True)], "finite"),
        ([("a", correct, 0.0)], "all Rubric weights are zero"),
    ],
)
def test_validated_at_construction(verifiers, error):
    with pytest.raises((ValueError, TypeError), match=error):
        Rubric(verifiers)


def test_wrong_return_type_is_a_bug():
    r = Rubric([("a", lambda t, k: "1.0", 1.0)])
    with pytest.raises(TypeError, match="returned str"):
        r.score(traj("4"), TASK)


def test_an_infinite_score_is_a_bug_named_at_its_verifier():
    # it used to pass through and fail later in compute_advantages, naming no verifier
    for value in (math.inf, VerifierResult(-math.inf)):
        r = Rubric([("ok", lambda t, k: 1.0, 1.0), ("runaway", lambda t, k, v=value: v, 0.5)])
        with pytest.raises(
            ValueError, match="verifier 'runaway' returned -?inf; a score must be finite"
        ):
            r.score(traj("4"), TASK)


def test_group_hook_and_concurrency():
    calls = []

    async def slow(trajectory, task) -> float:
        calls.append(trajectory.messages[-1].content)
        await asyncio.sleep(0.2)
        return correct(trajectory, task)

    def rank_bonus(trajectories, task, results):  # e.g. a within-group term
        return [
            VerifierResult(r.score + 0.01 * i, r.detail, r.parts) for i, r in enumerate(results)
        ]

    r = Rubric([("slow", slow, 1.0)], group_hook=rank_bonus)

    async def main():
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        res = await r.ascore_group([traj("4"), traj("3"), traj("4")], TASK)
        return res, loop.time() - t0

    res, elapsed = asyncio.run(main())
    assert [x.score for x in res] == pytest.approx([1.0, 0.01, 1.02])
    assert elapsed < 0.5  # three 0.2 s verifiers ran concurrently
    bad = Rubric([("a", correct, 1.0)], group_hook=lambda t, k, rs: rs[:1])
    with pytest.raises(TypeError, match="one VerifierResult per trajectory"):
        asyncio.run(bad.ascore_group([traj("4"), traj("4")], TASK))


def test_sync_score_inside_loop_refuses():
    r = Rubric([("correct", correct, 1.0)])

    async def main():
        with pytest.raises(RuntimeError, match="ascore"):
            r.score(traj("4"), TASK)

    asyncio.run(main())


def test_rubric_nests_and_is_a_verifier():
    inner = Rubric([("correct", correct, 1.0)])
    outer = Rubric([("inner", inner, 2.0), ("digit", has_digit, 1.0)])
    assert isinstance(inner, Verifier)
    assert outer.score(traj("4"), TASK).score == pytest.approx(3.0)
