"""Sandbox and verifier throughput, each against a baseline measured in the same run.

    python bench/sandbox.py [--n 200] [--backend auto] [--seconds 5] [--humaneval]

Prints, for the sandbox: p50/p95 latency of `print(1)` and of a typical unit-test job (a
5-assert sample through `run_tests`), and jobs/s with 2 and 8 concurrent callers; each next to
a plain `subprocess.run` of the same program without any isolation. For the math verifier:
pairs/s with one worker process and with one per CPU. Targets from the design issue: p50 under
5 ms for `print(1)` with full isolation, at least 100 jobs/s on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from agentgrpo.verify._local_client import _base_python  # noqa: E402
from agentgrpo.verify.code import _HARNESS, load_humaneval, run_tests, score_humaneval  # noqa: E402
from agentgrpo.verify.math import MathPool  # noqa: E402
from agentgrpo.verify.sandbox import Limits, Sandbox  # noqa: E402

SOLUTION = "def add(a, b):\n    return a + b\n"
TESTS = [f"assert add({i}, {i + 1}) == {2 * i + 1}" for i in range(5)]
PY = _base_python()


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000


def latency(fn, n: int) -> tuple[float, float]:
    for _ in range(min(10, n)):
        fn()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return pct(ts, 0.5), pct(ts, 0.95)


def throughput(fn, workers: int, seconds: float) -> float:
    stop = time.monotonic() + seconds
    counts = [0] * workers

    def loop(i: int) -> None:
        while time.monotonic() < stop:
            fn()
            counts[i] += 1

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(workers)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(counts) / (time.monotonic() - t0)


def plain_print() -> None:
    subprocess.run([PY, "-I", "-c", "print(1)"], capture_output=True, timeout=10, check=True)


def plain_tests() -> None:
    spec = {
        "solution": SOLUTION,
        "tests": [{"kind": "assert", "code": t} for t in TESTS],
        "timeout_s": 3.0,
        "capture_bytes": 1 << 16,
    }
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "_spec.json"), "w") as f:
            json.dump(spec, f)
        out = subprocess.run(
            [PY, "-I", "-c", _HARNESS], cwd=d, capture_output=True, timeout=30, check=True
        )
    assert out.stdout.count(b'"passed"') == len(TESTS)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200, help="samples per latency measurement")
    ap.add_argument("--seconds", type=float, default=5.0, help="duration of each throughput run")
    ap.add_argument("--backend", default="auto")
    ap.add_argument(
        "--humaneval", action="store_true", help="also time all 164 canonical HumanEval solutions"
    )
    args = ap.parse_args()

    sb = Sandbox(backend=args.backend)
    lim = Limits(wall_s=5)
    print(
        f"backend={sb.backend} slots={sb.info['slots']} cpus={os.cpu_count()} "
        f"features={sb.info['features']}"
    )

    def box_print() -> None:
        assert sb.run("print(1)", limits=lim).stdout == "1\n"

    def box_tests() -> None:
        assert run_tests(SOLUTION, TESTS, sandbox=sb).all_passed

    rows = []
    for name, box, plain in (
        ("print(1)", box_print, plain_print),
        ("5-assert unit-test job", box_tests, plain_tests),
    ):
        b50, b95 = latency(box, args.n)
        p50, p95 = latency(plain, max(args.n // 4, 20))
        rows.append(
            (
                f"latency {name}",
                f"p50 {b50:6.2f} ms  p95 {b95:6.2f} ms",
                f"p50 {p50:6.2f} ms  p95 {p95:6.2f} ms",
                p50 / b50,
            )
        )
    for workers in (2, 8):
        b = throughput(box_print, workers, args.seconds)
        p = throughput(plain_print, workers, args.seconds)
        rows.append(
            (
                f"jobs/s print(1), {workers} concurrent",
                f"{b:8.1f} jobs/s",
                f"{p:8.1f} jobs/s",
                b / p,
            )
        )
    print(f"\n{'':38} {'sandbox (' + sb.backend + ')':30} {'plain subprocess.run':30} speedup")
    for name, b, p, r in rows:
        print(f"{name:38} {b:30} {p:30} {r:5.2f}x")

    if args.humaneval:
        problems = load_humaneval()
        t0 = time.perf_counter()
        ok = sum(score_humaneval(p, p.canonical_solution, sandbox=sb).all_passed for p in problems)
        print(
            f"\nHumanEval canonical solutions: {ok}/{len(problems)} pass, "
            f"{time.perf_counter() - t0:.1f} s sequential"
        )
    sb.close()

    pairs = [
        (f"so the answer is \\boxed{{\\frac{{{i}}}{{{i + 1}}}}}", f"{i}/{i + 1}")
        for i in range(1, 100000)
    ]
    print()
    for workers in sorted({1, os.cpu_count() or 1}):
        pool = MathPool(workers=workers)
        pool.warm()
        it = iter(pairs)
        lock = threading.Lock()
        done = [0]
        stop = time.monotonic() + args.seconds

        def loop(pool=pool, it=it, lock=lock, done=done, stop=stop) -> None:
            while time.monotonic() < stop:
                with lock:
                    p, a = next(it)
                assert pool.equal(p, a)
                with lock:
                    done[0] += 1

        threads = [threading.Thread(target=loop) for _ in range(workers * 2)]
        t0 = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        rate = done[0] / (time.monotonic() - t0)
        print(
            f"math_equal, {workers} worker process{'es' if workers > 1 else ''}: {rate:8.1f} "
            "pairs/s "
            f"({statistics.fmean([1000 / rate]):.2f} ms/pair amortised)"
        )
        pool.close()


if __name__ == "__main__":
    main()
