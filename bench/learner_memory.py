"""CPU benchmark: what `learner.micro_batch_tokens` costs in peak memory and buys in speed.

The gradient does not depend on the budget (micro-batches accumulate to the step's gradient; tests
prove it), so the budget is a pure trade of activation memory against per-forward overhead. This
measures both for the embedded SmolLM2-135M on a GRPO-shaped batch: `--shape tool` (default;
bench/learner.py's `grpo_batch`: groups of 8 sharing a 170-token prompt, two short responses around
a tool result), with bf16 autocast as examples/calculator.yaml sets it; or `--shape long` (groups of
8 sharing a 250-token prompt, 3 turns of 80-220 sampled and 30-90 tool tokens, as python_math's
trajectories run) with `--autocast none`, the fp32 learner of the long-trajectory examples.
A budget written `N/whole` sets `learner.row_tokens=N`: a whole group per row, as the learner packed
before its row cap (`row_tokens: auto`, the default, lets the cost model split long groups);
`N/head=C` sets `learner.head_chunk_tokens=C` (the LM head over chunks of C loss tokens); `N/mask`
sets `learner.attention=mask` (one masked sdpa call per row, what `auto` ran before segment
attention).

Each budget runs in a fresh process, since the peak resident size (`ru_maxrss`) only grows within
one; printed: micro-batches, the longest row, packed tokens, peak RSS and the median learner step,
then each budget's ratios against the first one (the baseline), measured in the same run. Budgets
run in the given order, then reversed, `--repeats` times, so a drifting machine weighs on all of
them.

    python bench/learner_memory.py [--budgets 4096,2048,1024] [--groups 4] [--steps 3] [--repeats 1]
    python bench/learner_memory.py --shape long --autocast none --steps 1 \\
        --budgets 8192/whole/mask,8192/mask,8192,2048
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def long_batch(groups: int, size: int, vocab: int, seed: int = 0) -> list:
    """python_math-shaped: a 250-token prompt per group, 3 turns of 80-220 sampled ids followed by
    30-90 tool-output ids (loss mask 0)."""
    from bench.learner import _row

    rng = random.Random(seed)
    out = []
    for g in range(groups):
        prompt = [rng.randrange(vocab) for _ in range(250)]
        for _ in range(size):
            ids, mask = list(prompt), [0] * len(prompt)
            for _turn in range(3):
                sampled, tool = rng.randint(80, 220), rng.randint(30, 90)
                ids += [rng.randrange(vocab) for _ in range(sampled + tool)]
                mask += [1] * sampled + [0] * tool
            out.append(_row(ids, mask, f"g{g}", rng, len(out)))
    return out


def child(spec: str, groups: int, steps: int, shape: str, autocast: str) -> dict:
    import torch

    from agentgrpo.algo.loss import LossConfig
    from agentgrpo.learner.learner import Learner, LearnerConfig
    from agentgrpo.models.embedded import default_model_path, load_policy
    from bench.learner import grpo_batch

    torch.manual_seed(0)
    model = load_policy(default_model_path())
    vocab = model.config.vocab_size
    trajs = grpo_batch(groups, 8, vocab=vocab) if shape == "tool" else long_batch(groups, 8, vocab)
    budget, *options = spec.split("/")
    chunk = [int(o.removeprefix("head=")) for o in options if o.startswith("head=")]
    cfg = LearnerConfig(
        lr=1e-6,
        micro_batch_tokens=int(budget),
        autocast=autocast,
        row_tokens=int(budget) if "whole" in options else "auto",
        head_chunk_tokens=chunk[0] if chunk else None,
        attention="mask" if "mask" in options else "auto",
    )
    learner = Learner(model, cfg, LossConfig(clip_low=0.2, clip_high=0.28), temperature=0.7)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    times = []
    for _ in range(steps):
        m = learner.train_step(trajs)
        times.append(m["learner_s"])
    return {
        "budget": spec,
        "micro_batches": int(m["micro_batches"]),
        "packed": int(m["packed_tokens"]),
        "row": int(m["row_tokens"]),
        "tokens": int(m["train_tokens"]),
        "rss_loaded_gb": before,
        "rss_peak_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "step_s": statistics.median(times[1:] or times),
    }  # the first step warms up


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument(
        "--budgets",
        default="4096,2048,1024",
        help="micro_batch_tokens values, the first the baseline; N/whole: learner.row_tokens=N "
        "(a whole group per row, as before the row cap) instead of auto; N/head=C: "
        "learner.head_chunk_tokens=C; N/mask: learner.attention=mask",
    )
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--shape", choices=["tool", "long"], default="tool")
    p.add_argument("--autocast", choices=["bf16", "none"], default="bf16")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child, args.groups, args.steps, args.shape, args.autocast)))
        return
    budgets = args.budgets.split(",")
    results: dict[str, list[dict]] = {b: [] for b in budgets}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    for r in range(args.repeats):
        for b in budgets if r % 2 == 0 else budgets[::-1]:
            out = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--child",
                    b,
                    "--groups",
                    str(args.groups),
                    "--steps",
                    str(args.steps),
                    "--shape",
                    args.shape,
                    "--autocast",
                    args.autocast,
                ],
                capture_output=True,
                text=True,
                env=env,
                check=True,
            )
            results[b].append(json.loads(out.stdout.strip().splitlines()[-1]))
    base = budgets[0]
    peak = {b: max(x["rss_peak_gb"] for x in rs) for b, rs in results.items()}
    step = {b: statistics.median(x["step_s"] for x in rs) for b, rs in results.items()}
    first = results[base][0]
    print(
        f"SmolLM2-135M, {args.shape} shape, {args.groups} groups x 8 ({first['tokens']} tokens), "
        f"autocast {args.autocast}, model loaded: {first['rss_loaded_gb']:.2f} GB"
    )
    print(
        f"{'budget':>10} {'micro-batches':>13} {'row':>5} {'packed':>6} {'peak RSS GB':>11} "
        f"{'step s':>7} "
        f"{'peak / base':>11} {'step / base':>11}"
    )
    for b in budgets:
        x = results[b][0]
        print(
            f"{b:>10} {x['micro_batches']:>13} {x['row']:>5} {x['packed']:>6} "
            f"{peak[b]:>11.2f} {step[b]:>7.2f} "
            f"{peak[b] / peak[base]:>11.2f} {step[b] / step[base]:>11.2f}"
        )


if __name__ == "__main__":
    main()
