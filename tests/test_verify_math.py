"""math_equal: answer formats, thread/asyncio safety, the CPU time limit (a runaway answer scores 0,
counted), and infrastructure failures (a worker that cannot start, dies or is starved) made
unscorable, never 0."""

from __future__ import annotations

import asyncio
import math
import os
import signal
import sys
import threading
import time

import pytest

from agentgrpo.types import Message, StopReason, Task, Trajectory
from agentgrpo.verify import math as math_mod
from agentgrpo.verify.math import (
    MathCheck,
    MathPool,
    MathVerifier,
    MathVerifyUnavailable,
    amath_equal,
    math_equal,
)


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
        # a reference with a decimal comma is a number, as math-verify reads it, not a set
        ("\\boxed{1.22}", "1,22", True),
        ("1.22", "1,22", True),
        ("\\boxed{-3.5}", "-3,5", True),
        ("\\boxed{\\{1, 22\\}}", "1,22", False),
        ("\\boxed{1000}", "1,000", True),
        ("\\boxed{\\{1, 22\\}}", "1, 22", True),  # with a space it stays a set
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


RUNAWAY = "\\boxed{10^{10^{10^{10}}}}"  # sympy computes this power until it is stopped


def test_runaway_input_is_cut_off_and_pool_recovers():
    # The answer's own doing: it burns its whole CPU budget, so it scores 0 (status "timeout",
    # counted). wall_factor is generous so a loaded test machine cannot turn this into "starved".
    p = MathPool(workers=1, wall_factor=10)
    p.warm()
    try:
        t0 = time.monotonic()
        res = p.check(RUNAWAY, "1", timeout_s=1.0)
        assert time.monotonic() - t0 < 10 * 1.0 + 1.0
        assert (res.equal, res.status) == (False, "timeout") and "CPU budget" in res.detail
        assert (p.timeouts, p.failures, p.unscorable) == (1, 0, 0)
        assert p.equal("\\boxed{4}", "4.0", timeout_s=60) is True  # a fresh worker took over
    finally:
        p.close()


def _worker_pids(p: MathPool) -> list[int]:
    return [w.proc.pid for w in list(p._idle.queue)]


@pytest.mark.parametrize("gone", [False, True])
def test_killed_idle_worker_is_retried_on_a_fresh_one(gone):
    # An infrastructure failure (OOM killer, a stray signal) is retried, not scored 0. `gone`: the
    # worker is dead before the request is written, so the write itself breaks (its buffered bytes
    # then broke the clean-up too, raising BrokenPipeError out of check()); else it may die after.
    p = MathPool(workers=1)
    p.warm()
    try:
        (worker,) = list(p._idle.queue)
        os.kill(worker.proc.pid, signal.SIGKILL)
        if gone:
            worker.proc.wait()
        assert p.check("\\boxed{\\frac{1}{2}}", "0.5") == MathCheck(True)
        assert (p.failures, p.unscorable, p.timeouts) == (1, 0, 0)
        assert p.equal("\\boxed{3}", "2") is False  # wrong answers are still 0
    finally:
        p.close()


def test_pool_that_cannot_start_is_unscorable(monkeypatch):
    p = MathPool(workers=1)
    monkeypatch.setattr(sys, "executable", "/nonexistent/python3")  # every worker fails to start
    with pytest.raises(MathVerifyUnavailable, match="could not start a worker.*FileNotFoundError"):
        p.check("\\boxed{2}", "3")
    assert (p.failures, p.unscorable) == (2, 1)  # tried, retried, given up
    with pytest.raises(MathVerifyUnavailable):
        p.warm()  # fails at start-up, loudly
    res = MathVerifier(pool=p)(_traj("so \\boxed{2}"), Task(id="a", prompt="q", answer="3"))
    assert res.unscorable and "could not start" in res.detail  # NaN with why, never 0.0


DIE_ON_REQUEST = r"""
import json, os, struct, sys
data = json.dumps({"ready": True}).encode()
os.write(1, struct.pack("!I", len(data)) + data)
sys.stdin.buffer.read(4)
os._exit(9)
"""


def test_worker_dying_mid_request_is_retried_then_unscorable(monkeypatch):
    monkeypatch.setattr(math_mod, "_WORKER", DIE_ON_REQUEST)
    p = MathPool(workers=1)
    p.warm()
    with pytest.raises(MathVerifyUnavailable, match=r"tries: 2\).*exited \(code 9\)"):
        p.check("\\boxed{2}", "3")
    assert (p.failures, p.unscorable, p.timeouts) == (2, 1, 0)
    with pytest.raises(MathVerifyUnavailable):
        p.equal("\\boxed{2}", "2.0")  # equal() raises too: never a silent False
    p.close()


def test_worker_without_math_verify_says_why(monkeypatch):
    monkeypatch.setattr(
        math_mod,
        "_WORKER",
        math_mod._WORKER.replace(
            "from math_verify import", "from math_verify_not_installed import"
        ),
    )
    p = MathPool(workers=1)
    with pytest.raises(
        MathVerifyUnavailable, match="could not load math-verify: ModuleNotFoundError"
    ):
        p.warm()
    with pytest.raises(MathVerifyUnavailable, match="ModuleNotFoundError"):
        p.check("\\boxed{2}", "3")


@pytest.mark.skipif(not os.path.exists(f"/proc/{os.getpid()}/stat"), reason="needs /proc CPU times")
def test_starved_worker_is_unscorable_not_a_timeout():
    # A worker that gets no CPU (here: stopped, as on a host swapping or overloaded) says nothing
    # about the answer: unscorable, not the 0 a runaway answer gets, and not retried.
    p = MathPool(workers=1, wall_factor=4)
    p.warm()
    try:
        (pid,) = _worker_pids(p)
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(MathVerifyUnavailable, match="starved"):
            p.check("\\boxed{2}", "3", timeout_s=0.3)
        assert 0.3 * 4 <= time.monotonic() - t0 < 0.3 * 4 + 1.5
        assert (p.timeouts, p.failures, p.unscorable) == (0, 1, 1)
        assert p.equal("\\boxed{2}", "3") is False  # the stopped worker was replaced
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
    right = v(_traj("so \\boxed{12}"), Task(id="a", prompt="q", answer=12))
    assert (right.score, right.detail) == (1.0, "")
    assert v(_traj("so \\boxed{13}"), Task(id="a", prompt="q", answer="12")).score == 0.0
    no_ref = v(_traj("\\boxed{1}"), Task(id="a", prompt="q"))
    assert math.isnan(no_ref.score) and "no reference" in no_ref.detail  # unscorable


def test_math_verifier_names_a_timeout():
    p = MathPool(workers=1, wall_factor=10)
    try:
        res = MathVerifier(timeout_s=0.5, pool=p)(
            _traj(RUNAWAY), Task(id="a", prompt="q", answer="1")
        )
        assert res.score == 0.0 and res.detail.startswith("timeout: ") and p.timeouts == 1
    finally:
        p.close()
