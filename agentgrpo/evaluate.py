"""Evaluation: rollouts without training over a task set (`agentgrpo eval CONFIG`).

`evaluate(...)` samples `samples_per_task` trajectories per task with the rollout machinery of
training (same deadlines, limits and token handling) and reduces them to metrics: reward mean,
pass@k, tool-call and error statistics. `run_eval(cfg)` is the command-line glue: it builds the
model, engine, chat format and env from a run config, evaluates the newest checkpoint of the run
(or the base model), and writes a run-like directory: `trajectories.jsonl` (the same rows as
training, `step` = the checkpoint's step), `metrics.jsonl` (one row) and `eval.json` (metrics plus
per-task pass counts).

Decisions:
- pass@k uses the unbiased estimator of Chen et al. (2021), `1 - C(n-c, k) / C(n, k)` per task,
  averaged over tasks, computed as a product so large n does not overflow. A trajectory passes when
  its reward is at least `success_threshold`.
- Unscorable trajectories (infrastructure errors and timeouts, reward NaN) are left out of n and c,
  as they are left out of training statistics; a task left with fewer than k scorable samples is
  left out of pass@k, and `pass@k/tasks` says how many tasks it averages.
- The step deadline of the rollout config does not apply: an evaluation has no step.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from agentgrpo.chat import ChatFormat
from agentgrpo.engine.base import Engine
from agentgrpo.env import Env
from agentgrpo.rollout import RolloutConfig, collect, rollout_metrics
from agentgrpo.types import Group, Task, Trajectory

if TYPE_CHECKING:
    from agentgrpo.config import RunConfig


class EvalConfig(BaseModel):
    """What `agentgrpo eval` samples and how it scores; sampling settings come from `rollout`."""

    model_config = ConfigDict(extra="forbid")

    split: str = Field("eval", description="task split passed to Env.load_tasks")
    every: int = Field(0, ge=0, description="during training: evaluate every K steps, logged as eval/* (0 = never)")
    num_tasks: int | None = Field(100, ge=1, description="the first N tasks of the split (None = all)")
    samples_per_task: int = Field(4, ge=1, description="trajectories per task (the n of pass@k)")
    pass_k: list[int] = Field(default_factory=lambda: [1], description="k values of pass@k, each <= samples_per_task")
    success_threshold: float = Field(1.0, description="a trajectory passes when its reward is >= this")
    checkpoint: str = Field("latest", description="'latest' = newest checkpoint of output_dir (else the base "
                            "model), 'none' = the base model, or a checkpoint directory")
    output_dir: str | None = Field(None, description="where results go (None = <output_dir>/eval-<split>)")

    @model_validator(mode="after")
    def _k_fits(self) -> EvalConfig:
        bad = [k for k in self.pass_k if not 1 <= k <= self.samples_per_task]
        if bad:
            raise ValueError(f"pass_k {bad}: each k must be between 1 and samples_per_task ({self.samples_per_task})")
        return self


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one task with n samples of which c passed: 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def _mean(xs: Sequence[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else math.nan


def eval_metrics(groups: Sequence[Group], pass_k: Sequence[int], success_threshold: float) -> dict[str, float]:
    """Reward, pass@k, tool and error statistics of evaluated groups (one group per task)."""
    trajs: list[Trajectory] = [t for g in groups for t in g.trajectories]
    scored = [t.reward for t in trajs if not math.isnan(t.reward)]
    calls = sum(t.tool_calls for t in trajs)
    out: dict[str, float] = {
        "tasks": float(len(groups)),
        "trajectories": float(len(trajs)),
        "reward_mean": _mean(scored),
        "success_rate": _mean([float(r >= success_threshold) for r in scored]),
        "turns_mean": _mean([t.num_turns for t in trajs]),
        "response_tokens_mean": _mean([t.num_sampled for t in trajs]),
        "tool_calls_mean": _mean([t.tool_calls for t in trajs]),
        "tool_errors_mean": _mean([t.tool_errors for t in trajs]),
        "tool_error_rate": sum(t.tool_errors for t in trajs) / calls if calls else 0.0,
    }
    for k in pass_k:
        per_task = []
        for g in groups:
            rewards = [t.reward for t in g.trajectories if not math.isnan(t.reward)]
            if len(rewards) >= k:
                per_task.append(pass_at_k(len(rewards), sum(r >= success_threshold for r in rewards), k))
        out[f"pass@{k}"] = _mean(per_task)
        out[f"pass@{k}/tasks"] = float(len(per_task))
    out.update(rollout_metrics(groups))
    return out


@dataclass
class EvalResult:
    metrics: dict[str, float]
    groups: list[Group]


async def evaluate(env_factory: Callable[[], Env], engine: Engine, chat: ChatFormat, tasks: Sequence[Task],
                   rollout: RolloutConfig, cfg: EvalConfig, *, seed: int = 0, context_len: int | None = None,
                   on_done: Callable[[Trajectory], None] | None = None) -> EvalResult:
    """Sample `cfg.samples_per_task` trajectories per task and compute the metrics."""
    sampling = rollout.model_copy(update={"group_size": cfg.samples_per_task, "step_timeout_s": None})
    groups = await collect(env_factory, engine, chat, tasks, sampling, seed=seed, context_len=context_len,
                           on_done=on_done)
    return EvalResult(eval_metrics(groups, cfg.pass_k, cfg.success_threshold), groups)


# ---------------------------------------------------------------------------------------------
# Command-line glue


def resolve_weights(cfg: RunConfig, base: Path) -> tuple[Path, int]:
    """The weights `eval.checkpoint` names and the training step they come from (0 = base model)."""
    from agentgrpo import checkpoint

    choice = cfg.eval.checkpoint
    if choice == "none":
        return base, 0
    if choice == "latest":
        found = checkpoint.latest(Path(cfg.output_dir) / "checkpoints")
        return (found[0], int(found[1]["step"])) if found else (base, 0)
    path = Path(choice)
    if not path.is_dir():
        raise FileNotFoundError(f"eval.checkpoint {choice!r} is not a directory")
    manifest = path / checkpoint.MANIFEST
    return path, int(json.loads(manifest.read_text())["step"]) if manifest.is_file() else 0


def run_eval(cfg: RunConfig, *, engine: Engine | None = None) -> tuple[Path, EvalResult]:
    """`agentgrpo eval`: evaluate the run's policy on `cfg.eval.split`; returns (output dir, result).

    `engine` replaces the LocalEngine built from the config (tests pass a scripted one).
    """
    import asyncio

    from transformers import AutoConfig, AutoTokenizer

    from agentgrpo.env import get_env_class
    from agentgrpo.log import RunLogger
    from agentgrpo.models import default_model_path
    from agentgrpo.template_audit import require_token_safe

    base = Path(cfg.model.path) if cfg.model.path else default_model_path()
    weights, step = resolve_weights(cfg, base)
    tokenizer = AutoTokenizer.from_pretrained(base)
    template = Path(cfg.model.chat_template).read_text() if cfg.model.chat_template else None
    chat = ChatFormat(tokenizer, template=template, parser=cfg.model.tool_parser,
                      fallback=cfg.rollout.template_fallback, template_kwargs=cfg.rollout.chat_template_kwargs)
    env_cls = get_env_class(cfg.env.name)
    make_env = lambda: env_cls(**cfg.env.kwargs)  # noqa: E731 - one env instance per trajectory
    tasks = list(env_cls.load_tasks(cfg.eval.split, seed=cfg.seed, **cfg.env.tasks))[: cfg.eval.num_tasks]
    if not tasks:
        raise ValueError(f"{cfg.env.name} has no tasks in split {cfg.eval.split!r}")
    report = require_token_safe(chat, make_env(), tasks[0], seed=cfg.seed)
    what = (f"{weights} (step {step})" if cfg.engine.kind == "local"
            else "the weights loaded in the SGLang servers")  # eval.checkpoint applies to the local engine
    print(f"chat template: mode {report.mode}; evaluating {what} on {len(tasks)} {cfg.eval.split} tasks x "
          f"{cfg.eval.samples_per_task} samples", flush=True)
    context_len = getattr(AutoConfig.from_pretrained(weights), "max_position_embeddings", None)

    async def main(engine: Engine | None) -> EvalResult:
        owned = engine is None
        if engine is None:
            from agentgrpo.train import build_engine

            engine = build_engine(cfg, weights, tokenizer)
        try:
            return await evaluate(make_env, engine, chat, tasks, cfg.rollout, cfg.eval, seed=cfg.seed,
                                  context_len=context_len)
        finally:
            if owned and (aclose := getattr(engine, "aclose", None)) is not None:
                await aclose()
            elif owned and (close := getattr(engine, "close", None)) is not None:
                close()

    result = asyncio.run(main(engine))
    out_dir = Path(cfg.eval.output_dir or Path(cfg.output_dir) / f"eval-{cfg.eval.split}")
    logger = RunLogger(out_dir, tensorboard=False)
    try:
        logger.log_groups(step, result.groups)
        logger.log_step(step, result.metrics)
    finally:
        logger.close()
    summary: dict[str, Any] = {
        "step": step, "weights": str(weights), "split": cfg.eval.split,
        "metrics": {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in result.metrics.items()},
        "tasks": [{"task_id": g.task.id, "group_id": g.group_id,
                   "passed": sum(not math.isnan(t.reward) and t.reward >= cfg.eval.success_threshold
                                 for t in g.trajectories),
                   "scored": sum(not math.isnan(t.reward) for t in g.trajectories)} for g in result.groups],
    }
    (out_dir / "eval.json").write_text(json.dumps(summary, indent=1))
    return out_dir, result


def format_metrics(metrics: dict[str, float]) -> str:
    """The headline numbers, one per line, for the terminal."""
    keys = ["tasks", "trajectories", "reward_mean", "success_rate"]
    keys += sorted(k for k in metrics if k.startswith("pass@") and not k.endswith("/tasks"))
    keys += ["turns_mean", "tool_calls_mean", "tool_error_rate", "unscorable"]
    keys += sorted(k for k in metrics if k.startswith(("stop/", "tool_errors/", "timeout/")))
    return "\n".join(f"{k:>28}: {metrics[k]:.4g}" for k in keys if k in metrics)
