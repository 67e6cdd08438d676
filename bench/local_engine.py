"""Rollout throughput of `LocalEngine` with its prefix cache on vs off, in the same run.

The embedded workload: SmolLM2-135M, GRPO groups of 8 on the calculator env's real prompts
(system prompt with the tool schema + a worked tool-call exchange + the question: 303 tokens, of
which the 4 tasks share all but the question). Both engines share one loaded model and run one
after the other, so they see the same machine.

    (a) turn 1: 4 groups x 8 copies of a prompt, 48 new tokens each, all submitted together.
    (b) turn 2: each trajectory's prompt + its 48 sampled ids + a tool reply (the env's suffix),
        48 new tokens. The cache-on engine holds what its own turn 1 left.

EOS is disabled so every request samples exactly 48 tokens (the same work on and off). Printed per
run and phase: wall and CPU seconds, sampled tokens/s, prompt tokens computed by prefill forwards
and tokens taken from the cache, and the seconds until the first decode step (the prefill of the
whole set); then the on/off ratio of the best and of the mean tokens/s per phase. Engines run off,
on, on, off so a drifting machine load weighs on both. The token counts are exact; the times are
as noisy as the machine: on a shared 2-core VM the same phase took 18 s or 261 s within minutes
(slow runs show CPU s near wall s instead of near 2x wall s).

    python bench/local_engine.py [--groups 4] [--group-size 8] [--new-tokens 48] [--repeats 1]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from agentgrpo.chat.format import ChatFormat  # noqa: E402
from agentgrpo.engine import SamplingParams  # noqa: E402
from agentgrpo.engine.local.engine import LocalEngine  # noqa: E402
from agentgrpo.models.embedded import default_model_path, load_model, load_tokenizer  # noqa: E402
from agentgrpo.types import Message  # noqa: E402
from envs.calculator import CalculatorEnv  # noqa: E402


async def run_phase(engine: LocalEngine, prompts: list[list[int]], new_tokens: int) -> tuple:
    """Submit all prompts at once; returns (completions, wall s, s until the first decode step
    (the prefill of the whole admitted set), CPU s of this process, prompt ids prefilled, prompt
    ids taken from the cache)."""
    before = dict(engine.stats)
    params = [SamplingParams(max_new_tokens=new_tokens, seed=i) for i in range(len(prompts))]
    wall0, cpu0 = time.perf_counter(), time.process_time()
    first_step = asyncio.get_running_loop().create_future()

    async def watch() -> None:  # polls the worker's counter; the loop is otherwise idle
        while engine.stats["steps"] == before["steps"]:
            await asyncio.sleep(0.01)
        first_step.set_result(time.perf_counter() - wall0)

    watcher = asyncio.create_task(watch())
    outs = await asyncio.gather(
        *(engine.generate(p, q) for p, q in zip(prompts, params, strict=True))
    )
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    await watcher
    prefill_s = first_step.result()
    assert all(len(o.token_ids) == new_tokens for o in outs)
    fed = engine.stats["prefill_tokens"] - before["prefill_tokens"]
    cached = engine.stats["cached_tokens"] - before["cached_tokens"]
    return outs, wall, prefill_s, cpu, fed, cached


async def main(args: argparse.Namespace) -> None:
    path = default_model_path()
    model, tok = load_model(path), load_tokenizer(path)
    chat = ChatFormat(tok)
    env = CalculatorEnv()
    tasks = CalculatorEnv.load_tasks("train", seed=0, n=args.groups)
    tools = env.tool_schemas()
    prompts = []
    for task in tasks:
        messages, _ = env.reset(seed=0, options={"task": task})
        prompts += [chat.prompt_ids(messages, tools)] * args.group_size
    # The env's reply to a tool call, as chat.suffix_ids renders it after an assistant turn.
    history = [Message(role="user", content="?"), Message(role="assistant", content="...")]
    suffix = chat.suffix_ids(
        history, [Message(role="tool", content="42", name="calculator")], tools
    )
    sampled = len(prompts) * args.new_tokens
    print(
        f"{len(prompts)} prompts of {len(prompts[0])} tokens ({args.groups} groups of "
        f"{args.group_size}), {args.new_tokens} new tokens per turn, turn-2 suffix of "
        f"{len(suffix)} tokens, {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}"
    )
    print(f"{'run':4} {'phase':24} {'cache':5} {'wall s':>7} {'prefill s':>9} {'cpu s':>7} "
          f"{'tok/s':>7} {'prefill tok':>11} {'cached tok':>10}")  # fmt: skip

    # Engines run in the order off, on, on, off (per repeat), so a load that drifts linearly over
    # the run (other jobs on a shared machine) weighs on both equally.
    labels = {"a": "(a) turn 1, groups", "b": "(b) turn 2, continuation"}
    walls: dict[tuple[str, str], list[float]] = {}
    order = [("off", 0), ("on", args.prefix_cache_tokens)]
    order = (order + order[::-1]) * args.repeats
    for run, (name, budget) in enumerate(order):
        with LocalEngine(model, tokenizer=tok, eos_token_ids=(),
                         prefix_cache_tokens=budget) as engine:  # fmt: skip
            turn = prompts
            for phase in ("a", "b"):
                outs, wall, prefill_s, cpu, fed, cached = await run_phase(
                    engine, turn, args.new_tokens
                )
                walls.setdefault((phase, name), []).append(wall)
                print(f"{run:<4} {labels[phase]:24} {name:5} {wall:7.2f} {prefill_s:9.2f} "
                      f"{cpu:7.2f} {sampled / wall:7.1f} {fed:11d} {cached:10d}",
                      flush=True)  # fmt: skip
                turn = [p + o.token_ids + suffix for p, o in zip(turn, outs, strict=True)]

    # Best of the runs: the least disturbed by other jobs (a run whose CPU s is well under
    # threads x wall s was slowed by them); the mean shows how much the load moved.
    for phase in ("a", "b"):
        for stat, fn in (("best", min), ("mean", statistics.mean)):
            off, on = (fn(walls[(phase, n)]) for n in ("off", "on"))
            print(
                f"{labels[phase]}: {stat} tok/s off {sampled / off:.1f}, on {sampled / on:.1f}: "
                f"on/off = {off / on:.2f}x"
            )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=1, help="off-on-on-off cycles")
    parser.add_argument("--prefix-cache-tokens", type=int, default=16384)
    asyncio.run(main(parser.parse_args()))
