"""Rollout scheduling benchmark: agentgrpo's per-trajectory scheduler vs a lock-step baseline.

    python -m bench.rollout            # full run (~1 min): 512 trajectories, 256 in flight
    python -m bench.rollout --quick    # smaller (~15 s)

Both schedulers run the same episodes against the same simulated engine in one process: the work
(response lengths, tool latencies) is drawn from each request's sampling seed and turn, so it is
identical for both. Reported as ratios measured in this run, never as absolute promises.

The simulated engine is a continuous-batching server: every decode step advances all running
sequences by one token and takes `step_s * (1 + n / 64) ** 0.6` seconds for n running sequences
(sub-linear growth: batching is cheap until compute-bound), at most `capacity` sequences run at once
and the rest queue. Responses are 16-512 tokens, log-normal around 90 (heavy-tailed like real model
output; `--sigma 0` makes them all equal), filler then a tool call (or the final answer); the tool
sleeps 50-500 ms (uniform). Real token ids go through the real chat template, parser and suffix
code.

- agentgrpo: `rollout.collect` with `max_concurrent_trajectories = concurrency`: each trajectory
  sends its next turn as soon as its tool returns, and a finished trajectory's slot is refilled.
- lock-step: trajectories run in waves of `concurrency`; within a wave turn k of every live
  trajectory is submitted together (a barrier in front of the engine), so each turn waits for the
  longest generation and the slowest tool of the wave. The same `run_episode` code runs behind it.

Printed: engine utilisation (time with at least one running sequence / wall time), mean batch
occupancy (running sequences / capacity, over wall time), trajectories per second, and agentgrpo's
framework CPU per turn: process CPU time of the run minus the simulator's own CPU (measured around
its code), divided by the number of turns.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import time
from collections import deque
from dataclasses import dataclass, replace

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from agentgrpo import Message, Task, ToolEnv, tool  # noqa: E402
from agentgrpo.chat.format import ChatFormat  # noqa: E402
from agentgrpo.engine.base import Completion, SamplingParams  # noqa: E402
from agentgrpo.rollout.episode import RolloutConfig, collect, run_group  # noqa: E402
from agentgrpo.rollout.seeds import episode_seed  # noqa: E402


@dataclass
class _Req:
    ids: list[int]
    fut: asyncio.Future
    pos: int = 0


class SimEngine:
    """A continuous-batching engine in simulated time (see the module docstring)."""

    def __init__(
        self,
        chat: ChatFormat,
        *,
        capacity: int,
        step_s: float,
        turns: int,
        lengths: tuple[int, int],
        sigma: float,
        tool_ms: tuple[int, int],
        tokens_per_tick: int = 4,
    ) -> None:
        self.chat, self.capacity, self.step_s, self.turns, self.sigma = (
            chat,
            capacity,
            step_s,
            turns,
            sigma,
        )
        self.lengths, self.tool_ms, self.tpt = lengths, tool_ms, tokens_per_tick
        self.im_start = chat.tokenizer.convert_tokens_to_ids("<|im_start|>")
        self.filler = chat.encode(" think")[0]
        self.waiting: deque[_Req] = deque()
        self.active: list[_Req] = []
        self.wake = asyncio.Event()
        self.busy_s = self.seq_s = self.cpu_s = 0.0
        self.requests = 0

    def step_time(self, n: int) -> float:
        return self.step_s * (1 + n / 64) ** 0.6

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
        c0 = time.thread_time()
        turn = (
            prompt_ids.count(self.im_start) - 3
        ) // 2  # system, user, generation prompt; +2 a turn
        rng = random.Random(params.seed * 1009 + turn)
        lo, hi = self.lengths
        # heavy-tailed like real responses: log-normal around the geometric middle of [lo, hi]
        n = int(min(hi, max(lo, rng.lognormvariate(math.log((lo * hi) ** 0.5), self.sigma))))
        ms = rng.randint(*self.tool_ms)
        text = (
            "The answer is 42."
            if turn >= self.turns - 1
            else f'<tool_call>{{"name": "wait", "arguments": {{"ms": {ms}}}}}</tool_call>'
        )
        tail = self.chat.encode(text) + [self.chat.end_of_turn_id]
        ids = [self.filler] * max(0, n - len(tail)) + tail
        req = _Req(ids, asyncio.get_running_loop().create_future())
        self.waiting.append(req)
        self.requests += 1
        self.wake.set()
        self.cpu_s += time.thread_time() - c0
        return await req.fut

    async def update_weights(self, weights, *, version: str) -> None:
        pass

    async def serve(self) -> None:
        while True:
            if not self.active and not self.waiting:
                self.wake.clear()
                await self.wake.wait()
            t0, c0 = time.perf_counter(), time.thread_time()
            while self.waiting and len(self.active) < self.capacity:
                req = self.waiting.popleft()
                if not req.fut.done():
                    self.active.append(req)
            n = len(self.active)
            self.cpu_s += time.thread_time() - c0
            await asyncio.sleep(self.step_time(n) * self.tpt)
            c0 = time.thread_time()
            running = []
            for r in self.active:
                r.pos += self.tpt
                if r.fut.done():
                    continue  # cancelled by a deadline
                if r.pos >= len(r.ids):
                    r.fut.set_result(Completion(r.ids, [-0.5] * len(r.ids), "stop", "sim"))
                else:
                    running.append(r)
            self.active = running
            dt = time.perf_counter() - t0
            self.busy_s += dt
            self.seq_s += n * dt
            self.cpu_s += time.thread_time() - c0


class Barrier:
    """Lock-step: holds each request until every live trajectory of the wave has sent its own."""

    def __init__(self, engine: SimEngine, parties: int) -> None:
        self.engine, self.live = engine, parties
        self.pending: list[tuple[list[int], SamplingParams, asyncio.Future]] = []

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
        fut = asyncio.get_running_loop().create_future()
        self.pending.append((prompt_ids, params, fut))
        self._maybe_release()
        return await (await fut)

    def leave(self, _traj, _score) -> None:
        self.live -= 1
        self._maybe_release()

    def _maybe_release(self) -> None:
        if self.pending and len(self.pending) >= self.live:
            batch, self.pending = self.pending, []
            for ids, params, fut in batch:
                fut.set_result(asyncio.ensure_future(self.engine.generate(ids, params)))

    async def update_weights(self, weights, *, version: str) -> None:
        pass


class WaitEnv(ToolEnv):
    """One tool that sleeps for the time the model asks for (the simulated tool latency)."""

    system_prompt = "Call the wait tool until you know the answer."
    time_scale = 1.0

    @tool
    async def wait(self, ms: int) -> str:
        """Wait ms milliseconds, then report."""
        await asyncio.sleep(ms / 1000 * self.time_scale)
        return f"waited {ms} ms"

    def reward(self, task: Task, messages: list[Message]) -> float:
        return 1.0


async def run_agentgrpo(
    engine: SimEngine, chat: ChatFormat, tasks: list[Task], cfg: RolloutConfig
) -> list:
    return await collect(WaitEnv, engine, chat, tasks, cfg, seed=0)


async def run_lockstep(
    engine: SimEngine, chat: ChatFormat, tasks: list[Task], cfg: RolloutConfig
) -> list:
    """Waves of `max_concurrent_trajectories`; the same per-group seeds as `collect(seed=0)`."""
    params = replace(cfg.sampling_params(), seed=0)
    per_wave = max(1, cfg.max_concurrent_trajectories // cfg.group_size)
    groups = []
    for w in range(0, len(tasks), per_wave):
        wave = list(enumerate(tasks))[w : w + per_wave]
        barrier = Barrier(engine, len(wave) * cfg.group_size)
        seeds = [episode_seed(0, draw=i) for i, _ in wave]  # collect's rule for group i
        groups += await asyncio.gather(
            *(
                run_group(
                    WaitEnv,
                    barrier,
                    chat,
                    t,
                    cfg.group_size,
                    replace(params, seed=seed),
                    seed=seed,
                    limits=cfg,
                    on_done=barrier.leave,
                )
                for (_, t), seed in zip(wave, seeds, strict=True)
            )
        )
    return groups


def measure(
    name: str, runner, chat: ChatFormat, tasks: list[Task], cfg: RolloutConfig, sim: dict
) -> dict:
    async def main() -> dict:
        engine = SimEngine(chat, **sim)
        server = asyncio.create_task(engine.serve())
        t0, cpu0 = time.perf_counter(), time.process_time()
        groups = await runner(engine, chat, tasks, cfg)
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        server.cancel()
        trajs = [t for g in groups for t in g.trajectories]
        turns = sum(t.num_turns for t in trajs)
        bad = [t.stop_reason.value for t in trajs if t.stop_reason.value != "completed"]
        if bad:
            raise RuntimeError(
                f"{name}: {len(bad)} trajectories did not complete: {sorted(set(bad))}"
            )
        return {
            "name": name,
            "wall_s": wall,
            "traj_per_s": len(trajs) / wall,
            "util": engine.busy_s / wall,
            "occupancy": engine.seq_s / (wall * engine.capacity),
            "turns": turns,
            "framework_ms_per_turn": (cpu - engine.cpu_s) / turns * 1e3,
        }

    return asyncio.run(main())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--quick", action="store_true", help="128 trajectories, 64 in flight, capacity 32"
    )
    p.add_argument("--trajectories", type=int, default=512)
    p.add_argument("--concurrency", type=int, default=256, help="trajectories in flight")
    p.add_argument("--capacity", type=int, default=128, help="sequences the engine decodes at once")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--step-ms", type=float, default=2.0, help="decode step time of one sequence")
    p.add_argument("--time-scale", type=float, default=1.0, help="multiplies tool latencies")
    p.add_argument(
        "--sigma",
        type=float,
        default=0.8,
        help="spread of the log-normal response lengths (0 = all the same length)",
    )
    a = p.parse_args()
    if a.quick:
        a.trajectories, a.concurrency, a.capacity = 128, 64, 32

    from transformers import AutoTokenizer

    from agentgrpo.models.embedded import default_model_path

    chat = ChatFormat(AutoTokenizer.from_pretrained(default_model_path()))
    WaitEnv.time_scale = a.time_scale
    tasks = [
        Task(id=f"t{i}", prompt=f"Task {i}: find the answer.")
        for i in range(a.trajectories // a.group_size)
    ]
    cfg = RolloutConfig(
        group_size=a.group_size,
        max_turns=a.turns,
        max_tokens=4096,
        max_new_tokens=512,
        max_concurrent_trajectories=a.concurrency,
    )
    sim = {
        "capacity": a.capacity,
        "step_s": a.step_ms / 1e3,
        "turns": a.turns,
        "lengths": (16, 512),
        "sigma": a.sigma,
        "tool_ms": (50, 500),
    }
    print(
        f"{len(tasks) * a.group_size} trajectories x {a.turns} turns, {a.concurrency} in "
        "flight, engine capacity "
        f"{a.capacity}, decode step {a.step_ms:g} ms x (1 + n/64)^0.6, responses 16-512 "
        "tokens (log-normal, "
        f"sigma {a.sigma:g}), tools 50-500 ms x {a.time_scale:g}"
    )
    base = measure("lock-step", run_lockstep, chat, tasks, cfg, sim)
    ours = measure("agentgrpo", run_agentgrpo, chat, tasks, cfg, sim)
    print(f"{'scheduler':<10} {'wall s':>8} {'traj/s':>8} {'engine util':>12} {'occupancy':>10}")
    for r in (base, ours):
        print(
            f"{r['name']:<10} {r['wall_s']:8.2f} {r['traj_per_s']:8.2f} {r['util']:12.1%} "
            f"{r['occupancy']:10.1%}"
        )
    print(f"throughput agentgrpo / lock-step: {ours['traj_per_s'] / base['traj_per_s']:.2f}x")
    print(f"engine utilisation agentgrpo / lock-step: {ours['util']:.1%} / {base['util']:.1%}")
    print(
        f"agentgrpo framework CPU per turn: {ours['framework_ms_per_turn']:.3f} ms over "
        f"{ours['turns']} turns"
    )


if __name__ == "__main__":
    main()
