"""The local engine vs a vLLM server (vLLM's CPU build) on the same rollout batch, and the logprob
mismatch between each engine and the learner on the tokens it sampled.

The batch is one step of the calculator default run: 2 tasks x 8 trajectories, up to 3 turns of
48 new tokens, temperature 0.7, the real env, chat template and tool calls (`rollout.collect`,
as training runs it), with the same seeds for both engines. Both run the embedded SmolLM2 in
float32 (what the local engine decodes for a float32 learner). They run alternately, local then
vLLM then vLLM then local for `--repeats 2`, so a drifting machine load weighs on both.

Each engine first answers one short request (loading, first-call set-up), untimed. The process
sets the OpenMP environment the `agentgrpo` command sets (`models.hardware.set_cpu_thread_env`),
before torch loads. Printed per run: wall seconds, trajectories/s, sampled tokens/s, this
process's CPU seconds; then per engine, over every
sampled token of every run, |engine logprob - learner logprob|: mean, 99th percentile and max,
the learner being the same model in float32 (`--learner-dtype bfloat16` adds the bf16-autocast
learner of a CPU with native bf16). The vLLM server gets one OpenMP thread (vLLM keeps the other
core for its API process); the local engine the process's torch threads.

    python bench/vllm_engine.py [--python .venv-vllm/bin/python] [--repeats 2] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from agentgrpo.models.hardware import set_cpu_thread_env  # noqa: E402

set_cpu_thread_env()  # as the agentgrpo command does, before torch loads libgomp

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from agentgrpo.engine.base import SamplingParams  # noqa: E402
from agentgrpo.engine.local.engine import LocalEngine  # noqa: E402
from agentgrpo.engine.vllm.client import VLLMEngine  # noqa: E402
from agentgrpo.engine.vllm.launch import VLLMServer  # noqa: E402
from agentgrpo.env.base import get_env_class  # noqa: E402
from agentgrpo.models.embedded import default_model_path, load_tokenizer  # noqa: E402
from agentgrpo.rollout.episode import collect  # noqa: E402
from agentgrpo.run.config import load_config  # noqa: E402


async def one_run(engine, cfg, make_env, chat, tasks, seed: int) -> tuple[list, float, float]:
    t0, cpu0 = time.perf_counter(), time.process_time()
    groups = await collect(make_env, engine, chat, tasks, cfg.rollout, seed=seed)
    trajectories = [t for g in groups for t in g.trajectories]
    return trajectories, time.perf_counter() - t0, time.process_time() - cpu0


def gaps(model, trajectories, temperature: float, autocast: bool) -> list[float]:
    """|engine - learner| logprob of every sampled token (loss_mask 1)."""
    out: list[float] = []
    for t in trajectories:
        ids = torch.tensor([t.token_ids])
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(ids).logits[0, :-1].float() / temperature
        logp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
        for i in range(1, len(t.token_ids)):
            if t.loss_mask[i]:
                out.append(abs(float(logp[i - 1]) - t.logprobs[i]))
    return out


def summary(values: list[float]) -> dict[str, float]:
    s = sorted(values)
    return {
        "mean": statistics.fmean(s),
        "p99": s[min(len(s) - 1, int(0.99 * len(s)))],
        "max": s[-1],
        "tokens": len(s),
    }


async def main(args: argparse.Namespace) -> dict:
    cfg = load_config("examples/calculator.yaml")
    model_path = default_model_path()
    tokenizer = load_tokenizer(model_path)
    chat = cfg.chat_format(tokenizer)
    env_cls = get_env_class(cfg.env.name)
    tasks = cfg.env.load_tasks(env_cls, "train", cfg.seed)[: cfg.rollout.tasks_per_step]
    make_env = lambda: env_cls(**cfg.env.kwargs)  # noqa: E731
    local = LocalEngine(model_path, tokenizer=tokenizer, dtype="float32", seed=0)
    server = VLLMServer(
        str(model_path),
        port=0,
        python=args.python,
        extra_args=["--max-model-len", "2048", "--max-num-seqs", "32", "--dtype", "float32"],
        log_path=args.log,
        ready_timeout_s=600,
    )
    await asyncio.to_thread(server.start)
    remote = VLLMEngine([server.url])
    runs, sampled = [], {"local": [], "vllm": []}
    try:
        await remote.wait_ready(seeded=True)
        for engine in (local, remote):  # warm-up, untimed
            await engine.generate([1, 2, 3], SamplingParams(max_new_tokens=4, seed=0))
        order = ["local", "vllm", "vllm", "local"] * ((args.repeats + 1) // 2)
        for i, name in enumerate(order[: 2 * args.repeats]):
            engine = local if name == "local" else remote
            trajs, wall, cpu = await one_run(engine, cfg, make_env, chat, tasks, seed=i // 2)
            tokens = sum(t.num_sampled for t in trajs)
            runs.append(
                {
                    "engine": name,
                    "wall_s": wall,
                    "process_cpu_s": cpu,
                    "traj_per_s": len(trajs) / wall,
                    "tokens_per_s": tokens / wall,
                    "trajectories": len(trajs),
                }
            )
            print(json.dumps(runs[-1]), flush=True)
            sampled[name] += trajs
    finally:
        await remote.aclose()
        await asyncio.to_thread(server.stop)
        local.close()
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    result: dict = {"runs": runs, "mismatch": {}}
    for name, trajs in sampled.items():
        for dtype in ["float32", *([args.learner_dtype] if args.learner_dtype else [])]:
            g = gaps(model, trajs, cfg.rollout.temperature, autocast=dtype == "bfloat16")
            result["mismatch"][f"{name}_vs_learner_{dtype}"] = summary(g)
    for name in ("local", "vllm"):
        mine = [r["traj_per_s"] for r in runs if r["engine"] == name]
        result[f"{name}_traj_per_s_mean"] = statistics.fmean(mine)
    result["vllm_over_local"] = result["vllm_traj_per_s_mean"] / result["local_traj_per_s_mean"]
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", default=".venv-vllm/bin/python", help="the interpreter with vLLM")
    ap.add_argument("--repeats", type=int, default=2, help="runs per engine")
    ap.add_argument("--learner-dtype", default=None, choices=[None, "bfloat16"])
    ap.add_argument("--log", default="runs/bench-vllm-server.log", help="the server's output")
    ap.add_argument("--json", default=None, help="write the results here")
    asyncio.run(main(ap.parse_args()))
