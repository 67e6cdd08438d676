"""The training loop: rollouts -> rewards -> advantages -> policy update -> weight sync.

Each line of a step is one call into one stage module; read this file top to bottom to know what
a step does.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from agentgrpo import checkpoint
from agentgrpo.advantage import compute_advantages
from agentgrpo.chat import ChatFormat
from agentgrpo.config import RunConfig, dump_config
from agentgrpo.env import get_env_class
from agentgrpo.learner import Learner
from agentgrpo.log import RunLogger
from agentgrpo.shaping import describe_algorithm
from agentgrpo.rollout import collect
from agentgrpo.types import Group, Task


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class TaskStream:
    """Tasks in a seeded order, reshuffled every epoch; `position` is what a checkpoint stores."""

    def __init__(self, tasks: Sequence[Task], seed: int, position: int = 0) -> None:
        if not tasks:
            raise ValueError("the environment returned no tasks")
        self.tasks, self.seed, self.position = list(tasks), seed, position

    def take(self, n: int) -> list[Task]:
        out = []
        for _ in range(n):
            epoch, i = divmod(self.position, len(self.tasks))
            order = list(range(len(self.tasks)))
            random.Random(f"{self.seed}/{epoch}").shuffle(order)
            out.append(self.tasks[order[i]])
            self.position += 1
        return out


def step_metrics(groups: Sequence[Group]) -> dict[str, float]:
    trajs = [t for g in groups for t in g.trajectories]
    scored = [t.reward for t in trajs if math.isfinite(t.reward)]
    out = {
        "reward_mean": float(np.mean(scored)) if scored else float("nan"),
        "reward_std": float(np.std(scored)) if scored else float("nan"),
        "unscorable": float(len(trajs) - len(scored)),
        "turns_mean": float(np.mean([t.num_turns for t in trajs])),
        "tool_calls_mean": float(np.mean([t.tool_calls for t in trajs])),
        "tool_errors_mean": float(np.mean([t.tool_errors for t in trajs])),
        "response_tokens_mean": float(np.mean([t.num_sampled for t in trajs])),
        "sampled_tokens": float(sum(t.num_sampled for t in trajs)),
    }
    for t in trajs:
        key = f"stop/{t.stop_reason.value}"
        out[key] = out.get(key, 0.0) + 1
    return out


def train(cfg: RunConfig) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentgrpo.engine.local import LocalEngine
    from agentgrpo.models import default_model_path

    run_dir = Path(cfg.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    print(describe_algorithm(cfg.advantage, cfg.loss, cfg.shaping), flush=True)
    seed_everything(cfg.seed)

    model_path = Path(cfg.model.path) if cfg.model.path else default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    template = Path(cfg.model.chat_template).read_text() if cfg.model.chat_template else None
    chat = ChatFormat(tokenizer, template=template, parser=cfg.model.tool_parser)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else chat.end_of_turn_id
    learner = Learner(model, cfg.learner, cfg.loss, temperature=cfg.rollout.temperature, pad_id=pad_id)
    engine = LocalEngine(model_path, tokenizer=tokenizer, max_batch_size=cfg.engine.max_batch_size)
    context_len = getattr(model.config, "max_position_embeddings", None)

    env_cls = get_env_class(cfg.env.name)
    make_env = lambda: env_cls(**cfg.env.kwargs)  # noqa: E731 - one env instance per trajectory
    loop = asyncio.new_event_loop()  # one loop for the run: the engine's batching worker lives on it
    stream = TaskStream(env_cls.load_tasks("train", seed=cfg.seed, **cfg.env.tasks), cfg.seed)
    ckpt_root = run_dir / "checkpoints"
    start = 0
    found = checkpoint.latest(ckpt_root)
    if found is not None:
        ckpt_dir, manifest = found
        learner.load(ckpt_dir)
        start, stream.position = int(manifest["step"]), int(manifest["data_position"])
        checkpoint.set_rng_state(manifest["rng"])
        loop.run_until_complete(engine.update_weights(learner.unwrapped.state_dict(), version=f"step-{start}"))
        print(f"resumed from {ckpt_dir} at step {start}", flush=True)

    def save(step: int) -> None:
        checkpoint.save(ckpt_root, step, learner.save,
                        {"data_position": stream.position, "weight_version": f"step-{step}",
                         "rng": checkpoint.rng_state()}, keep=cfg.train.keep_checkpoints)

    logger = RunLogger(run_dir, tensorboard=cfg.log.tensorboard)
    bar = None
    if cfg.log.progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=cfg.train.steps, initial=start, desc="train", unit="step", dynamic_ncols=True)
    try:
        for step in range(start, cfg.train.steps):
            t0 = time.perf_counter()
            tasks = stream.take(cfg.rollout.tasks_per_step)
            groups = loop.run_until_complete(collect(make_env, engine, chat, tasks, cfg.rollout,
                                                     seed=cfg.seed * 100_003 + step, context_len=context_len))
            t_rollout = time.perf_counter() - t0
            trajs = [t for g in groups for t in g.trajectories]
            rewards_B = torch.tensor([t.reward for t in trajs], dtype=torch.float32)
            advantages_B = compute_advantages(rewards_B, [t.group_id for t in trajs],
                                              estimator=cfg.advantage.estimator, eps=cfg.advantage.eps)
            metrics = learner.train_step(trajs, advantages_B.tolist())
            loop.run_until_complete(engine.update_weights(learner.unwrapped.state_dict(), version=f"step-{step + 1}"))
            metrics.update(step_metrics(groups), rollout_s=t_rollout, step_s=time.perf_counter() - t0)
            metrics["tokens_per_s"] = metrics["sampled_tokens"] / max(t_rollout, 1e-9)
            logger.log_step(step + 1, metrics)
            logger.log_groups(step + 1, groups)
            if cfg.train.save_every and (step + 1) % cfg.train.save_every == 0:
                save(step + 1)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(reward=f"{metrics['reward_mean']:.3f}", loss=f"{metrics['loss']:.4f}",
                                tok_s=f"{metrics['tokens_per_s']:.0f}")
        if cfg.train.steps > start:
            save(cfg.train.steps)
    finally:
        if bar is not None:
            bar.close()
        logger.close()
        loop.close()
    return run_dir
