"""math_equal: answer formats, thread/asyncio safety and the hard time limit."""

from __future__ import annotations

import asyncio
import math
import threading
import time

import pytest

from agentgrpo.types import Message, StopReason, Task, Trajectory
from agentgrpo.verify.math import MathPool, MathVerifier, amath_equal, math_equal


@pytest.fixture(scope="module")
def pool():
    p = MathPool(workers=2)
    p.warm()
    yield p
    p.close()


@pytest.mark.parametrize(
    ("prediction", "answer", "expected"),
    [
        ("The answer is \\boxed{\\frac{1}{2}}", "0.5", True),  # boxed fraction vs decimal
        ("0.5", "\\frac{1}{2}", True),
        ("1/2", "$\\frac12$", True),
        ("\\boxed{\\dfrac{3}{4}}", "0.75", True),
        ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", True),  # symbolic, bare LaTeX reference
        ("The final answer is $\\pi$", "\\pi", True),
        ("\\boxed{50\\%}", "0.5", True),
        ("x^2+2x+1", "(x+1)^2", True),
        ("\\boxed{x=2}", "2", True),
        ("\\boxed{\\{1,2\\}}", "\\{1, 2\\}", True),
        ("the answer: 1,000", "1000", True),
        (
            "We get 3. So the final answer is \\boxed{5}",
            "5",
            True,
        ),  # the box wins over other numbers
        ("\\boxed{3} or \\boxed{5}", "5", False),  # boxing several answers is a set: no hedging
        ("\\boxed{2}", "3", False),
        ("answer is 0.333", "1/3", False),  # not within rounding
        ("", "3", False),
        ("\\boxed{3}", "", False),  # nothing to compare against
        ("no number at all", "7", False),
    ],
)
def test_formats(pool, prediction, answer, expected):
    assert pool.equal(prediction, answer) is expected


def test_from_threads_and_asyncio():
    # math-verify's own SIGALRM timeouts raise off the main thread; ours must not
    results, errors = [], []

    def work(i: int) -> None:
        try:
            results.append(math_equal(f"\\boxed{{{i}/4}}", str(i / 4)))
        except Exception as e:  # noqa: BLE001 - collected and asserted below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and results == [True] * 12

    async def many():
        return await asyncio.gather(*(amath_equal(f"{i} + 1", str(i + 1)) for i in range(8)))

    assert asyncio.run(many()) == [True] * 8


def test_runaway_input_is_cut_off_and_pool_recovers():
    p = MathPool(workers=1)
    p.warm()
    try:
        t0 = time.monotonic()
        assert p.equal("\\boxed{10^{10^{10^{10}}}}", "1", timeout_s=1.0) is False
        assert time.monotonic() - t0 < 2.5
        assert p.timeouts == 1
        assert p.equal("\\boxed{4}", "4.0", timeout_s=60) is True  # a fresh worker took over
    finally:
        p.close()


def test_cache_returns_same_answer_fast(pool):
    pool.equal("\\boxed{\\frac{22}{7}}", "22/7")
    t0 = time.monotonic()
    assert pool.equal("\\boxed{\\frac{22}{7}}", "22/7") is True
    assert time.monotonic() - t0 < 0.01


def _traj(text: str) -> Trajectory:
    msgs = [Message(role="user", content="q"), Message(role="assistant", content=text)]
    return Trajectory("t", [1], [0], [0.0], 1, msgs, StopReason.COMPLETED)


def test_math_verifier(pool):
    v = MathVerifier(pool=pool)
    assert v(_traj("so \\boxed{12}"), Task(id="a", prompt="q", answer=12)) == 1.0
    assert v(_traj("so \\boxed{13}"), Task(id="a", prompt="q", answer="12")) == 0.0
    assert math.isnan(v(_traj("\\boxed{1}"), Task(id="a", prompt="q")))  # no reference: unscorable
