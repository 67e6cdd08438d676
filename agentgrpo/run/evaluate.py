"""Evaluation: rollouts without training over a task set (`agentgrpo eval CONFIG`).

`evaluate(...)` samples `samples_per_task` trajectories per task with the rollout machinery of
training and reduces them to metrics: reward, pass@k, tool-call and error statistics.
`run_eval(cfg)` is the command-line glue: it evaluates a run's checkpoint (or the base model) and
writes a run-like directory (`trajectories.jsonl`, `metrics.jsonl`, `eval.json`), replacing the
files of an earlier evaluation there.

Decisions (docs/learner.md, "Evaluating a checkpoint", gives the reasons):
- pass@k is the unbiased estimator `1 - C(n-c, k) / C(n, k)`, computed as a product.
- Unscorable trajectories (reward NaN) count in neither n nor c; the step deadline does not apply.
- The weights reach the engine as in training (`WeightSync`, verified by the probe), so every
  checkpoint format evaluates alike. The checkpoint is chosen as resume chooses it; a run whose
  checkpoints all fail is an error, never silently the base model.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoTokenizer

from agentgrpo.chat.format import ChatFormat
from agentgrpo.checks.env_check import check_env_at_start
from agentgrpo.checks.template_audit import require_token_safe
from agentgrpo.engine.base import Engine, close_all, wait_ready
from agentgrpo.engine.config import build_engine
from agentgrpo.engine.weight_sync import WeightSync
from agentgrpo.env.base import Env
from agentgrpo.learner import state as learner_state
from agentgrpo.learner.learner import LearnerConfig
from agentgrpo.learner.logprobs import PolicyForward
from agentgrpo.learner.lora import MergedModel, apply_lora
from agentgrpo.models.embedded import default_model_path, load_model
from agentgrpo.rollout.episode import EnvRoute, RolloutConfig, collect, rollout_metrics
from agentgrpo.run import checkpoint
from agentgrpo.run.config import ConfigError, EvalConfig, RunConfig
from agentgrpo.run.log import RunLogger
from agentgrpo.types import Group, Score, Task, Trajectory


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one task with n samples of which c passed: 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def _mean(xs: Sequence[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else math.nan


def eval_metrics(
    groups: Sequence[Group], pass_k: Sequence[int], success_threshold: float
) -> dict[str, float]:
    """Reward, pass@k, tool and error statistics of evaluated groups (one group per task): the
    training steps' `rollout_metrics`, plus success rate, tool error rate and pass@k."""
    trajs: list[Trajectory] = [t for g in groups for t in g.trajectories]
    scored = [r for g in groups for r in g.rewards if not math.isnan(r)]
    calls = sum(t.tool_calls for t in trajs)
    out: dict[str, float] = {
        "tasks": float(len(groups)),
        "trajectories": float(len(trajs)),
        "success_rate": _mean([float(r >= success_threshold) for r in scored]),
        "tool_error_rate": sum(t.tool_errors for t in trajs) / calls if calls else 0.0,
    }
    for k in pass_k:
        per_task = []
        for g in groups:
            rewards = [r for r in g.rewards if not math.isnan(r)]
            if len(rewards) >= k:
                per_task.append(
                    pass_at_k(len(rewards), sum(r >= success_threshold for r in rewards), k)
                )
        out[f"pass@{k}"] = _mean(per_task)
        out[f"pass@{k}/tasks"] = float(len(per_task))
    out.update(rollout_metrics(groups))
    return out


@dataclass
class EvalResult:
    metrics: dict[str, float]
    groups: list[Group]


async def evaluate(
    env_factory: Callable[[], Env],
    engine: Engine,
    chat: ChatFormat,
    tasks: Sequence[Task],
    rollout: RolloutConfig,
    cfg: EvalConfig,
    *,
    seed: int = 0,
    context_len: int | None = None,
    on_done: Callable[[Trajectory, Score], None] | None = None,
    route: EnvRoute | None = None,
) -> EvalResult:
    """Sample `cfg.samples_per_task` trajectories per task and compute the metrics (`route`: each
    task's env and limits, for a mixture). Task i's group has the seeds of draw i under `seed`
    (`agentgrpo.rollout.seeds.episode_seed`)."""
    sampling = rollout.model_copy(
        update={"group_size": cfg.samples_per_task, "step_timeout_s": None}
    )
    groups = await collect(
        env_factory,
        engine,
        chat,
        tasks,
        sampling,
        seed=seed,
        context_len=context_len,
        on_done=on_done,
        route=route,
    )
    return EvalResult(eval_metrics(groups, cfg.pass_k, cfg.success_threshold), groups)


# ---------------------------------------------------------------------------------------------
# Command-line glue


def checkpoint_policy(
    directory: Path | None, base: Path, learner: LearnerConfig
) -> torch.nn.Module:
    """The policy the checkpoint in `directory` holds (None: the base model), built as the learner
    builds it and returned as `Learner.export_model()` hands it to weight sync: the transformers
    model in `learner.dtype`, or with LoRA the peft model seen through `MergedModel` (base names,
    adapters merged), so an engine receives exactly the weights training pushed.

    Either checkpoint format loads (`learner_state.load_weights`): full (HF safetensors, or the
    adapter alone with LoRA, the base coming from `base`) and sharded (`dcp/`, in this process).
    """
    model = load_model(base).to(getattr(torch, learner.dtype))
    if directory is None:
        return model
    if learner_state.holds_lora(directory) != (learner.lora is not None):
        held = "LoRA adapters" if learner.lora is None else "full weights"
        raise ConfigError(
            f"checkpoint {directory} holds {held} but learner.lora is {learner.lora}: evaluate "
            "with the config of the run that wrote it (learner.lora as in training)"
        )
    policy = apply_lora(model, learner.lora) if learner.lora is not None else model
    learner_state.load_weights(PolicyForward(policy), directory, lora=learner.lora is not None)
    return MergedModel(policy) if learner.lora is not None else policy


def resolve_policy(cfg: RunConfig, base: Path) -> tuple[Path | None, int, torch.nn.Module | None]:
    """The checkpoint `eval.checkpoint` names, its training step and its policy
    (`checkpoint_policy`); (None, 0, None) for the base model.

    `latest` picks the newest checkpoint of `output_dir` that verifies (checksums) and loads, as a
    resumed run does, skipping damaged ones with a warning. Never the base model in its place: no
    checkpoint at all (a misspelt `output_dir`) or none that loads is a ConfigError pointing to
    `eval.checkpoint=none`. A named directory must verify.
    """
    choice = cfg.eval.checkpoint
    if choice == "none":
        return None, 0, None
    loaded: list[torch.nn.Module] = []

    def load(directory: Path) -> None:
        loaded.append(checkpoint_policy(directory, base, cfg.learner))

    if choice == "latest":
        root = Path(cfg.output_dir) / "checkpoints"
        if not any(root.glob("step-*")):  # a misspelt output_dir, or a run not checkpointed yet
            raise ConfigError(
                f"eval.checkpoint=latest: no checkpoint under {root} (output_dir="
                f"{cfg.output_dir}); eval.checkpoint=none evaluates the base model"
            )
        found = checkpoint.restore(root, load)
        if found is None:
            raise ConfigError(
                f"no checkpoint under {root} verifies and loads (the warnings say why); "
                "eval.checkpoint=none evaluates the base model"
            )
        return found[0], int(found[1]["step"]), loaded[-1]
    path = Path(choice)
    if not path.is_dir():
        raise ConfigError(f"eval.checkpoint {choice!r} is not a directory")
    try:
        manifest = checkpoint.verify(path)
    except checkpoint.CorruptCheckpoint as e:
        raise ConfigError(f"eval.checkpoint {path} is not an intact checkpoint: {e}") from None
    load(path)
    return path, int(manifest["step"]), loaded[-1]


def refuse_mixture(cfg: RunConfig) -> None:
    """`agentgrpo eval` of a mixture (`envs:`) is not built: a ConfigError naming what is."""
    if cfg.envs is not None:
        raise ConfigError(
            "agentgrpo eval of a mixture (envs:) is not built yet: evaluate each env with its "
            "own env: section, or set eval.every in training (it evaluates every env and splits "
            "the metrics by env)"
        )


@dataclass
class _EvalJob:
    """What one `agentgrpo eval` has ready before its engine starts."""

    tokenizer: Any
    chat: ChatFormat
    make_env: Callable[[], Env]
    tasks: list[Task]
    step: int  # the evaluated checkpoint's training step (0: the base model)
    weights: Path  # the checkpoint directory, or the base model's
    policy: torch.nn.Module | None  # to push; dropped once the engine holds its own copy
    context_len: int | None


def _prepare(cfg: RunConfig, base: Path) -> _EvalJob:
    """Tokenizer, chat format, env and tasks, checked as training checks them at its start, and
    the policy to evaluate (`resolve_policy`)."""
    tokenizer = AutoTokenizer.from_pretrained(base)
    chat = cfg.chat_format(tokenizer)
    env_cls = cfg.env.env_class()
    make_env = lambda: env_cls(**cfg.env.kwargs)  # noqa: E731 - one env instance per trajectory
    tasks = cfg.env.load_tasks(env_cls, cfg.eval.split, cfg.seed)[: cfg.eval.num_tasks]
    if not tasks:
        raise ConfigError(f"{cfg.env.name} has no tasks in split {cfg.eval.split!r} (eval.split)")
    check_env_at_start(make_env(), tasks[0])
    report = require_token_safe(chat, make_env(), tasks[0], seed=cfg.seed)
    ckpt, step, policy = resolve_policy(cfg, base)
    if policy is None and cfg.engine.kind != "local":  # servers may hold any run's weights
        policy = checkpoint_policy(None, base, cfg.learner)
    weights = ckpt or base
    print(
        f"chat template: mode {report.mode}; evaluating {weights} (step {step}) on {len(tasks)} "
        f"{cfg.eval.split} tasks x {cfg.eval.samples_per_task} samples",
        flush=True,
    )
    context_len = getattr(AutoConfig.from_pretrained(base), "max_position_embeddings", None)
    return _EvalJob(tokenizer, chat, make_env, tasks, step, weights, policy, context_len)


def _sample(cfg: RunConfig, base: Path, job: _EvalJob, engine: Engine | None) -> EvalResult:
    """Start the engine (unless one is given), push `job.policy` to it and evaluate; an engine
    built here is closed here."""
    owned = engine is None
    if engine is None:
        engine = build_engine(cfg.engine, base, job.tokenizer, seed=cfg.seed)
    # Disk pushes go to a subdirectory: a training run with the same shared_dir pushes step_<N>
    # there too, and replacing or pruning its directories could pull them from under its servers.
    ws = cfg.weight_sync
    if ws.shared_dir:
        ws = ws.model_copy(update={"shared_dir": str(Path(ws.shared_dir) / "eval")})
    sync = WeightSync(engine, ws) if job.policy is not None else None
    loop = asyncio.new_event_loop()  # one loop for the engine's clients, the push and the rollouts
    try:
        # SGLang: servers loaded, versions and window read
        loop.run_until_complete(wait_ready(engine, seeded=True))
        if sync is not None:  # verified by the probe: the engine serves them
            loop.run_until_complete(sync.push(job.policy, job.step))
            job.policy = None  # the engine holds its own copy now
        return loop.run_until_complete(
            evaluate(
                job.make_env,
                engine,
                job.chat,
                job.tasks,
                cfg.rollout,
                cfg.eval,
                seed=cfg.seed,
                context_len=job.context_len,
            )
        )
    finally:
        closer = (
            (getattr(engine, "aclose", None) or getattr(engine, "close", None)) if owned else None
        )
        close_all(loop, sync and sync.close, closer)


def _eval_json(result: EvalResult, step: int, weights: Path, cfg: EvalConfig) -> dict[str, Any]:
    """`eval.json`: the metrics (NaN written as null) and each task's passed and scored counts."""
    return {
        "step": step,
        "weights": str(weights),
        "split": cfg.split,
        "metrics": {
            k: (None if isinstance(v, float) and math.isnan(v) else v)
            for k, v in result.metrics.items()
        },
        "tasks": [
            {
                "task_id": g.task.id,
                "group_id": g.group_id,
                "passed": sum(not math.isnan(r) and r >= cfg.success_threshold for r in g.rewards),
                "scored": sum(not math.isnan(r) for r in g.rewards),
            }
            for g in result.groups
        ],
    }


def run_eval(cfg: RunConfig, *, engine: Engine | None = None) -> tuple[Path, EvalResult]:
    """`agentgrpo eval`: evaluate the run's policy on `cfg.eval.split`; returns (output dir,
    result).

    The engine is built from the base model as in training (`build_engine`), and the evaluated
    checkpoint's weights are pushed to it by `WeightSync` (as training pushes them: in process for
    the local engine, to the servers by `weight_sync.method` for SGLang) and verified by the probe.
    SGLang servers always receive the weights evaluated, the base model's included, since they may
    hold any run's. `engine` replaces the engine built from the config (tests pass their own).
    """
    refuse_mixture(cfg)
    base = Path(cfg.model.path) if cfg.model.path else default_model_path()
    job = _prepare(cfg, base)
    result = _sample(cfg, base, job, engine)
    out_dir = Path(cfg.eval.output_dir or Path(cfg.output_dir) / f"eval-{cfg.eval.split}")
    logger = RunLogger(out_dir, tensorboard=False, fresh=True)
    try:
        logger.log_groups(job.step, result.groups)
        logger.log_step(job.step, result.metrics)
    finally:
        logger.close()
    summary = _eval_json(result, job.step, job.weights, cfg.eval)
    (out_dir / "eval.json").write_text(json.dumps(summary, indent=1))
    return out_dir, result


def format_metrics(metrics: dict[str, float]) -> str:
    """The headline numbers, one per line, for the terminal."""
    keys = ["tasks", "trajectories", "reward_mean", "success_rate"]
    keys += sorted(k for k in metrics if k.startswith("pass@") and not k.endswith("/tasks"))
    keys += ["turns_mean", "tool_calls_mean", "tool_error_rate", "unscorable"]
    keys += sorted(k for k in metrics if k.startswith(("stop/", "tool_errors/", "timeout/")))
    return "\n".join(f"{k:>28}: {metrics[k]:.4g}" for k in keys if k in metrics)
