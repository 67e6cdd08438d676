"""Groups and steps: the G episodes of one task from one env seed, scored together, and a step's
groups gathered under shared bounds and the step's deadline; what they did, as metrics."""

from __future__ import annotations

import asyncio
import math
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from agentgrpo.chat.format import ChatFormat
from agentgrpo.engine.base import Completion, Engine, SamplingParams
from agentgrpo.env.base import Env, close_env, env_rubric
from agentgrpo.env.rubric import Rubric, score_group
from agentgrpo.env.runner import EpisodeRunner
from agentgrpo.env.tool import stuck_user_calls
from agentgrpo.rollout.config import EpisodeLimits, RolloutConfig
from agentgrpo.rollout.seeds import episode_seed
from agentgrpo.rollout.turns import run_episode
from agentgrpo.types import Group, Score, StopReason, Task, Trajectory


def _empty_trajectory(
    task: Task, reason: StopReason, detail: str, deadline: str | None = None
) -> Trajectory:
    return Trajectory(
        task_id=task.id,
        token_ids=(),
        loss_mask=(),
        logprobs=(),
        prompt_len=0,
        messages=task.prompt_messages(),
        stop_reason=reason,
        stop_detail=detail,
        deadline=deadline,  # type: ignore[arg-type]
    )


# ---------------------------------------------------------------------------------------------
# Groups and steps


class BoundedEngine:
    """An Engine that lets at most `limit` requests of this process reach `engine` at once.

    The bound keeps a remote server's queue (and our open connections) small when thousands of
    trajectories are in flight; requests over it wait here, inside their turn's deadline.
    """

    def __init__(self, engine: Engine, limit: int) -> None:
        self.engine = engine
        self._slots = asyncio.Semaphore(limit)

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
        async with self._slots:
            return await self.engine.generate(prompt_ids, params)

    async def update_weights(self, weights: Any, *, version: str) -> None:
        await self.engine.update_weights(weights, version=version)


async def _run_new_env(
    env_factory: Callable[[], Env],
    engine: Engine,
    chat: ChatFormat,
    task: Task,
    params: SamplingParams,
    limits: EpisodeLimits,
    **kwargs: Any,
) -> tuple[Trajectory, Rubric | None, str]:
    """One episode on a new env: its record, the env's rubric, and what closing the env said.

    With a rubric the reward waits for the group (`score_group`), and the episode runs without
    the tool-error penalty (the rubric's reward gets it). An env that runs its own episodes
    (`EpisodeRunner`: an AgentEnv) is handed the episode. The env is closed once the episode has
    ended, whatever ended it (cancellation included); a `close` that fails is noted, and the
    episode's outcome stands.
    """
    try:
        env = env_factory()
    except Exception as e:  # noqa: BLE001 - the env's constructor is user code
        detail = f"creating the env raised {type(e).__name__}: {e}"
        return _empty_trajectory(task, StopReason.ENV_ERROR, detail), None, ""
    try:
        try:
            rubric = env_rubric(env)
        except Exception as e:  # noqa: BLE001 - a rubric property is user code
            detail = f"the env's rubric: {type(e).__name__}: {e}"
            traj, rubric = _empty_trajectory(task, StopReason.ENV_ERROR, detail), None
        else:
            if rubric is not None:
                limits = limits.model_copy(update={"tool_error_penalty": 0.0})
            if isinstance(env, EpisodeRunner):
                run = env.run_own_episode(engine, chat, task, params, limits=limits, **kwargs)
            else:
                run = run_episode(env, engine, chat, task, params, limits=limits, **kwargs)
            traj = await run
    finally:
        problem = await close_env(env)
    return traj, rubric, problem or ""


async def _acquire(slots: asyncio.Semaphore, deadline: float | None) -> bool:
    """Wait for an episode slot until the step's deadline; False when the deadline passed first.
    Only this wait is timed here: an episode ends on its own deadlines (`run_episode`)."""
    wait = None if deadline is None else max(0.0, deadline - time.monotonic())
    try:
        await asyncio.wait_for(slots.acquire(), wait)
    except asyncio.TimeoutError:
        return False
    return True


async def run_group(
    env_factory: Callable[[], Env],
    engine: Engine,
    chat: ChatFormat,
    task: Task,
    group_size: int,
    params: SamplingParams,
    *,
    seed: int | None = None,
    group_id: str | None = None,
    limits: EpisodeLimits = EpisodeLimits(),
    context_len: int | None = None,
    deadline: float | None = None,
    slots: asyncio.Semaphore | None = None,
    on_done: Callable[[Trajectory, Score], None] | None = None,
) -> Group:
    """Sample `group_size` trajectories of one task concurrently, all from the same env seed, and
    score them.

    Member i samples with `episode_seed(params.seed, member=i, turn=k)` on turn k, so members
    differ; the env seed is shared so all members start from the same state. `seed=None` draws
    one env seed for the whole group (from the OS), never one per member. `slots` bounds the
    episodes in flight (shared by all groups of a step); `deadline` is the step's absolute
    deadline, which also bounds scoring. Member i's record is sealed with id `<group_id>/<i>`.
    Its `Score` is its own reward, or, when the env has a `rubric`, the rubric's once all members
    have ended (`agentgrpo.env.rubric.score_group`); `on_done(trajectory, score)` is called as each
    has one.
    """
    gid = group_id or task.id
    rubrics: list[Rubric | None] = [None] * group_size
    if seed is None:  # each env would seed itself from the OS: members would start apart
        seed = secrets.randbits(32)

    async def one(i: int) -> Trajectory:
        p = replace(params, seed=episode_seed(params.seed, member=i), session_id=f"{gid}/{i}")
        start, problem = time.monotonic(), ""
        if slots is None or await _acquire(slots, deadline):
            try:
                traj, rubrics[i], problem = await _run_new_env(
                    env_factory,
                    engine,
                    chat,
                    task,
                    p,
                    limits,
                    seed=seed,
                    context_len=context_len,
                    deadline=deadline,
                )
            finally:
                if slots is not None:
                    slots.release()
        else:
            detail = "step deadline expired before the episode started"
            traj = _empty_trajectory(task, StopReason.TIMEOUT, detail, deadline="step")
        traj = replace(  # sealed: named, timed, and what closing its env said
            traj,
            id=f"{gid}/{i}",
            group_id=gid,
            wall_s=round(time.monotonic() - start, 4),
            stop_detail="; ".join(x for x in (traj.stop_detail, problem) if x),
        )
        if on_done is not None and rubrics[i] is None:
            on_done(traj, Score(traj.id, traj.reward))
        return traj

    trajs = list(await asyncio.gather(*(one(i) for i in range(group_size))))
    by_rubric = [(t, r) for t, r in zip(trajs, rubrics, strict=True) if r is not None]
    scores = {t.id: Score(t.id, t.reward) for t in trajs}
    scores |= await _rubric_scores(by_rubric, task, limits.tool_error_penalty, deadline)
    group = Group(group_id=gid, task=task, trajectories=trajs, scores=scores)
    if on_done is not None:
        for t, _ in by_rubric:
            on_done(t, group.score(t))
    return group


async def _rubric_scores(
    by_rubric: list[tuple[Trajectory, Rubric]],
    task: Task,
    penalty: float,
    deadline: float | None,
) -> dict[str, Score]:
    """The rubric's scores of a group's members whose env has one, by trajectory id; those that
    ended with an infrastructure failure keep their own (NaN)."""
    scorable = [t for t, _ in by_rubric if not t.stop_reason.is_infra_error]
    if not scorable:
        return {}
    rubric = by_rubric[0][1]
    scored = await score_group(
        rubric, scorable, task, tool_error_penalty=penalty, deadline=deadline
    )
    return {s.trajectory_id: s for s in scored}


# Which env plays a task, and under which episode limits (a mixture of envs: agentgrpo.run.mixture).
EnvRoute = Callable[[Task], tuple[Callable[[], Env], EpisodeLimits]]


class GroupSampler:
    """Samples groups under bounds that every group in flight shares: at most
    `max_concurrent_trajectories` episodes and `max_concurrent_requests` engine requests at once,
    however many groups run (one step's in `collect`, several steps' in the asynchronous pipeline).
    `seed` is the run's: a group's seeds follow from it and the group's draw (`episode_seed`).
    `on_done(trajectory, score)` is called as each trajectory finishes (and is scored, when the env
    has a rubric). `route`, when given, picks each task's env and episode limits (else
    `env_factory` and `cfg`): a group is one task, so it never mixes envs."""

    def __init__(
        self,
        env_factory: Callable[[], Env],
        engine: Engine,
        chat: ChatFormat,
        cfg: RolloutConfig,
        *,
        seed: int = 0,
        context_len: int | None = None,
        on_done: Callable[[Trajectory, Score], None] | None = None,
        route: EnvRoute | None = None,
    ) -> None:
        self.env_factory, self.chat, self.cfg, self.seed = env_factory, chat, cfg, seed
        self.context_len, self.on_done, self.route = context_len, on_done, route
        self.params = cfg.sampling_params()
        self.slots = (
            None
            if cfg.max_concurrent_trajectories is None
            else asyncio.Semaphore(cfg.max_concurrent_trajectories)
        )
        self.engine = (
            engine
            if cfg.max_concurrent_requests is None
            else BoundedEngine(engine, cfg.max_concurrent_requests)
        )

    async def group(
        self,
        task: Task,
        *,
        draw: int,
        group_id: str | None = None,
        deadline: float | None = None,
    ) -> Group:
        """The group of `task` drawn `draw`-th (its place in the task stream, or in the task list
        of an evaluation): its members share the env seed `episode_seed(seed, draw=draw)` and
        sample from it (`run_group`). `group_id` defaults to `<draw>:<task id>`."""
        group_seed = episode_seed(self.seed, draw=draw)
        env_factory, limits = (
            self.route(task) if self.route is not None else (self.env_factory, self.cfg)
        )
        return await run_group(
            env_factory,
            self.engine,
            self.chat,
            task,
            self.cfg.group_size,
            replace(self.params, seed=group_seed),
            seed=group_seed,
            group_id=group_id or f"{draw}:{task.id}",
            limits=limits,
            context_len=self.context_len,
            deadline=deadline,
            slots=self.slots,
            on_done=self.on_done,
        )


async def collect(
    env_factory: Callable[[], Env],
    engine: Engine,
    chat: ChatFormat,
    tasks: Sequence[Task],
    cfg: RolloutConfig,
    *,
    seed: int = 0,
    draws: Sequence[int] | None = None,
    context_len: int | None = None,
    on_done: Callable[[Trajectory, Score], None] | None = None,
    route: EnvRoute | None = None,
) -> list[Group]:
    """All groups of one step, concurrently, within the config's bounds and step deadline.

    `seed` is the run's; `draws` name each task's group (training: the tasks' positions in the
    task stream; default: their index), which decides its seeds (`GroupSampler.group`).
    `on_done` is called as each trajectory finishes (and is scored, when the env has a rubric);
    `route` picks each task's env and limits (`GroupSampler`).
    """
    draws = range(len(tasks)) if draws is None else draws
    if len(draws) != len(tasks):
        raise ValueError(f"{len(tasks)} tasks but {len(draws)} draws")
    sampler = GroupSampler(
        env_factory,
        engine,
        chat,
        cfg,
        seed=seed,
        context_len=context_len,
        on_done=on_done,
        route=route,
    )
    deadline = None if cfg.step_timeout_s is None else time.monotonic() + cfg.step_timeout_s
    return list(
        await asyncio.gather(
            *(
                sampler.group(task, draw=d, deadline=deadline)
                for d, task in zip(draws, tasks, strict=True)
            )
        )
    )


def rollout_metrics(groups: Sequence[Group]) -> dict[str, float]:
    """What a step's (or an evaluation's) trajectories did, for metrics.jsonl.

    Means over the trajectories (NaN when there are none): `reward_mean` / `reward_std` (over the
    scorable ones), `turns_mean`, `tool_calls_mean`, `tool_errors_mean`, `response_tokens_mean`
    (sampled tokens); `sampled_tokens` in all. Counts:
    `stop/<reason>`: trajectories per StopReason; `timeout/<turn|episode|step>`: which deadline
    ended them; `tool_errors/<kind>`: malformed or failed tool calls per ToolErrorKind;
    `tool_outputs_truncated`: tool messages cut to `max_tool_output_tokens`; `unscorable`:
    trajectories with a NaN reward (left out of their group's statistics); `reward_parts/<name>`:
    the mean score of each rubric verifier over the trajectories it could score;
    `user_threads_stuck`: sync user calls that overran a deadline and still hold a worker thread now
    (process-wide, read when called; see `agentgrpo.env.tool.stuck_user_calls`).
    """
    scored = [(t, g.score(t)) for g in groups for t in g.trajectories]
    trajs = [t for t, _ in scored]
    rewards = [s.reward for _, s in scored if math.isfinite(s.reward)]

    def mean(xs: Sequence[float]) -> float:
        return float(sum(xs) / len(xs)) if xs else math.nan

    reward_mean = mean(rewards)
    out: dict[str, float] = {
        "reward_mean": reward_mean,
        "reward_std": math.sqrt(mean([(r - reward_mean) ** 2 for r in rewards])),
        "turns_mean": mean([t.num_turns for t in trajs]),
        "tool_calls_mean": mean([t.tool_calls for t in trajs]),
        "tool_errors_mean": mean([t.tool_errors for t in trajs]),
        "response_tokens_mean": mean([t.num_sampled for t in trajs]),
        "sampled_tokens": float(sum(t.num_sampled for t in trajs)),
    }
    parts: dict[str, list[float]] = {}

    def add(key: str, n: float = 1.0) -> None:
        out[key] = out.get(key, 0.0) + n

    for t, score in scored:
        add(f"stop/{t.stop_reason.value}")
        if t.stop_reason == StopReason.TIMEOUT:
            add(f"timeout/{t.deadline or 'episode'}")
        for kind, n in t.tool_error_kinds.items():
            add(f"tool_errors/{kind}", n)
        add("tool_outputs_truncated", t.tool_outputs_truncated)
        add("unscorable", float(score.unscorable))
        for name, v in score.parts.items():
            if math.isfinite(v):
                parts.setdefault(name, []).append(v)
    out.update({f"reward_parts/{name}": sum(vs) / len(vs) for name, vs in parts.items()})
    out["user_threads_stuck"] = float(stuck_user_calls())
    return out
