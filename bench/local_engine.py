"""Rollout throughput of `LocalEngine` with its prefix cache on vs off, in the same run.

The embedded workload: SmolLM2-135M, GRPO groups of 8 on the calculator env's real prompts
(system prompt with the tool schema + a worked tool-call exchange + the question: 303 tokens, of
which the 4 tasks share all but the question). Both engines share one loaded model and run one
after the other, so they see the same machine.

    (a) turn 1: 4 groups x 8 copies of a prompt, 48 new tokens each, all submitted together.
    (b) turn 2: each trajectory's prompt + its 48 sampled ids + a tool reply (the env's suffix),
        48 new tokens. The cache-on engine holds what its own turn 1 left.

EOS is disabled so every request samples exactly 48 tokens (the same work on and off). Printed per
phase and engine: wall seconds, sampled tokens/s, prompt tokens computed by prefill forwards and
tokens taken from the cache, then the on/off ratio of tokens/s.

    python bench/local_engine.py [--groups 4] [--group-size 8] [--new-tokens 48] [--repeats 1]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from agentgrpo.chat import ChatFormat  # noqa: E402
from agentgrpo.engine import SamplingParams  # noqa: E402
from agentgrpo.engine.local import LocalEngine  # noqa: E402
from agentgrpo.models import default_model_path, load_model, load_tokenizer  # noqa: E402
from agentgrpo.types import Message  # noqa: E402
from envs.calculator import CalculatorEnv  # noqa: E402


async def run_phase(engine: LocalEngine, prompts: list[list[int]], new_tokens: int):
    """Submit all prompts at once; returns (completions, wall s, prefill tokens, cached tokens)."""
    before = dict(engine.stats)
    params = [SamplingParams(max_new_tokens=new_tokens, seed=i) for i in range(len(prompts))]
    t0 = time.perf_counter()
    outs = await asyncio.gather(*(engine.generate(p, q) for p, q in zip(prompts, params, strict=True)))
    wall = time.perf_counter() - t0
    assert all(len(o.token_ids) == new_tokens for o in outs)
    fed = engine.stats["prefill_tokens"] - before["prefill_tokens"]
    cached = engine.stats["cached_tokens"] - before["cached_tokens"]
    return outs, wall, fed, cached


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
    suffix = chat.suffix_ids(history, [Message(role="tool", content="42", name="calculator")], tools)
    print(f"{len(prompts)} prompts of {len(prompts[0])} tokens ({args.groups} groups of "
          f"{args.group_size}), {args.new_tokens} new tokens per turn, turn-2 suffix of "
          f"{len(suffix)} tokens, {os.cpu_count()} CPUs")  # fmt: skip

    results: dict[tuple[str, str], list[tuple[float, int, int]]] = {}
    for _ in range(args.repeats):
        for name, budget in (("off", 0), ("on", args.prefix_cache_tokens)):
            with LocalEngine(model, tokenizer=tok, eos_token_ids=(),
                             prefix_cache_tokens=budget) as engine:  # fmt: skip
                outs, wall, fed, cached = await run_phase(engine, prompts, args.new_tokens)
                results.setdefault(("a", name), []).append((wall, fed, cached))
                turn2 = [p + o.token_ids + suffix for p, o in zip(prompts, outs, strict=True)]
                _, wall, fed, cached = await run_phase(engine, turn2, args.new_tokens)
                results.setdefault(("b", name), []).append((wall, fed, cached))

    sampled = len(prompts) * args.new_tokens
    labels = {"a": "(a) turn 1, groups", "b": "(b) turn 2, continuation"}
    print(f"{'phase':26} {'cache':5} {'wall s':>7} {'tok/s':>7} {'prefill tok':>11} {'cached tok':>10}")
    for phase in ("a", "b"):
        rate = {}
        for name in ("off", "on"):
            runs = results[(phase, name)]
            wall = min(r[0] for r in runs)  # best of the repeats: least disturbed by other load
            rate[name] = sampled / wall
            print(f"{labels[phase]:26} {name:5} {wall:7.2f} {rate[name]:7.1f} "
                  f"{runs[0][1]:11d} {runs[0][2]:10d}")  # fmt: skip
        print(f"{'':26} on/off tok/s = {rate['on'] / rate['off']:.2f}x")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--prefix-cache-tokens", type=int, default=16384)
    asyncio.run(main(parser.parse_args()))
