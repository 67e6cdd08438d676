"""`train.max_staleness` 0 and 1: the whole loop without and with overlapping, in one run.

The rollouts come from the fake SGLang server (`tests/fake_sglang.py`) in another process, which
answers every /generate after `--generate-delay` seconds: a stand-in for SGLang on other GPUs, whose
generation costs this machine no CPU. The learner trains the real SmolLM2-135M here; weights reach
the server through the disk after every step, as they would reach SGLang. The same config runs
twice, at k = 0 then k = 1, and the script prints the seconds per step of each, their ratio, and
the phases (rollout, train, train+rollout, sync) of each run.

Expected: a synchronous step costs rollout + train + sync; an overlapped one max(rollout, train) +
sync, except the first step (nothing to overlap yet) and steps that end at a checkpoint. The first
two steps of either run are slower (warm-up) and are left out of the per-step comparison.

    python bench/overlap.py [--steps 8] [--generate-delay 2.5]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from agentgrpo.models.embedded import default_model_path  # noqa: E402
from agentgrpo.run.config import load_config  # noqa: E402
from agentgrpo.run.log import read_jsonl  # noqa: E402
from agentgrpo.run.train import train  # noqa: E402
from tests.fake_sglang import FakeSGLangProcess  # noqa: E402


def run(out: Path, url: str, steps: int, k: int) -> tuple[float, list[dict]]:
    cfg = load_config(
        "examples/calculator.yaml",
        [
            f"output_dir={out}",
            f"train.steps={steps}",
            "engine.kind=sglang",
            f"engine.sglang.urls=[{url}]",
            "engine.sglang.context_length=8192",
            f"weight_sync.shared_dir={out / 'weights'}",
            "rollout.tasks_per_step=4",
            "rollout.group_size=4",
            "rollout.max_turns=1",
            # scripted outputs: no logprobs to check the weights against
            "weight_sync.probe_every=0",
            "log.progress=false",
            "log.tensorboard=false",
            "eval.every=0",
            f"train.max_staleness={k}",
            # both runs alike: the overlapped one needs an importance correction
            "learner.old_logprobs=recompute",
            "loss.tis=token",
        ],
    )
    t0 = time.perf_counter()
    train(cfg)
    return time.perf_counter() - t0, read_jsonl(out / "metrics.jsonl")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--generate-delay", type=float, default=2.5, help="seconds per /generate")
    args = ap.parse_args()
    model = default_model_path()
    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(model).convert_tokens_to_ids("<|im_end|>")
    with (
        FakeSGLangProcess(
            "--model-path",
            str(model),
            "--output",
            f"19,{eos}",
            "--eos",
            str(eos),
            "--generate-delay",
            str(args.generate_delay),
        ) as server,
        tempfile.TemporaryDirectory() as tmp,
    ):
        results = {}
        for k in (0, 1):
            wall, metrics = run(Path(tmp) / f"k-{k}", server.url, args.steps, k)
            results[k] = (wall, metrics)
            step_s = [m["step_s"] for m in metrics]
            phases = {
                name.removeprefix("phase_s/"): round(
                    sum(m.get(name, 0.0) for m in metrics) / len(metrics), 2
                )
                for name in sorted({n for m in metrics for n in m if n.startswith("phase_s/")})
            }
            print(
                f"max_staleness={k}: run {wall:.1f} s, step_s {[round(s, 2) for s in step_s]}, "
                f"rollout_s {[round(m['rollout_s'], 2) for m in metrics]}, "
                f"learner_s {[round(m['learner_s'], 2) for m in metrics]}, "
                f"policy_lag {[m['policy_lag'] for m in metrics]}, mean phase s "
                f"{json.dumps(phases)}"
            )
        (w0, m0), (w1, m1) = results[0], results[1]
        later0 = sum(m["step_s"] for m in m0[2:]) / (len(m0) - 2)  # after the warm-up steps
        later1 = sum(m["step_s"] for m in m1[2:]) / (len(m1) - 2)
        print(
            f"steps 3..{args.steps}: {later0:.2f} s synchronous, {later1:.2f} s overlapped "
            f"({later0 / later1:.2f}x); whole runs {w0:.1f} s vs {w1:.1f} s ({w0 / w1:.2f}x)"
        )


if __name__ == "__main__":
    main()
