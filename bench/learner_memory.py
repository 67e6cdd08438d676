"""CPU benchmark: what `learner.micro_batch_tokens` costs in peak memory and buys in speed.

The gradient does not depend on the budget (micro-batches accumulate to the step's gradient; tests
prove it), so the budget is a pure trade of activation memory against per-forward overhead. This
measures both for the embedded SmolLM2-135M on a GRPO-shaped batch (bench/learner.py's
`grpo_batch`: groups of 8 sharing a 170-token prompt), with bf16 autocast as examples/calculator.yaml
sets it. Each budget runs in a fresh process, since the peak resident size (`ru_maxrss`) only
grows within one; printed: micro-batches, packed tokens, peak RSS and the median learner step, then
each budget's ratios against the first one (the baseline), measured in the same run. Budgets run in
the given order, then reversed, `--repeats` times, so a drifting machine weighs on all of them.

    python bench/learner_memory.py [--budgets 4096,2048,1024] [--groups 4] [--steps 3] [--repeats 1]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def child(budget: int, groups: int, steps: int) -> dict:
    import torch

    from agentgrpo.learner import Learner, LearnerConfig
    from agentgrpo.loss import LossConfig
    from agentgrpo.models import default_model_path, load_policy
    from bench.learner import advantages, grpo_batch

    torch.manual_seed(0)
    model = load_policy(default_model_path())
    vocab = model.config.vocab_size
    trajs = grpo_batch(groups, 8, vocab=vocab)
    learner = Learner(model, LearnerConfig(lr=1e-6, micro_batch_tokens=budget, autocast="bf16"),
                      LossConfig(clip_low=0.2, clip_high=0.28), temperature=0.7)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    times = []
    for _ in range(steps):
        m = learner.train_step(trajs, advantages(trajs))
        times.append(m["learner_s"])
    return {"budget": budget, "micro_batches": int(m["micro_batches"]), "packed": int(m["packed_tokens"]),
            "tokens": int(m["train_tokens"]), "rss_loaded_gb": before,
            "rss_peak_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "step_s": statistics.median(times[1:] or times)}  # the first step warms up


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--budgets", default="4096,2048,1024", help="micro_batch_tokens values; the first is the baseline")
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child is not None:
        print(json.dumps(child(args.child, args.groups, args.steps)))
        return
    budgets = [int(b) for b in args.budgets.split(",")]
    results: dict[int, list[dict]] = {b: [] for b in budgets}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    for r in range(args.repeats):
        for b in budgets if r % 2 == 0 else budgets[::-1]:
            out = subprocess.run([sys.executable, __file__, "--child", str(b), "--groups", str(args.groups),
                                  "--steps", str(args.steps)], capture_output=True, text=True, env=env, check=True)
            results[b].append(json.loads(out.stdout.strip().splitlines()[-1]))
    base = budgets[0]
    peak = {b: max(x["rss_peak_gb"] for x in rs) for b, rs in results.items()}
    step = {b: statistics.median(x["step_s"] for x in rs) for b, rs in results.items()}
    first = results[base][0]
    print(f"SmolLM2-135M, {args.groups} groups x 8 ({first['tokens']} tokens), bf16 autocast, "
          f"model loaded: {first['rss_loaded_gb']:.2f} GB")
    print(f"{'budget':>7} {'micro-batches':>13} {'packed':>6} {'peak RSS GB':>11} {'step s':>7} "
          f"{'peak / base':>11} {'step / base':>11}")
    for b in budgets:
        x = results[b][0]
        print(f"{b:>7} {x['micro_batches']:>13} {x['packed']:>6} {peak[b]:>11.2f} {step[b]:>7.2f} "
              f"{peak[b] / peak[base]:>11.2f} {step[b] / step[base]:>11.2f}")


if __name__ == "__main__":
    main()
