"""The verifier audits: known reward hacks, and the same episode scored twice.

Reward-hack audit (`audit_env`): every hack of `hacks.py` that applies is played as a scripted
episode through the user's env (reset, the hack's turns, through `step` and the env's tools);
its reward is what `step` paid, or the env's rubric's score of the episode when it has one. A
hack that earns reward (more than 0, or than its control: the same episode without the trick) is
reported with its exact input. `agentgrpo check-env` prints the report; `train` runs it at
start-up and refuses to start when a hack pays, unless `env.audit.reward_hacks` says otherwise.

Determinism audit: each hack episode is played a second time in a separate env (a separate
sandbox job or session); a reward (or a rubric verifier's score) that differs between the two
marks that verifier flaky. In training, `recheck_groups` scores `recheck_per_group` members of
each group again with the rubric; a disagreement, or an env's own `flaky_verdict` in `env_info`,
makes the whole group unscorable (NaN): it is never trained on noise.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from agentgrpo.checks.env_check import example_arguments
from agentgrpo.checks.hacks import Attempt, answer_attempts, shell_tool, workspace_attempts
from agentgrpo.env.base import Env, ToolEnv, call_env, close_env, env_rubric
from agentgrpo.env.rubric import Rubric
from agentgrpo.types import (
    EnvStep,
    Group,
    InfrastructureError,
    Message,
    Score,
    StopReason,
    Task,
    ToolCall,
    Trajectory,
)

_CONCURRENT = 4  # hack episodes played at once


class AuditConfig(BaseModel):
    """The verifier audits run by `train` (`agentgrpo check-env` always runs them)."""

    model_config = ConfigDict(extra="forbid")

    reward_hacks: Literal["refuse", "warn", "skip"] = Field(
        "refuse",
        description="at start-up, a known hack that earns reward: refuse to train, warn, or skip "
        "the audit (not `off`: YAML reads that as false)",
    )
    tasks: int = Field(1, ge=1, le=64, description="tasks the start-up audit plays the hacks on")
    recheck_per_group: int = Field(
        1,
        ge=0,
        description="members of each group the rubric scores again; a disagreement makes the "
        "group unscorable (0: off)",
    )


class RewardHackError(RuntimeError):
    """A known hack earns reward from the env's verifier (and `env.audit.reward_hacks=refuse`)."""


@dataclass
class Outcome:
    """What one scripted episode scored: the reward, each rubric verifier's part, and why."""

    reward: float
    parts: dict[str, float] = field(default_factory=dict)
    detail: str = ""


@dataclass
class HackResult:
    attempt: Attempt
    task_id: str
    first: Outcome
    second: Outcome | None = None  # the replay in a separate env (the determinism audit)
    control: Outcome | None = None  # the attempt's control episode, when it has one

    @property
    def paid(self) -> bool:
        base = 0.0 if self.control is None else self.control.reward
        if not math.isfinite(base):
            base = 0.0
        return math.isfinite(self.first.reward) and self.first.reward > base + 1e-9

    def flaky(self) -> list[str]:
        """The verifiers (or "the env's reward") that scored the two plays differently."""
        if self.second is None:
            return []
        names = [
            n for n in self.first.parts if not _same(self.first.parts[n], self.second.parts.get(n))
        ]
        if not names and not _same(self.first.reward, self.second.reward):
            names = ["the env's reward"]
        return names


def _same(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is b
    return (math.isnan(a) and math.isnan(b)) or abs(a - b) <= 1e-9


@dataclass
class AuditReport:
    env: str
    results: list[HackResult]

    def paid(self) -> list[HackResult]:
        return [r for r in self.results if r.paid]

    def flaky(self) -> dict[str, list[HackResult]]:
        out: dict[str, list[HackResult]] = {}
        for r in self.results:
            for name in r.flaky():
                out.setdefault(name, []).append(r)
        return out

    @property
    def ok(self) -> bool:
        return not self.paid() and not self.flaky()

    def format(self) -> str:
        paid, flaky = self.paid(), self.flaky()
        lines = [
            f"reward-hack audit of {self.env}: "
            + (
                f"{len(paid)} of {len(self.results)} hacks earn reward"
                if paid
                else f"OK ({len(self.results)} hacks, none earns reward)"
            )
        ]
        for r in self.results:
            tag = f"PAID {r.first.reward:g}" if r.paid else f"ok {r.first.reward:g}"
            if r.control is not None:
                tag += f", control {r.control.reward:g}"
            lines.append(f"  [{tag}] {r.attempt.name} (task {r.task_id})")
            if r.paid:
                lines += ["      " + line for line in r.attempt.describe().splitlines()]
        lines.append(
            f"determinism audit of {self.env}: "
            + ("OK (every hack episode scored the same twice)" if not flaky else "FLAKY")
        )
        for name, rs in flaky.items():
            seen = ", ".join(
                f"{r.attempt.name}: {_score(r.first, name)} then {_score(r.second, name)}"
                for r in rs[:3]
            )
            lines.append(f"  [FLAKY] {name} scored one episode differently twice ({seen})")
        return "\n".join(lines)


def _score(o: Outcome | None, name: str) -> str:
    if o is None:
        return "-"
    return f"{o.parts.get(name, o.reward):g}"


# ---- playing a scripted episode -----------------------------------------------------------------


async def play(make_env: Callable[[], Env], task: Task, turns: Sequence[Message]) -> Outcome:
    """Reset a new env with `task`, play `turns`, score the episode; NaN (with why) when the env
    or its sandbox failed."""
    env = make_env()
    try:
        reset = await call_env(env.reset, seed=0, options={"task": task})
        messages, info, total = list(reset[0]), dict(reset[1]), 0.0
        for turn in turns:
            step = EnvStep.of(await call_env(env.step, turn))
            messages += [turn, *step.messages]
            total += float(step.reward)
            if step.stop_reason is not None:
                info.update(step.info)
                break
        rubric = env_rubric(env)
        if rubric is None:
            return Outcome(total)
    except InfrastructureError as e:
        return Outcome(math.nan, detail=f"unscorable: {e}")
    except Exception as e:  # noqa: BLE001 - the env's code failed on the hack: not a payment
        return Outcome(math.nan, detail=f"the env raised {type(e).__name__}: {e}")
    else:  # scored with the env still open (a session env's verifier reads its workspace)
        try:
            return await _rubric_outcome(rubric, task, messages, total, info)
        except InfrastructureError as e:
            return Outcome(math.nan, detail=f"unscorable: {e}")
    finally:
        await close_env(env)


async def _rubric_outcome(
    rubric: Rubric, task: Task, messages: list, total: float, info: dict
) -> Outcome:
    calls = sum(len(m.tool_calls or []) for m in messages if m.role == "assistant")
    traj = Trajectory(
        task_id=task.id,
        token_ids=[],
        loss_mask=[],
        logprobs=[],
        prompt_len=0,
        messages=messages,
        stop_reason=StopReason.COMPLETED,
        tool_calls=calls,
        reward=total,  # the env's own: the rubric's env_reward verifier reads it
        env_info=info,
    )
    res = await rubric.ascore(traj, task)
    return Outcome(res.score, dict(res.parts), res.detail)


def attempts_for(env: Env, task: Task) -> list[Attempt]:
    """The hacks that apply to `env` on `task`."""
    schemas = env.tool_schemas()
    calls = []
    if isinstance(env, ToolEnv) and schemas:
        fn = schemas[0]["function"]
        args = example_arguments(fn.get("parameters", {}))
        calls = [ToolCall(id="call_first", name=fn["name"], arguments=args)]
    out = answer_attempts(task, calls)
    if (shell := shell_tool(schemas)) is not None:
        out += workspace_attempts(*shell)
    return out


async def audit_env(
    make_env: Callable[[], Env], tasks: Sequence[Task], *, replay: bool = True
) -> AuditReport:
    """Play every applicable hack on each task (twice, in separate envs, with `replay`)."""
    probe = make_env()
    try:
        plan = [(t, a) for t in tasks for a in attempts_for(probe, t)]
    finally:
        await close_env(probe)
    slots = asyncio.Semaphore(_CONCURRENT)

    async def one(task: Task, attempt: Attempt) -> HackResult:
        async with slots:
            first = await play(make_env, task, attempt.turns)
            second = await play(make_env, task, attempt.turns) if replay else None
            control = None
            if attempt.control is not None:
                control = await play(make_env, task, attempt.control)
        return HackResult(attempt, task.id, first, second, control)

    results = await asyncio.gather(*(one(t, a) for t, a in plan))
    return AuditReport(type(probe).__name__, list(results))


async def audit_at_start(
    make_env: Callable[[], Env], tasks: Sequence[Task], cfg: AuditConfig
) -> str:
    """The start-up audit of `train`: its report but the hacks that earned nothing; raises
    RewardHackError when a hack pays and `cfg.reward_hacks` is "refuse"."""
    if cfg.reward_hacks == "skip":
        return "reward-hack audit: skipped (env.audit.reward_hacks=skip)"
    report = await audit_env(make_env, list(tasks)[: cfg.tasks])
    if report.paid() and cfg.reward_hacks == "refuse":
        raise RewardHackError(
            f"the verifier pays for known reward hacks, so training would learn them:\n"
            f"{report.format()}\nFix the verifier, or set env.audit.reward_hacks=warn to train "
            "anyway."
        )
    first = report.format().splitlines()
    return "\n".join(line for line in first if not line.startswith("  [ok"))


# ---- the NaN rule in training -------------------------------------------------------------------


async def recheck_groups(
    groups: Sequence[Group], rubric: Rubric | None, per_group: int, rng: random.Random
) -> tuple[list[Group], int]:
    """`groups` with every group whose verdict proved flaky made unscorable (NaN scores): a member
    the rubric scores differently a second time (`per_group` scorable members sampled per group),
    or one whose env reported `flaky_verdict`. Also returns how many groups that was."""
    out, flaky = [], 0
    for group in groups:
        why = next(
            (
                f"the env's verifier disagreed with itself on {t.task_id}"
                for t in group.trajectories
                if t.env_info.get("flaky_verdict")
            ),
            None,
        )
        scorable = [
            t for t in group.trajectories if group.score(t).parts and not group.score(t).unscorable
        ]
        if why is None and rubric is not None and per_group and scorable:
            for t in rng.sample(scorable, min(per_group, len(scorable))):
                parts, again = group.score(t).parts, await rubric.ascore(t, group.task)
                names = [n for n, v in parts.items() if not _same(v, again.parts.get(n))]
                if names:
                    why = (
                        f"verifier {names[0]!r} scored a member {parts[names[0]]:g}, "
                        f"then {again.parts.get(names[0])}"
                    )
                    break
        if why is not None:
            flaky += 1
            group = dataclasses.replace(
                group, scores={k: _unscorable(s, why) for k, s in group.scores.items()}
            )
        out.append(group)
    return out, flaky


def _unscorable(score: Score, why: str) -> Score:
    detail = "; ".join(x for x in (score.detail, f"flaky verdict: {why}") if x)
    return dataclasses.replace(score, reward=math.nan, detail=detail)


async def recheck_step(
    groups: Sequence[Group], make_env: Callable[[], Env], cfg: AuditConfig, *, seed: int
) -> tuple[list[Group], int]:
    """`recheck_groups` for one training step (its members sampled with `seed`): the groups, the
    flaky ones made unscorable, and how many those were."""
    env = make_env()
    try:
        rubric = env_rubric(env)
    finally:
        await close_env(env)
    return await recheck_groups(groups, rubric, cfg.recheck_per_group, random.Random(seed))
