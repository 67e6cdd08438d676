"""The training loop: rollouts -> rewards -> advantages -> policy update -> weight sync.

Read `train()` top to bottom: each line of a step is one call into one stage module.
"""

from __future__ import annotations

import asyncio
import functools
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from agentgrpo import checkpoint
from agentgrpo.advantage import compute_advantages
from agentgrpo.chat import ChatFormat
from agentgrpo.config import ConfigError, RunConfig, dump_config
from agentgrpo.engine.base import Engine, close_all, wait_ready
from agentgrpo.env import Env
from agentgrpo.evaluate import evaluate
from agentgrpo.hardware import Precision, configure_cpu_threads
from agentgrpo.learner import Learner
from agentgrpo.log import Progress, RunLogger, set_aside_after
from agentgrpo.overlap import memory_lent, train_while_collecting
from agentgrpo.report import write_report
from agentgrpo.rollout import collect, rollout_metrics
from agentgrpo.shaping import (
    describe_algorithm,
    keep_informative_groups,
    shaped_rewards,
    truncated_rows,
)
from agentgrpo.template_audit import require_token_safe
from agentgrpo.types import Group, Task, Trajectory
from agentgrpo.weight_sync import WeightSync


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


def build_engine(cfg: RunConfig, model_path: Path, tokenizer: Any) -> Engine:
    if cfg.engine.kind == "sglang":
        from agentgrpo.engine.sglang import SGLangEngine

        return SGLangEngine.from_config(cfg.engine.sglang)
    from agentgrpo.engine.local import LocalEngine

    return LocalEngine(model_path, tokenizer=tokenizer, dtype=cfg.engine.dtype,
                       weights_dtype=cfg.learner.dtype, max_batch_size=cfg.engine.max_batch_size,
                       prefix_cache_tokens=cfg.engine.prefix_cache_tokens, seed=cfg.seed)


def describe_precision(learner: Precision, engine: Engine, threads: str) -> str:
    """The start-up line that says which precision the learner and engine run in, and why."""
    line = f"precision: learner {'bf16 autocast' if learner.bf16 else 'fp32'} ({learner.reason})"
    if (reason := getattr(engine, "dtype_reason", None)) is not None:  # the local engine
        dtype = str(next(engine.model.parameters()).dtype).removeprefix("torch.")
        line += f"; engine {dtype} ({reason})"
    return f"{line}; {threads}"


async def collect_step(cfg: RunConfig, make_env: Callable[[], Env], engine: Engine, chat: ChatFormat,
                       stream: TaskStream, step: int, context_len: int | None,
                       on_done: Callable[[Trajectory], None] | None = None) -> tuple[list[Group], dict[str, float]]:
    """The step's groups. With dynamic sampling, groups whose rewards are all equal (no learning
    signal) are dropped and more tasks are sampled, at most `max_extra_rounds` times."""
    t0, seed = time.perf_counter(), cfg.seed * 100_003 + step * 101
    groups = await collect(make_env, engine, chat, stream.take(cfg.rollout.tasks_per_step), cfg.rollout,
                           seed=seed, context_len=context_len, on_done=on_done)
    stats = {"groups_sampled": float(len(groups))}
    if not cfg.shaping.dynamic_sampling:
        stats["rollout_s"] = time.perf_counter() - t0
        return groups, stats
    kept = [g for g, ok in zip(groups, keep_informative_groups([g.rewards for g in groups])) if ok]
    rounds = 0
    while len(kept) < cfg.rollout.tasks_per_step and rounds < cfg.shaping.max_extra_rounds:
        rounds += 1
        more = await collect(make_env, engine, chat, stream.take(cfg.rollout.tasks_per_step - len(kept)),
                             cfg.rollout, seed=seed + rounds, context_len=context_len, on_done=on_done)
        stats["groups_sampled"] += len(more)
        kept += [g for g, ok in zip(more, keep_informative_groups([g.rewards for g in more])) if ok]
    stats.update({"dynamic/extra_rounds": float(rounds), "dynamic/groups_kept": float(len(kept)),
                  "rollout_s": time.perf_counter() - t0})
    return kept[: cfg.rollout.tasks_per_step], stats


def policy_lag(trajs: Sequence[Trajectory], version: int) -> float:
    """How many updates behind the learner's weights (`version`) the oldest sampling weights were;
    NaN when the engine reports no numbered versions."""
    versions = [int(v) for t in trajs for v in (t.weight_version or "").split(",") if v.isdigit()]
    return float(version - min(versions)) if versions else float("nan")


def train(cfg: RunConfig) -> Path:
    """Run (or resume) the training run `cfg` describes; returns its run directory.

    Under `accelerate launch` (or torchrun) every process runs this function. Rank 0 alone talks to the engine
    (rollouts, weight sync, evaluation), writes logs, reports and checkpoint files, and broadcasts
    each step's rollouts; every rank trains on that same list, so the order of tasks, seeds and
    checkpoints is the one a single process would produce. Collectives (broadcast, `train_step`,
    `export_model`, `Learner.save`, checkpoint agreement) are called by all ranks in the same order.
    """
    from transformers import AutoTokenizer

    from agentgrpo.models import default_model_path, load_policy

    run_dir = Path(cfg.output_dir)
    seed_everything(cfg.seed)
    threads = configure_cpu_threads()
    env_cls = cfg.env.env_class()  # before the model loads: a misspelt env or task file fails at once
    train_tasks = cfg.env.load_tasks(env_cls, "train", cfg.seed)
    eval_tasks = cfg.env.load_tasks(env_cls, cfg.eval.split, cfg.seed)[: cfg.eval.num_tasks] if cfg.eval.every else []
    if cfg.eval.every and not eval_tasks:  # it would log NaN eval metrics every eval.every steps
        raise ConfigError(f"eval.every={cfg.eval.every} but {cfg.env.name} has no tasks in split "
                          f"{cfg.eval.split!r} (eval.split); set eval.every: 0 or another split")
    model_path = Path(cfg.model.path) if cfg.model.path else default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    template = Path(cfg.model.chat_template).read_text() if cfg.model.chat_template else None
    chat = ChatFormat(tokenizer, template=template, parser=cfg.model.tool_parser,
                      fallback=cfg.rollout.template_fallback, template_kwargs=cfg.rollout.chat_template_kwargs)
    model = load_policy(model_path)  # FSDP with RAM-efficient loading: weights on rank 0 only
    context_len = getattr(model.config, "max_position_embeddings", None)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else chat.end_of_turn_id
    learner = Learner(model, cfg.learner, cfg.loss, temperature=cfg.rollout.temperature, pad_id=pad_id,
                      total_steps=cfg.train.steps)
    lead = learner.is_main  # rank 0: engine, weight sync, logs and files; other ranks only train
    make_env = lambda: env_cls(**cfg.env.kwargs)  # noqa: E731 - one env instance per trajectory
    stream = TaskStream(train_tasks, cfg.seed)
    ckpt_root, start = run_dir / "checkpoints", 0
    try:  # before anything is written: a run that cannot resume leaves its directory as it was
        found = checkpoint.restore(ckpt_root, learner.load, check=lead, all_ranks=learner.all_ranks, strict=True)
    except checkpoint.NoUsableCheckpoint as e:  # never silently start again from step 0 over them
        raise ConfigError(f"{e}\nif the config changed since they were written ({run_dir / 'config.yaml'} "
                          "holds that run's), restore it; to start a new run, use another output_dir") from None
    engine = sync = logger = None
    if lead:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(dump_config(cfg))
        print(describe_algorithm(cfg.advantage, cfg.loss, cfg.shaping), flush=True)
        if (world := learner.accelerator.num_processes) > 1:
            print(f"processes: {world} ({learner.accelerator.distributed_type.value}); rank 0 rolls out, "
                  "every rank trains", flush=True)
        # Refuse a template that would make the learner see tokens the model never saw.
        print(f"chat template: {chat.template_source}, token mode: "
              f"{require_token_safe(chat, make_env(), stream.tasks[0], seed=cfg.seed).mode}", flush=True)
        engine = build_engine(cfg, model_path, tokenizer)
        print(describe_precision(learner.precision, engine, threads), flush=True)
        sync = WeightSync(engine, cfg.weight_sync)
    loop = asyncio.new_event_loop()  # one loop for the run: engine clients and workers live on it
    if lead:  # SGLang: servers loaded, their versions and context length read, before the first push
        loop.run_until_complete(wait_ready(engine, seeded=True))
    colocated = bool(cfg.engine.sglang and cfg.engine.sglang.release_memory_during_training)

    def save_due(step: int) -> bool:
        """Whether the step ending at `step` checkpoints; decided before it trains (overlapping
        must not cross a checkpoint). The time rule is rank 0's clock, agreed by every rank."""
        late = lead and cfg.train.save_every_s is not None and time.monotonic() - saved_at >= cfg.train.save_every_s
        on_time = cfg.train.save_every_s is not None and learner.any_rank(late)  # collective
        return on_time or (bool(cfg.train.save_every) and step % cfg.train.save_every == 0)

    def push(step: int) -> None:
        weights = learner.export_model()  # collective under FSDP (gathers the shards to rank 0)
        if lead:
            loop.run_until_complete(sync.push(weights, step))

    if found is not None:  # damaged checkpoints were skipped, on every rank alike
        ckpt_dir, manifest = found
        start, stream.position = int(manifest["step"]), int(manifest["data_position"])
        checkpoint.set_rng_state(manifest["rng"])  # after the setup above: only the steps draw from it
        if lead:
            # Newer ones that were skipped leave the run: later saves, prunes and resumes ignore them.
            aside = checkpoint.set_aside_newer(ckpt_root, start)
            print(f"resumed from {ckpt_dir} at step {start}"
                  + (f"; set aside {', '.join(p.name for p in aside)}" if aside else ""), flush=True)
    # Before the first rollout the engine serves the learner's weights, checked by the probe: a
    # server still holding another run's weights (or another model) is caught, not sampled from.
    push(start)

    saved, done, saved_at = start, start, time.monotonic()
    # With train.overlap_rollouts, rank 0's next step's rollouts, sampled while this step trained,
    # and the data position before them (what a checkpoint stores: they were not trained on).
    ahead: tuple[Any, int] | None = None

    def save(step: int) -> None:
        nonlocal saved, saved_at
        saved, saved_at = step, time.monotonic()
        checkpoint.save(ckpt_root, step, learner.save,  # collective: every rank writes its part
                        {"data_position": ahead[1] if ahead else stream.position, "weight_version": str(step),
                         "rng": checkpoint.rng_state()}, keep=cfg.train.keep_checkpoints,
                        is_main=lead, barrier=learner.accelerator.wait_for_everyone)

    if lead:
        # Rows of steps after the one resumed from (or after 0: a run killed before its first
        # checkpoint) are trained again: theirs from the cut-off timeline go aside, not twice in the logs.
        moved = {k: n for k, n in set_aside_after(run_dir, start).items() if n}
        if moved:
            print(f"log rows of steps after {start} set aside: "
                  + ", ".join(f"{n} of {k} -> {k.replace('.jsonl', '')}.after-step-{start}.jsonl"
                              for k, n in moved.items()), flush=True)
        logger = RunLogger.from_config(run_dir, cfg)
    progress = Progress(cfg.train.steps, start_step=start, enabled=cfg.log.progress and lead,
                        rollouts_per_step=cfg.rollout.tasks_per_step * cfg.rollout.group_size)
    eval_tasks = eval_tasks if lead else []
    stop = checkpoint.StopRequested().install()  # SIGTERM/SIGINT: checkpoint after this step, exit
    try:
        for step in range(start, cfg.train.steps):
            t0 = time.perf_counter()
            progress.phase("rollout")
            rollouts = (ahead[0] if ahead else loop.run_until_complete(collect_step(
                cfg, make_env, engine, chat, stream, step, context_len, progress.rollout_done))) if lead else None
            groups, metrics = learner.broadcast(rollouts)  # every rank trains on rank 0's rollouts
            ahead, done = None, step + 1
            trajs = [t for g in groups for t in g.trajectories]
            rewards_B = shaped_rewards(trajs, cfg.shaping, cfg.rollout.max_tokens)
            advantages_B = compute_advantages(rewards_B, [t.group_id for t in trajs],
                                              estimator=cfg.advantage.estimator, eps=cfg.advantage.eps,
                                              batch_std=cfg.advantage.batch_std)
            if cfg.shaping.mask_truncated:  # truncated rows still counted in their group's statistics
                advantages_B[truncated_rows([t.stop_reason for t in trajs])] = float("nan")
            train_step = functools.partial(learner.train_step, trajs, advantages_B.tolist())
            checkpoint_due = save_due(done)
            # One step off-policy: the next step samples with the weights before this update, while it
            # trains (rank 0's engine in the event loop, the learner in a thread). Never across a
            # checkpoint, so a resumed run samples exactly what an uninterrupted one did.
            if lead and cfg.train.overlap_rollouts and done < cfg.train.steps and not checkpoint_due:
                progress.phase("train+rollout", total=progress.rollouts_per_step)
                position = stream.position
                trained, next_rollouts = loop.run_until_complete(train_while_collecting(
                    train_step, collect_step(cfg, make_env, engine, chat, stream, done, context_len,
                                             progress.rollout_done), abandon=lambda: bool(stop)))
                if next_rollouts is None:  # a stop cancelled them: their tasks are sampled after resuming
                    stream.position = position
                else:
                    ahead = (next_rollouts, position)
                metrics.update(trained)
            else:
                progress.phase("train")
                with memory_lent(learner, engine, loop, colocated=colocated):
                    metrics.update(train_step())
            progress.phase("sync")
            push(done)  # after the overlapped rollouts finished: no request sees weights change
            stopping = learner.any_rank(bool(stop))
            if lead:
                metrics.update(rollout_metrics(groups), step_s=time.perf_counter() - t0,
                               policy_lag=policy_lag(trajs, step))
                metrics["tokens_per_s"] = metrics.get("sampled_tokens", 0.0) / max(metrics["rollout_s"], 1e-9)
                if cfg.eval.every and done % cfg.eval.every == 0:
                    progress.phase("eval", total=len(eval_tasks) * cfg.eval.samples_per_task)
                    result = loop.run_until_complete(evaluate(make_env, engine, chat, eval_tasks, cfg.rollout,
                                                              cfg.eval, seed=cfg.seed, context_len=context_len,
                                                              on_done=progress.rollout_done))
                    metrics.update({f"eval/{k}": v for k, v in result.metrics.items()})
                metrics.update({f"phase_s/{k}": v for k, v in progress.phase_times().items()})
                logger.log_step(done, metrics)
                logger.log_groups(done, groups)
            if stopping or checkpoint_due:
                progress.phase("checkpoint")
                save(done)
            progress.step_done(done, metrics)
            if stopping:
                break
        if done > saved:  # at exit: the last finished step
            progress.phase("checkpoint")
            save(done)
    finally:
        stop.uninstall()
        progress.close()
        if logger is not None:
            logger.close()
        close_all(loop, sync and sync.close, getattr(engine, "aclose", None))
    if lead:
        write_report(run_dir)
    learner.close()
    return run_dir
