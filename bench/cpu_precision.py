"""CPU benchmark of the learner step's precision and threading (docs/performance.md, "Precision and
threads on the CPU"). Every number is a ratio against a baseline measured in the same run, from
interleaved repeats, reported as the median with the spread of the repeats.

1. precision: a learner step of the embedded SmolLM2-135M under bf16 autocast against fp32, in
   two worker processes stepped in turn; prints the CPU's capability and bf16 features.
2. threads: the same step alone and with a CPU-bound process (`while True: pass`) beside it, per
   OpenMP setting: `old` = the environment as it was before agentgrpo.models.hardware
   (OMP_WAIT_POLICY unset, torch's own thread count), `new` = what the CLI sets
   (agentgrpo.models.hardware), and `one` = the new policy with a single thread (what a thread
   count of cores - 1 would give on 2 cores).

The batch is calculator-shaped: groups of 8 sharing a 170-token prompt, each with a 20..60-token
response, a 10..30-token tool result (no loss) and a 10..40-token answer (random token ids).

    python bench/cpu_precision.py [--repeats 5] [--groups 1] [--threads-autocast auto]

Each setting runs in its own process, since OpenMP reads its environment once, when torch loads.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOG = "while True: pass"


def worker(autocast: str, groups: int) -> None:
    """Load the model, build a learner, take one warm-up step, then one timed step per line read."""
    sys.path.insert(0, ROOT)
    import torch

    from agentgrpo.algo.loss import LossConfig
    from agentgrpo.learner.learner import Learner, LearnerConfig
    from agentgrpo.models.embedded import default_model_path, load_model
    from agentgrpo.models.hardware import configure_cpu_threads
    from agentgrpo.types import TrainingRow

    threads = (
        configure_cpu_threads()
        if os.environ.get("BENCH_SETTING") != "old"
        else (
            f"torch threads {torch.get_num_threads()} (torch's default), OMP_WAIT_POLICY="
            f"{os.environ.get('OMP_WAIT_POLICY', 'unset')}"
        )
    )
    torch.manual_seed(0)
    rng = random.Random(0)
    trajs = []
    for g in range(groups):
        prompt = [rng.randrange(49152) for _ in range(170)]
        for _ in range(8):
            ids, mask = list(prompt), [0] * len(prompt)
            parts = ((rng.randint(20, 60), 1), (rng.randint(10, 30), 0), (rng.randint(10, 40), 1))
            for n, m in parts:
                ids += [rng.randrange(49152) for _ in range(n)]
                mask += [m] * n
            logprobs = [-rng.uniform(0.1, 3.0) if m else 0.0 for m in mask]
            rng.random()  # what the trajectory's reward drew: the batch stays that of earlier runs
            i = len(trajs)
            advantage = ((i * 7) % 5 - 2) / 2
            trajs.append(TrainingRow(f"g{g}/{i}", f"g{g}", ids, mask, logprobs, advantage))
    learner = Learner(
        load_model(default_model_path()),
        LearnerConfig(lr=1e-7, autocast=autocast, micro_batch_tokens=1024),
        LossConfig(),
        temperature=0.7,
    )
    learner.train_step(trajs)  # warm-up: first-call allocations and kernel choices
    tokens = sum(len(t.token_ids) for t in trajs)
    print(
        f"ready {learner.precision.bf16} {tokens} | {learner.precision.reason} | {threads}",
        flush=True,
    )
    for _ in sys.stdin:
        t0 = time.perf_counter()
        learner.train_step(trajs)
        print(f"{time.perf_counter() - t0:.4f}", flush=True)


class Worker:
    def __init__(self, name: str, setting: str, autocast: str, groups: int) -> None:
        env = dict(
            os.environ,
            BENCH_SETTING=setting,
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            TOKENIZERS_PARALLELISM="false",
        )
        for key in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS"):
            env.pop(key, None)
        if setting != "old":
            sys.path.insert(0, ROOT)
            from agentgrpo.models.hardware import set_cpu_thread_env

            set_cpu_thread_env(env)
        if setting == "one":
            env["OMP_NUM_THREADS"] = "1"
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--worker", autocast, "--groups", str(groups)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.info = ""

    def wait_ready(self) -> None:
        line = self.proc.stdout.readline()
        if not line.startswith("ready"):
            raise RuntimeError(f"worker {self.name} failed to start: {line!r}")
        self.info = line.split(" ", 1)[1].strip()

    def step(self) -> float:
        self.proc.stdin.write("step\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def spread(xs: list[float]) -> str:
    return f"median {statistics.median(xs):.2f} (min {min(xs):.2f}, max {max(xs):.2f})"


def start(workers: list[Worker]) -> None:
    for w in workers:  # one at a time: loading two models at once would time neither
        w.wait_ready()
        print(f"  {w.name}: {w.info}", flush=True)


def precision(args: argparse.Namespace) -> None:
    import torch

    print(
        f"== 1. bf16 autocast vs fp32; CPU capability {torch.backends.cpu.get_cpu_capability()}, "
        f"AVX512-BF16 {torch.cpu._is_avx512_bf16_supported()}, "
        f"AMX {torch.cpu._is_amx_tile_supported()}",
        flush=True,
    )
    bf16 = Worker("bf16", "new", "bf16", args.groups)
    fp32 = Worker("fp32", "new", "none", args.groups)
    start([bf16, fp32])
    times: dict[str, list[float]] = {"bf16": [], "fp32": []}
    for r in range(args.repeats):
        for w in (bf16, fp32) if r % 2 == 0 else (fp32, bf16):
            times[w.name].append(w.step())
        print(
            f"  repeat {r + 1}: bf16 {times['bf16'][-1]:.2f} s, fp32 {times['fp32'][-1]:.2f} s; "
            f"load average {os.getloadavg()[0]:.2f}",
            flush=True,
        )
    ratios = [b / f for b, f in zip(times["bf16"], times["fp32"])]
    print(
        f"  fp32 step s: {spread(times['fp32'])}\n  bf16 step s: {spread(times['bf16'])}\n"
        f"  bf16/fp32 per repeat: {spread(ratios)}",
        flush=True,
    )
    for w in (bf16, fp32):
        w.close()


def threads(args: argparse.Namespace) -> None:
    print(
        f"== 2. alone vs beside `python -c '{HOG}'` (autocast {args.threads_autocast})", flush=True
    )
    workers = [Worker(s, s, args.threads_autocast, args.groups) for s in ("old", "new", "one")]
    start(workers)
    alone: dict[str, list[float]] = {w.name: [] for w in workers}
    busy: dict[str, list[float]] = {w.name: [] for w in workers}
    for r in range(args.repeats):
        order = workers[r % 3 :] + workers[: r % 3]
        for w in order:
            alone[w.name].append(w.step())
        hog = subprocess.Popen([sys.executable, "-c", HOG])
        try:
            time.sleep(0.5)
            for w in order:
                busy[w.name].append(w.step())
        finally:
            hog.kill()
            hog.wait()
        each = [
            f"{w.name} {alone[w.name][-1]:.2f} s alone, {busy[w.name][-1]:.2f} s beside"
            for w in workers
        ]
        print(
            f"  repeat {r + 1}: {', '.join(each)}; load average {os.getloadavg()[0]:.2f}",
            flush=True,
        )
    base = alone["new"]
    for w in workers:
        slow = [b / a for b, a in zip(busy[w.name], alone[w.name])]
        vs_new = [a / n for a, n in zip(alone[w.name], base)]
        print(
            f"  {w.name}: alone s {spread(alone[w.name])}; "
            f"beside the loop s {spread(busy[w.name])}"
            f"\n    beside/alone per repeat {spread(slow)}; alone vs new alone {spread(vs_new)}",
            flush=True,
        )
        w.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--groups", type=int, default=1, help="groups of 8 trajectories in the batch")
    p.add_argument(
        "--threads-autocast",
        default="auto",
        choices=["auto", "bf16", "none"],
        help="precision of section 2's steps",
    )
    p.add_argument("--only", choices=["precision", "threads"], help="run one section")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.worker, args.groups)
        return
    print(
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {os.cpu_count()} CPUs; "
        f"load average {os.getloadavg()[0]:.2f}; {args.repeats} interleaved repeats",
        flush=True,
    )
    if args.only != "threads":
        precision(args)
    if args.only != "precision":
        threads(args)


if __name__ == "__main__":
    main()
