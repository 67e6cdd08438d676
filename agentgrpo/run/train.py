"""The training loop: rollouts -> rewards -> advantages -> policy update -> weight sync.

Read `train()` top to bottom: each line of a step is one call into one stage module.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import math
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoTokenizer

from agentgrpo.algo.advantage import compute_advantages, compute_turn_advantages, is_turn_level
from agentgrpo.algo.shaping import (
    describe_algorithm,
    keep_informative_groups,
    shaped_rewards,
    truncated_rows,
)
from agentgrpo.chat.format import ChatFormat
from agentgrpo.checks.env_check import check_env_at_start
from agentgrpo.checks.reward_audit import audit_at_start, recheck_step
from agentgrpo.checks.template_audit import require_token_safe
from agentgrpo.engine.base import Engine, close_all, release_memory, resume_memory, wait_ready
from agentgrpo.engine.config import build_engine
from agentgrpo.engine.weight_sync import WeightSync
from agentgrpo.env.base import Env
from agentgrpo.learner.attention import AttentionUnavailable
from agentgrpo.learner.batch import training_rows
from agentgrpo.learner.learner import Learner
from agentgrpo.models import embedded as models
from agentgrpo.models.hardware import (
    Precision,
    configure_cpu_threads,
    make_deterministic,
    share_cpu,
)
from agentgrpo.rollout.episode import EnvRoute, GroupSampler, rollout_metrics
from agentgrpo.run import checkpoint
from agentgrpo.run.config import ConfigError, RunConfig, dump_config
from agentgrpo.run.evaluate import evaluate
from agentgrpo.run.log import Progress, RunLogger, aside_name, set_aside_after
from agentgrpo.run.mixture import Mixture, MixtureStream
from agentgrpo.run.mixture import describe as describe_mixture
from agentgrpo.run.pipeline import StalenessPipeline, Ticket
from agentgrpo.run.report import write_report
from agentgrpo.types import Advantage, Group, Task, Trajectory


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class TaskStream:
    """Tasks in a seeded order, reshuffled every epoch. A task is named by its place in that order
    (its position); `position` is the next new one and `resume` the positions a checkpoint lists
    as sampled but not trained on, which the pipeline admits before any new one: both are what a
    checkpoint stores."""

    def __init__(
        self, tasks: Sequence[Task], seed: int, position: int = 0, resume: Sequence[int] = ()
    ) -> None:
        if not tasks:
            raise ValueError("the environment returned no tasks")
        self.tasks, self.seed, self.position = list(tasks), seed, position
        self.resume = list(resume)

    def next_position(self) -> int:
        self.position += 1
        return self.position - 1

    def task_at(self, position: int) -> Task:
        epoch, i = divmod(position, len(self.tasks))
        order = list(range(len(self.tasks)))
        random.Random(f"{self.seed}/{epoch}").shuffle(order)
        return self.tasks[order[i]]


@dataclass
class Rollouts:
    """What one step trains on: its groups, and what collecting them measured."""

    groups: list[Group]
    metrics: dict[str, float]

    @property
    def trajectories(self) -> list[Trajectory]:
        return [t for g in self.groups for t in g.trajectories]


def describe_precision(learner: Precision, engine: Engine, threads: str) -> str:
    """The start-up line that says which precision the learner and engine run in, and why."""
    line = f"precision: learner {'bf16 autocast' if learner.bf16 else 'fp32'} ({learner.reason})"
    if (reason := getattr(engine, "dtype_reason", None)) is not None:  # the local engine
        dtype = str(next(engine.model.parameters()).dtype).removeprefix("torch.")
        line += f"; engine {dtype} on {engine.device} ({reason})"
    return f"{line}; {threads}"


async def take_step(run: Run, step: int) -> Rollouts:
    """Rank 0: the step's groups from the pipeline, and what waiting for them measured."""
    pipeline, t0 = run.pipeline, time.perf_counter()
    taken = await pipeline.take(step)
    metrics = {
        "rollout_s": time.perf_counter() - t0,  # the learner's wait: 0 when they were ready
        "groups_sampled": float(len(taken.groups) + taken.rejected),
        "pipeline/in_flight": float(pipeline.in_flight()),
        "pipeline/ready_ahead": float(pipeline.ready_ahead()),
    }
    if run.cfg.shaping.dynamic_sampling:  # replacements counted in steps' worth of groups
        metrics["dynamic/extra_rounds"] = taken.replaced / run.cfg.rollout.tasks_per_step
        metrics["dynamic/groups_kept"] = float(len(taken.groups))
    return Rollouts(taken.groups, metrics)


def start_pipeline(run: Run) -> StalenessPipeline[Group]:
    """Rank 0: the producer, started once the engine serves the learner's weights. A group's task
    and seeds follow from its position in the task stream, so a resumed run samples a pending one
    with the same task and seeds. A planned checkpoint (`train.save_every`) fences the slots after
    it; a time-based one fences them when it is decided (`run_step`)."""
    cfg = run.cfg
    sampler = GroupSampler(
        run.make_env,
        run.engine,
        run.chat,
        cfg.rollout,
        seed=cfg.seed,
        context_len=run.context_len,
        on_done=run.progress.rollout_done,
        route=run.route,
    )

    async def produce(ticket: Ticket[Group]) -> Group:
        task = run.stream.task_at(ticket.position)
        timeout = cfg.rollout.step_timeout_s  # per group, from its start
        return await sampler.group(
            task,
            draw=ticket.position,
            group_id=f"p{ticket.position}:{task.id}",
            deadline=None if timeout is None else time.monotonic() + timeout,
        )

    def informative(group: Group) -> bool:
        return keep_informative_groups([group.rewards])[0]

    dynamic, every = cfg.shaping.dynamic_sampling, cfg.train.save_every
    pipeline = StalenessPipeline(
        produce,
        run.stream.next_position,
        per_step=cfg.rollout.tasks_per_step,
        max_staleness=cfg.train.max_staleness,
        steps=cfg.train.steps,
        version=run.steps_done,
        resume=run.stream.resume,
        keep=informative if dynamic else None,
        max_replaced=cfg.shaping.max_extra_rounds * cfg.rollout.tasks_per_step,
        fenced=lambda step: bool(every) and (step + 1) % every == 0,
        trade=not cfg.deterministic,  # timing must not decide which step trains a group
    )
    run.loop.call_soon(pipeline.start)
    return pipeline


def assign_advantages(groups: Sequence[Group], cfg: RunConfig) -> dict[str, Advantage]:
    """The step's advantages by trajectory id, from each group's shaped scores. A trajectory not
    trained on (unscorable, or cut and `shaping.mask_truncated`) has none. A turn-level estimator
    adds one advantage per turn from the env's turn rewards (`Advantage.per_turn`); `value` is
    then its outcome term (grpo)."""
    scored = [(t, g.score(t).reward) for g in groups for t in g.trajectories]
    trajs = [t for t, _ in scored]
    if len({t.id for t in trajs}) < len(trajs):
        raise ValueError("trajectory ids repeat across the step's groups: advantages join by id")
    a, group_ids = cfg.advantage, [t.group_id for t in trajs]
    rewards_B = shaped_rewards(trajs, [r for _, r in scored], cfg.shaping, cfg.rollout.max_tokens)
    turn_level = is_turn_level(a.estimator)
    advantages_B = compute_advantages(
        rewards_B,
        group_ids,
        estimator="grpo" if turn_level else a.estimator,
        eps=a.eps,
        batch_std=a.batch_std,
    )
    per_turn = (
        compute_turn_advantages(
            rewards_B,
            [t.sampled_turn_rewards() for t in trajs],
            group_ids,
            a.estimator,
            a.eps,
            gamma=a.gamma,
            turn_weight=a.turn_weight,
        )
        if turn_level
        else [None] * len(trajs)
    )
    if cfg.shaping.mask_truncated:  # truncated rows still counted in their group's statistics
        advantages_B[truncated_rows([t.stop_reason for t in trajs])] = float("nan")
    return {
        t.id: Advantage(t.id, adv, turns)
        for (t, reward), adv, turns in zip(scored, advantages_B.tolist(), per_turn, strict=True)
        if not (math.isnan(adv) or math.isnan(reward))
    }


def policy_lag(trajs: Sequence[Trajectory], version: int) -> float:
    """How many updates behind the learner's weights (`version`) the oldest sampling weights were;
    NaN when the engine reports no numbered versions."""
    versions = [v for t in trajs for v in t.weight_versions]
    return float(version - min(versions)) if versions else float("nan")


def policy_lag_mean(trajs: Sequence[Trajectory], version: int) -> float:
    """The mean over trajectories of their policy lag (`version` minus the oldest weights that
    sampled any of their tokens); NaN when no trajectory has numbered versions."""
    lags = [version - min(t.weight_versions) for t in trajs if t.weight_versions]
    return float(sum(lags) / len(lags)) if lags else float("nan")


@dataclass
class Run:
    """Everything a training run holds between steps. Rank 0 (`is_main`) alone has an engine,
    weight sync, logger and evaluation tasks; every rank has the learner."""

    cfg: RunConfig
    run_dir: Path
    learner: Learner
    chat: ChatFormat
    make_env: Callable[[], Env]
    stream: TaskStream
    context_len: int | None
    loop: asyncio.AbstractEventLoop
    progress: Progress
    stop: checkpoint.StopRequested
    engine: Engine | None = None
    sync: WeightSync | None = None
    logger: RunLogger | None = None
    eval_tasks: list[Task] = field(default_factory=list)
    steps_done: int = 0  # the learner's version: updates applied so far
    saved_step: int = 0  # the step of the last checkpoint
    saved_at: float = field(default_factory=time.monotonic)
    pipeline: StalenessPipeline[Group] | None = None  # rank 0: the scheduler of every step
    mixture: Mixture | None = None  # `envs:`: which env plays each task

    @property
    def route(self) -> EnvRoute | None:
        return self.mixture.route if self.mixture is not None else None

    @property
    def is_main(self) -> bool:
        return self.learner.is_main

    def checkpoint_due(self, step: int) -> bool:
        """Whether the step ending at `step` saves a checkpoint; decided before it trains (no
        collection may cross a checkpoint: `StalenessPipeline.fence`). Collective: every rank
        calls it, and the time rule is rank 0's clock, agreed by all."""
        cfg = self.cfg.train
        if cfg.save_every_s is not None:
            late = self.is_main and time.monotonic() - self.saved_at >= cfg.save_every_s
            if self.learner.any_rank(late):
                return True
        return bool(cfg.save_every) and step % cfg.save_every == 0

    def push_weights(self, version: int) -> None:
        """The learner's weights to the engine, as `version`. Collective under FSDP (the export
        gathers the shards to rank 0)."""
        weights = self.learner.export_model()
        if self.is_main:
            self.loop.run_until_complete(self.sync.push(weights, version))

    def save(self, step: int) -> None:
        """A checkpoint of the run after `step`. Collective: every rank writes its part."""
        self.progress.phase("checkpoint")
        # sampled, not trained on: the resumed run samples them again first (same tasks, seeds)
        pending = self.pipeline.pending() if self.pipeline else []  # rank 0 writes the manifest
        checkpoint.save(
            self.run_dir / "checkpoints",
            step,
            self.learner.save,
            {
                "data_position": self.stream.position,
                "pending_positions": pending,
                "weight_version": str(step),
                "rng": checkpoint.rng_state(),
            },
            keep=self.cfg.train.keep_checkpoints,
            is_main=self.is_main,
            barrier=self.learner.accelerator.wait_for_everyone,
        )
        self.saved_step, self.saved_at = step, time.monotonic()


def run_step(run: Run, step: int) -> bool:
    """One GRPO step: collect, advantages, train, sync, log, checkpoint. Returns whether the run
    stops after it (a SIGTERM/SIGINT reached some rank)."""
    cfg, learner, t0 = run.cfg, run.learner, time.perf_counter()
    run.progress.phase("rollout")
    rollouts = None
    if run.is_main:
        rollouts = run.loop.run_until_complete(take_step(run, step))
        recheck = (
            run.mixture.recheck_step(rollouts.groups, seed=cfg.seed + step)
            if run.mixture
            else recheck_step(rollouts.groups, run.make_env, cfg.env.audit, seed=cfg.seed + step)
        )
        rollouts.groups, flaky = run.loop.run_until_complete(recheck)  # flaky groups made NaN
        rollouts.metrics["flaky_groups"] = float(flaky)
    rollouts = learner.broadcast(rollouts)  # every rank trains on rank 0's rollouts
    done, trajs = step + 1, rollouts.trajectories
    advantages = assign_advantages(rollouts.groups, cfg)
    update = functools.partial(learner.train_step, training_rows(trajs, advantages))
    save_now = run.checkpoint_due(done)
    if save_now and run.pipeline is not None:  # nothing sampled before it is trained after it
        run.pipeline.fence(step)
    metrics = dict(rollouts.metrics)
    metrics.update(train_update(run, update))
    if run.pipeline is not None and cfg.train.max_staleness == 1:
        # the one-step loop: the next step's groups finish under one version before the push
        # (exact resumes and deterministic runs); k >= 2 samples across it, keeping the engine busy
        run.progress.phase("drain")
        run.loop.run_until_complete(run.pipeline.settle(done))
    run.progress.phase("sync")
    run.push_weights(done)  # with k >= 2 groups sample on, under the new weights
    run.steps_done = done
    if run.pipeline is not None:
        run.pipeline.advance(done)
    stopping = learner.any_rank(bool(run.stop))
    if run.is_main:
        metrics.update(
            rollout_metrics(rollouts.groups),
            **(run.mixture.metrics(rollouts.groups) if run.mixture else {}),
            step_s=time.perf_counter() - t0,
            policy_lag=policy_lag(trajs, step),
            policy_lag_mean=policy_lag_mean(trajs, step),
        )
        if run.sync.last_probe_error is not None:  # this step's push, checked: engine vs learner
            metrics["sync/probe_error"] = run.sync.last_probe_error
        # sampled while the learner waited (k = 0) or all along (k >= 1: per step, overall)
        sampling_s = metrics["step_s"] if cfg.train.max_staleness else metrics["rollout_s"]
        metrics["tokens_per_s"] = metrics.get("sampled_tokens", 0.0) / max(sampling_s, 1e-9)
        if cfg.eval.every and done % cfg.eval.every == 0:
            metrics.update(evaluate_now(run))
        metrics.update({f"phase_s/{k}": v for k, v in run.progress.phase_times().items()})
        run.logger.log_step(done, metrics)
        run.logger.log_groups(done, rollouts.groups, advantages)
    if stopping or save_now:
        run.save(done)
    run.progress.step_done(done, metrics)
    return stopping


def train_update(run: Run, update: Callable[[], dict[str, float]]) -> dict[str, float]:
    """The learner's step. With `max_staleness` >= 1, rank 0 trains in the training thread while
    its event loop samples on (the pipeline's producer and episodes); otherwise nothing samples
    meanwhile, and the engine lends its memory for the step (`memory_lent`)."""
    if run.is_main and run.cfg.train.max_staleness:
        run.progress.phase("train+rollout")
        return run.loop.run_until_complete(train_beside(update))
    run.progress.phase("train")
    sglang = run.cfg.engine.sglang
    colocated = bool(sglang and sglang.release_memory_during_training)
    with memory_lent(run.learner, run.engine, run.loop, colocated=colocated):
        return update()


# Rank 0 trains in this one thread while its event loop samples (max_staleness >= 1): in asyncio's
# shared pool a step landed on another thread each time and paid torch's per-thread warm-up again
# (docs/performance.md, "Overlapped rollouts").
_TRAIN_THREAD = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="agentgrpo-train")


def set_train_threads(threads: int) -> None:
    """torch threads of the training thread (its own OpenMP team; other threads keep theirs)."""
    _TRAIN_THREAD.submit(torch.set_num_threads, threads).result()


async def train_beside(train_step: Callable[[], dict[str, float]]) -> dict[str, float]:
    """Run the blocking `train_step()` in the training thread while this event loop goes on
    running what it holds (the pipeline's producer and episodes)."""
    return await asyncio.get_running_loop().run_in_executor(_TRAIN_THREAD, train_step)


@contextlib.contextmanager
def memory_lent(
    learner: Learner, engine: Engine | None, loop: asyncio.AbstractEventLoop, *, colocated: bool
) -> Iterator[None]:
    """While the learner trains and nothing samples, the engine lends it its memory: rank 0 has it
    released (`release_memory`: SGLang's weights and KV cache when `colocated`, the local engine's
    prefix cache, dead once the weights change) and resumed before the push. `colocated`: the
    servers share the learner's GPUs, so no rank trains before the release, and every rank returns
    its cached CUDA blocks before the resume."""
    sync = learner.accelerator.wait_for_everyone if colocated else lambda: None
    if learner.is_main:
        loop.run_until_complete(release_memory(engine))
    sync()
    try:
        yield
    except BaseException:
        if learner.is_main:  # best effort: the step's own error is the one to report
            with contextlib.suppress(Exception):
                loop.run_until_complete(resume_memory(engine))
        raise
    if colocated and torch.cuda.is_available():
        torch.cuda.empty_cache()
    sync()
    if learner.is_main:
        loop.run_until_complete(resume_memory(engine))


def evaluate_now(run: Run) -> dict[str, float]:
    """Rank 0: the current policy on the evaluation tasks, as `eval/` metrics."""
    run.progress.phase("eval", total=len(run.eval_tasks) * run.cfg.eval.samples_per_task)
    result = run.loop.run_until_complete(
        evaluate(
            run.make_env,
            run.engine,
            run.chat,
            run.eval_tasks,
            run.cfg.rollout,
            run.cfg.eval,
            seed=run.cfg.seed,
            context_len=run.context_len,
            on_done=run.progress.rollout_done,
            route=run.route,
        )
    )
    per_env = run.mixture.metrics(result.groups, "eval/") if run.mixture else {}
    return {f"eval/{k}": v for k, v in result.metrics.items()} | per_env


def train(cfg: RunConfig) -> Path:
    """Run (or resume) the training run `cfg` describes; returns its run directory.

    Under `accelerate launch` (or torchrun) every process runs this function. Rank 0 alone talks to
    the engine (rollouts, weight sync, evaluation), writes logs, reports and checkpoint files, and
    broadcasts each step's rollouts; every rank trains on that same list, so the order of tasks,
    seeds and checkpoints is the one a single process would produce. Collectives (broadcast,
    `train_step`, `export_model`, `Learner.save`, checkpoint agreement) are called by all ranks in
    the same order.
    """
    run = start_run(cfg)
    try:
        for step in range(run.steps_done, cfg.train.steps):
            if run_step(run, step):
                break
        if run.steps_done > run.saved_step:  # at exit: the last finished step
            run.save(run.steps_done)
    finally:
        if run.pipeline is not None:
            run.loop.run_until_complete(run.pipeline.close())
        run.stop.uninstall()
        run.progress.close()
        if run.logger is not None:
            run.logger.close()
        close_all(run.loop, run.sync and run.sync.close, getattr(run.engine, "aclose", None))
    if run.is_main:
        write_report(run.run_dir)
    run.learner.close()
    return run.run_dir


def start_run(cfg: RunConfig) -> Run:
    """Everything a run needs before its first step: tasks, tokenizer and chat format, the
    learner (resumed from the newest usable checkpoint), and on rank 0 the engine serving the
    learner's weights, the logger and the run directory's files."""
    run_dir = Path(cfg.output_dir)
    seed_everything(cfg.seed)
    threads = configure_cpu_threads()
    if cfg.deterministic:  # before anything runs a kernel (docs/learner.md, reproducible runs)
        threads = f"{threads}; {make_deterministic()}"
    # the env and its tasks before the model loads: a misspelt env or task file fails at once
    stream, make_env, eval_tasks, mixture = run_envs(cfg)
    model_path = Path(cfg.model.path) if cfg.model.path else models.default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    chat = cfg.chat_format(tokenizer)
    model = models.load_policy(
        model_path
    )  # FSDP with RAM-efficient loading: weights on rank 0 only
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else chat.end_of_turn_id
    try:
        learner = Learner(
            model,
            cfg.learner,
            cfg.loss,
            temperature=cfg.rollout.temperature,
            pad_id=pad_id,
            total_steps=cfg.train.steps,
        )
    except AttentionUnavailable as e:  # e.g. learner.attention: varlen on a CPU
        raise ConfigError(str(e)) from None
    start, found = resume_from_checkpoint(learner, run_dir, stream)
    run = Run(
        cfg=cfg,
        run_dir=run_dir,
        learner=learner,
        chat=chat,
        make_env=make_env,  # one env instance per trajectory
        stream=stream,
        context_len=getattr(model.config, "max_position_embeddings", None),
        loop=asyncio.new_event_loop(),  # one loop for the run: engine clients live on it
        progress=Progress(
            cfg.train.steps,
            start_step=start,
            enabled=cfg.log.progress and learner.is_main,
            rollouts_per_step=cfg.rollout.tasks_per_step * cfg.rollout.group_size,
        ),
        stop=checkpoint.StopRequested(),
        steps_done=start,
        saved_step=start,
        mixture=mixture,
    )
    if learner.is_main:
        start_main_rank(
            run,
            model_path,
            tokenizer,
            eval_tasks,
            threads=threads,
            resumed_from=found[0] if found is not None else None,
        )
    # Before the first rollout the engine serves the learner's weights, checked by the probe: a
    # server still holding another run's weights (or another model) is caught, not sampled from.
    run.push_weights(start)
    if learner.is_main:
        run.pipeline = start_pipeline(run)
    run.stop.install()  # SIGTERM/SIGINT: checkpoint after this step, exit
    return run


def run_envs(
    cfg: RunConfig,
) -> tuple[TaskStream | MixtureStream, Callable[[], Env], list[Task], Mixture | None]:
    """The run's task stream, a factory of its env (the first env's, for a mixture), its
    evaluation tasks and, for `envs:`, the mixture that routes each task to its env."""
    if cfg.envs is None:
        env_cls = cfg.env.env_class()
        train_tasks, eval_tasks = load_run_tasks(cfg, env_cls)
        make_env = functools.partial(env_cls, **cfg.env.kwargs)
        return TaskStream(train_tasks, cfg.seed), make_env, eval_tasks, None
    mixture = Mixture.load(cfg, with_eval=bool(cfg.eval.every))
    first = next(iter(mixture.sources.values()))
    stream = mixture.stream(TaskStream)
    return stream, first.make_env, mixture.eval_tasks(cfg.eval.num_tasks), mixture


def load_run_tasks(cfg: RunConfig, env_cls: type) -> tuple[list[Task], list[Task]]:
    """The run's training tasks and its evaluation tasks (none without `eval.every`)."""
    train_tasks = cfg.env.load_tasks(env_cls, "train", cfg.seed)
    if not cfg.eval.every:
        return train_tasks, []
    eval_tasks = cfg.env.load_tasks(env_cls, cfg.eval.split, cfg.seed)[: cfg.eval.num_tasks]
    if not eval_tasks:  # it would log NaN eval metrics every eval.every steps
        raise ConfigError(
            f"eval.every={cfg.eval.every} but {cfg.env.name} has no tasks in split "
            f"{cfg.eval.split!r} (eval.split); set eval.every: 0 or another split"
        )
    return train_tasks, eval_tasks


def resume_from_checkpoint(
    learner: Learner, run_dir: Path, stream: TaskStream
) -> tuple[int, tuple[Path, dict] | None]:
    """Load the newest usable checkpoint of `run_dir` into `learner` and `stream` (its position
    and the groups admitted but not trained), and the random state: (the step to start at, the
    checkpoint found or None). Before anything is written: a run that cannot resume leaves its
    directory as it was."""
    try:
        found = checkpoint.restore(
            run_dir / "checkpoints",
            learner.load,
            check=learner.is_main,
            all_ranks=learner.all_ranks,
            strict=True,
        )
    except checkpoint.NoUsableCheckpoint as e:  # never silently start again from step 0 over them
        raise ConfigError(
            f"{e}\nif the config changed since they were written "
            f"({run_dir / 'config.yaml'} holds that run's), restore it; to start a "
            "new run, use another output_dir"
        ) from None
    if found is None:
        return 0, None
    _, manifest = found  # damaged checkpoints were skipped, on every rank alike
    stream.position = int(manifest["data_position"])
    stream.resume = [int(p) for p in manifest.get("pending_positions", [])]
    checkpoint.set_rng_state(manifest["rng"])  # after the setup: only steps draw from it
    return int(manifest["step"]), found


def cpu_sharing(run: Run, threads: str) -> tuple[int | None, str]:
    """The local engine's decoding threads, and the start-up line's thread part. When the engine
    samples while the learner trains on the CPU (max_staleness >= 1), the two share the run's
    threads (`share_cpu`; `engine.threads` chooses the engine's, the learner then keeps the run's);
    otherwise each runs alone and uses them all."""
    cfg = run.cfg
    if cfg.engine.kind != "local" or run.learner.accelerator.device.type != "cpu":
        return cfg.engine.threads, threads
    if cfg.engine.threads is not None or not cfg.train.max_staleness:
        return cfg.engine.threads, threads
    engine, learner = share_cpu(torch.get_num_threads())
    set_train_threads(learner)
    return engine, f"{threads}; sampling beside training: engine {engine}, learner {learner}"


def start_main_rank(
    run: Run,
    model_path: Path,
    tokenizer: Any,
    eval_tasks: list[Task],
    *,
    threads: str,
    resumed_from: Path | None,
) -> None:
    """Rank 0's part of the start: the run directory's files, the effective algorithm, the
    template check, the engine and the logger."""
    cfg, start = run.cfg, run.steps_done
    run.run_dir.mkdir(parents=True, exist_ok=True)
    (run.run_dir / "config.yaml").write_text(dump_config(cfg))
    print(describe_algorithm(cfg.advantage, cfg.loss, cfg.shaping), flush=True)
    if (world := run.learner.accelerator.num_processes) > 1:
        print(
            f"processes: {world} ({run.learner.accelerator.distributed_type.value}); rank 0 rolls "
            "out, every rank trains",
            flush=True,
        )
    envs = (
        [(s.make_env, s.train, s.entry.audit) for s in run.mixture.sources.values()]
        if run.mixture
        else [(run.make_env, run.stream.tasks, cfg.env.audit)]
    )
    if run.mixture:
        print(describe_mixture(run.mixture), flush=True)
    for make_env, tasks, audit_cfg in envs:
        check_env_at_start(make_env(), tasks[0])
        audit = audit_at_start(make_env, tasks, audit_cfg)  # known reward hacks
        print(run.loop.run_until_complete(audit), flush=True)
        # Refuse a template that would make the learner see tokens the model never saw.
        mode = require_token_safe(run.chat, make_env(), tasks[0], seed=cfg.seed).mode
    print(f"chat template: {run.chat.template_source}, token mode: {mode}", flush=True)
    engine_threads, threads = cpu_sharing(run, threads)
    run.engine = build_engine(
        cfg.engine,
        model_path,
        tokenizer,
        seed=cfg.seed,
        weights_dtype=cfg.learner.dtype,
        threads=engine_threads,
        learner_device=str(run.learner.accelerator.device),
    )
    print(describe_precision(run.learner.precision, run.engine, threads), flush=True)
    print(f"attention: {run.learner.attention.path} ({run.learner.attention.reason})", flush=True)
    run.sync = WeightSync(run.engine, cfg.weight_sync)
    # SGLang: servers loaded, their versions and context length read, before the first push
    run.loop.run_until_complete(wait_ready(run.engine, seeded=True))
    if resumed_from is not None:
        # Newer ones that were skipped leave the run: later saves, prunes and resumes ignore them.
        aside = checkpoint.set_aside_newer(run.run_dir / "checkpoints", start)
        print(
            f"resumed from {resumed_from} at step {start}"
            + (f"; set aside {', '.join(p.name for p in aside)}" if aside else ""),
            flush=True,
        )
    # Rows of steps after the one resumed from (or after 0: a run killed before its first
    # checkpoint) are trained again: theirs from the cut-off timeline go aside, not twice in the
    # logs.
    moved = {k: n for k, n in set_aside_after(run.run_dir, start).items() if n}
    if moved:
        print(
            f"log rows of steps after {start} set aside: "
            + ", ".join(
                f"{n} of {k} -> {aside_name(run.run_dir, k, start)}" for k, n in moved.items()
            ),
            flush=True,
        )
    run.logger = RunLogger.from_config(run.run_dir, cfg)
    run.eval_tasks = eval_tasks
