"""`train.max_staleness` k = 0 (synchronous), 1 (one step of overlap), 2, 4 and 8 on the same
long-tailed multi-turn workload, in one run.

Simulated (the default): the training loop's scheduler (`agentgrpo.run.pipeline.StalenessPipeline`,
the one every k runs through) drives a
simulated engine and learner on asyncio's clock. The engine decodes at most `--engine-slots`
requests at once (a batch); an episode alternates model turns, which hold an engine slot for a time
proportional to the turn's tokens, and tool calls, which hold none. Turn counts, turn lengths and
tool latencies are heavy-tailed (a few episodes take ten times the median), drawn from the group's
position in the task stream, so every mode runs the same episodes. At most `--max-episodes` episodes
run at once (`rollout.max_concurrent_trajectories`), in every mode: more would only queue their
turns in front of the engine, behind which a long episode's turns wait too. A learner step takes
`--train-s`. Weight pushes are free here: the engine is assumed to swap weights between decode
steps (partial rollouts), so a push never waits for episodes in flight.

Printed per mode, and as a ratio to the synchronous loop of the same run: trajectories trained per
second, engine utilisation (mean busy slots / slots) and the learner's idle fraction (waiting for a
step's groups), all over the steady state (without the first and last `--warm` steps, where the
pipeline fills and drains; the whole run's throughput is printed too), and the policy lag of the
trained groups (mean, max).

    python bench/async_pipeline.py [--steps 30] [--seed 0]
    python bench/async_pipeline.py --real   # the real local engine and learner on this CPU, short

`--real` trains the embedded model on the calculator env for a few steps per mode (k = 0, 1, 2, 4,
and k = 2 with the engine's decoding thread at full width instead of half the CPU threads) with the
local engine in the run's process (a fresh one per mode), and prints trajectories per second and
the policy lag from the run's own metrics: what overlapping buys when the engine and the learner
share this machine's cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from agentgrpo.run.pipeline import StalenessPipeline, Ticket  # noqa: E402

MODES = {"k=0": 0, "k=1": 1, "k=2": 2, "k=4": 4, "k=8": 8}


@dataclass
class Workload:
    """Heavy-tailed episodes, the same for every mode: drawn from (seed, position, member)."""

    seed: int
    group_size: int
    token_s: float  # seconds of engine time per generated token (one slot)

    def episode(self, position: int, member: int) -> list[tuple[float, float]]:
        """[(engine seconds of the turn, tool seconds after it)], one pair per turn."""
        rng = random.Random(f"{self.seed}/{position}/{member}")
        turns = min(1 + int(rng.paretovariate(1.6)), 12)
        out = []
        for _ in range(turns):
            tokens = min(rng.lognormvariate(math.log(60), 0.8), 1500)
            tool = rng.lognormvariate(math.log(0.004), 1.0) if rng.random() < 0.97 else 0.25
            out.append((tokens * self.token_s, tool))
        return out


@dataclass
class Engine:
    """`slots` requests decode at once; busy time is integrated for the utilisation."""

    slots: int
    sem: asyncio.Semaphore = field(init=False)
    active: int = 0
    busy: float = 0.0
    since: float = field(default_factory=time.perf_counter)

    def __post_init__(self) -> None:
        self.sem = asyncio.Semaphore(self.slots)

    def _tick(self, delta: int) -> None:
        now = time.perf_counter()
        self.busy += self.active * (now - self.since)
        self.since, self.active = now, self.active + delta

    async def generate(self, seconds: float) -> None:
        async with self.sem:
            self._tick(+1)
            try:
                await asyncio.sleep(seconds)
            finally:
                self._tick(-1)


async def simulate(k: int, args: argparse.Namespace, workload: Workload) -> dict[str, float]:
    engine = Engine(args.engine_slots)
    counter = iter(range(10**9))
    episodes = asyncio.Semaphore(args.max_episodes)  # rollout.max_concurrent_trajectories

    async def episode(position: int, member: int) -> None:
        async with episodes:
            for gen_s, tool_s in workload.episode(position, member):
                await engine.generate(gen_s)
                await asyncio.sleep(tool_s)

    async def produce(t: Ticket) -> tuple[int, int]:
        await asyncio.gather(*(episode(t.position, i) for i in range(args.group_size)))
        return t.position, t.version

    pipe = StalenessPipeline(
        produce,
        lambda: next(counter),
        per_step=args.groups_per_step,
        max_staleness=k,
        steps=args.steps,
    )
    lags, waited = [], []
    marks = []  # (time, engine busy slot-seconds) at the start of each step and at the end
    t0 = time.perf_counter()
    engine.since = t0
    pipe.start()
    try:
        for step in range(args.steps):
            engine._tick(0)
            marks.append((time.perf_counter(), engine.busy))
            groups = (await pipe.take(step)).groups
            waited.append(time.perf_counter() - marks[-1][0])
            lags += [step - v for _, v in groups]
            await asyncio.sleep(args.train_s)
            if k == 1:  # as the training loop does before its push: the learner waits too
                t_settle = time.perf_counter()
                await pipe.settle(step + 1)
                waited[-1] += time.perf_counter() - t_settle
            pipe.advance(step + 1)
    finally:
        await pipe.close()
    engine._tick(0)
    marks.append((time.perf_counter(), engine.busy))
    # steady state: without the first and last `warm` steps, where the pipeline fills and drains
    a, b = args.warm, args.steps - args.warm
    span = marks[b][0] - marks[a][0]
    per_step = args.groups_per_step * args.group_size
    return {
        "trajectories_per_s": (b - a) * per_step / span,
        "engine_utilisation": (marks[b][1] - marks[a][1]) / (engine.slots * span),
        "learner_idle": sum(waited[a:b]) / span,
        "policy_lag_mean": statistics.fmean(lags),
        "policy_lag_max": float(max(lags)),
        "whole_run_trajectories_per_s": args.steps * per_step / (marks[-1][0] - t0),
    }


def run_simulated(args: argparse.Namespace) -> dict:
    workload = Workload(args.seed, args.group_size, args.token_s)
    results = {name: asyncio.run(simulate(k, args, workload)) for name, k in MODES.items()}
    base = results["k=0"]
    for r in results.values():
        r["throughput_vs_k0"] = r["trajectories_per_s"] / base["trajectories_per_s"]
        r["utilisation_vs_k0"] = r["engine_utilisation"] / base["engine_utilisation"]
    return results


REAL_MODES = {"k=0": 0, "k=1": 1, "k=2": 2, "k=4": 4, "k=2 unsplit": 2}


def run_real(args: argparse.Namespace) -> dict:
    """A few steps per mode of the calculator run on the local engine, each mode in a fresh
    process: five runs in one process held up to 10 GB (memory the earlier runs left behind), and
    each starts with torch's thread settings as a run from the CLI does."""
    results = {}
    for name in REAL_MODES:
        with tempfile.TemporaryDirectory() as tmp:
            command = [sys.executable, os.path.abspath(__file__), "--real-mode", name]
            command += ["--real-steps", str(args.real_steps), "--out", tmp]
            subprocess.run(command, check=True)
            results[name] = json.loads((Path(tmp) / "mode.json").read_text())
    base = results["k=0"]["trajectories_per_s"]
    for r in results.values():
        r["throughput_vs_k0"] = r["trajectories_per_s"] / base
    return results


def run_real_mode(name: str, steps: int) -> dict[str, float]:
    """One mode of `--real`, in this process."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from agentgrpo.models.hardware import set_cpu_thread_env

    set_cpu_thread_env()  # what the CLI sets before torch loads (OMP_WAIT_POLICY=PASSIVE, ...)
    import torch

    from agentgrpo.run.config import load_config
    from agentgrpo.run.log import read_jsonl
    from agentgrpo.run.train import train

    # "k=2 unsplit": the engine's decoding thread at the run's full width too, not half of it
    extra = [f"engine.threads={torch.get_num_threads()}"] if name.endswith("unsplit") else []
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(
            "examples/calculator.yaml",
            [
                f"output_dir={tmp}/run",
                f"train.steps={steps}",
                f"train.max_staleness={REAL_MODES[name]}",
                # every mode alike: stale ones need an importance correction
                "learner.old_logprobs=recompute",
                "loss.tis=token",
                "rollout.group_size=4",
                "rollout.tasks_per_step=2",
                "log.progress=false",
                "log.tensorboard=false",
                "train.save_every_s=null",
                *extra,
            ],
        )
        t0 = time.perf_counter()
        train(cfg)
        wall = time.perf_counter() - t0
        metrics = read_jsonl(Path(tmp) / "run" / "metrics.jsonl")
    steps_s = sum(m["step_s"] for m in metrics)
    return {
        "trajectories_per_s": steps * 2 * 4 / steps_s,
        "steps_s": steps_s,
        "wall_s": wall,
        "policy_lag_mean": statistics.fmean(m["policy_lag_mean"] for m in metrics),
        "policy_lag_max": max(m["policy_lag"] for m in metrics),
        "learner_wait_s": sum(m["rollout_s"] for m in metrics),  # the whole rollout at k = 0
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--groups-per-step", type=int, default=16)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--engine-slots", type=int, default=32)
    p.add_argument(
        "--max-episodes",
        type=int,
        default=64,
        help="episodes in flight at most (rollout.max_concurrent_trajectories), every mode",
    )
    p.add_argument("--token-s", type=float, default=0.0005, help="engine seconds per token")
    p.add_argument("--train-s", type=float, default=0.15, help="seconds per learner step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warm", type=int, default=3, help="steps left out at each end")
    p.add_argument("--real", action="store_true", help="the real local engine and learner")
    p.add_argument("--real-steps", type=int, default=4)
    p.add_argument("--real-mode", choices=REAL_MODES, help=argparse.SUPPRESS)  # one, in-process
    p.add_argument("--out", default=os.environ.get("OUT", "bench/results"))
    args = p.parse_args()
    if args.real_mode is not None:
        result = run_real_mode(args.real_mode, args.real_steps)
        (Path(args.out) / "mode.json").write_text(json.dumps(result))
        return
    results = run_real(args) if args.real else run_simulated(args)
    name = "async_pipeline_real.json" if args.real else "async_pipeline.json"
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / name).write_text(
        json.dumps({"args": vars(args), "results": results}, indent=1)
    )
    keys = list(next(iter(results.values())))
    print("mode     " + "  ".join(f"{k:>20}" for k in keys))
    for mode, r in results.items():
        print(f"{mode:8} " + "  ".join(f"{r[k]:20.3f}" for k in keys))


if __name__ == "__main__":
    main()
