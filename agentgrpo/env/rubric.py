"""Rewards: the Verifier protocol and the Rubric that combines verifiers with weights.

A verifier is any callable `(trajectory, task) -> float | VerifierResult`, sync or async (plain
functions are fine; `verify.math.MathVerifier` and `verify.code.CodeVerifier` are ready-made).
NaN means "unscorable" (an infrastructure failure such as a sandbox error): the Rubric propagates
it, and the advantage step leaves that trajectory out of its group instead of treating it as 0.

    rubric = Rubric([("correct", MathVerifier(), 1.0), ("boxed", boxed, 0.1)])
    result = await rubric.ascore(trajectory, task)   # result.score, result.parts["correct"]

Declared on an env (`rubric = Rubric([...])`), it scores each finished group in `run_group`
(`score_group`), which makes every trajectory's `Score`, a record joined to it by id.
docs/environments.md ("Scoring with a rubric") has the rest.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from agentgrpo.env.tool import to_user_thread
from agentgrpo.types import Score, Task, Trajectory


@dataclass(frozen=True)
class VerifierResult:
    """A score with its explanation. `parts` holds named sub-scores (a Rubric fills it); `info`
    what the verifier recorded about its judgement, as JSON values (a judge's prompt and answer),
    which the Rubric keeps under the verifier's name in `Score.info`."""

    score: float
    detail: str = ""
    parts: dict[str, float] = field(default_factory=dict)
    info: Mapping[str, Any] = field(default_factory=dict)

    @property
    def unscorable(self) -> bool:
        return math.isnan(self.score)


@runtime_checkable
class Verifier(Protocol):
    """`(trajectory, task) -> float | VerifierResult`, or an awaitable of one."""

    def __call__(
        self, trajectory: Trajectory, task: Task, /
    ) -> float | VerifierResult | Awaitable: ...


GroupHook = Callable[[Sequence[Trajectory], Task, list[VerifierResult]], list[VerifierResult]]


def _as_result(name: str, value: object) -> VerifierResult:
    """A verifier's return value as a result; a wrong type or an infinite score is a bug in the
    verifier and raises here, naming it (an infinite reward would otherwise fail later, in the
    advantage step, without saying where it came from)."""
    if isinstance(value, bool | int | float):
        value = VerifierResult(float(value))
    if not isinstance(value, VerifierResult):
        raise TypeError(
            f"verifier {name!r} returned {type(value).__name__}; expected float or VerifierResult"
        )
    if math.isinf(value.score):
        raise ValueError(
            f"verifier {name!r} returned {value.score}; a score must be finite (NaN = unscorable)"
        )
    return value


def _is_async(fn: Callable) -> bool:
    return inspect.iscoroutinefunction(fn if inspect.isroutine(fn) else type(fn).__call__)


def _takes_two_args(fn: Callable) -> bool:
    try:
        inspect.signature(fn).bind(None, None)  # for an object, the signature of its __call__
        return True
    except TypeError:
        return False
    except ValueError:  # builtins without a signature: trust them
        return True


class Rubric:
    """Weighted sum of named verifiers, validated when built.

    reward = sum(weight_i * score_i) (divided by sum |weight_i| when `normalize`). A verifier with a
    non-zero weight that returns NaN, or raises, makes the reward NaN (unscorable) and the reason
    goes to `detail`; `strict=True` re-raises instead (useful in tests). Verifiers of one
    trajectory run concurrently; sync ones run in worker threads so they never block the loop.
    A verifier whose `scores_groups` is true is called once per group instead, as
    `await verifier.score_group(trajectories, task)` returning one score per trajectory (a judge
    that ranks a group relative to itself: `agentgrpo.verify.judge`). `group_hook`, if given,
    sees a whole group's results and may return adjusted ones (for within-group terms such as
    diversity or length ranks).
    """

    def __init__(
        self,
        verifiers: Sequence[tuple[str, Callable, float]],
        *,
        normalize: bool = False,
        strict: bool = False,
        group_hook: GroupHook | None = None,
    ) -> None:
        if not verifiers:
            raise ValueError("a Rubric needs at least one (name, verifier, weight)")
        names: set[str] = set()
        checked = []
        for item in verifiers:
            if not (isinstance(item, tuple) and len(item) == 3):
                raise ValueError(f"expected (name, verifier, weight) tuples, got {item!r}")
            name, fn, weight = item
            if not isinstance(name, str) or not name:
                raise ValueError(f"verifier name must be a non-empty string, got {name!r}")
            if name in names:
                raise ValueError(f"duplicate verifier name {name!r}")
            names.add(name)
            if not callable(fn):
                raise TypeError(f"verifier {name!r} is not callable")
            if not _takes_two_args(fn):
                raise TypeError(f"verifier {name!r} must accept (trajectory, task)")
            if (
                isinstance(weight, bool)
                or not isinstance(weight, int | float)
                or not math.isfinite(weight)
            ):
                raise ValueError(f"weight of {name!r} must be a finite number, got {weight!r}")
            checked.append((name, fn, float(weight)))
        total = sum(abs(w) for _, _, w in checked)
        if total == 0:
            raise ValueError("all Rubric weights are zero")
        if group_hook is not None and not callable(group_hook):
            raise TypeError("group_hook must be callable")
        self.verifiers = checked
        self.normalize, self.strict, self.group_hook = normalize, strict, group_hook
        self._scale = 1.0 / total if normalize else 1.0

    def __repr__(self) -> str:
        return "Rubric(" + ", ".join(f"{n}={w:g}" for n, _, w in self.verifiers) + ")"

    async def _one(
        self, name: str, fn: Callable, trajectory: Trajectory, task: Task
    ) -> tuple[VerifierResult, str]:
        try:
            if _is_async(fn):
                value = await fn(trajectory, task)
            else:
                value = await to_user_thread(fn, trajectory, task)
                if inspect.isawaitable(value):
                    value = await value
        except Exception as e:  # the verifier (or what it relies on) failed: unscorable, with why
            if self.strict:
                raise
            return VerifierResult(math.nan), f"{name}: {type(e).__name__}: {e}"
        return _as_result(name, value), ""  # a wrong return type is a bug: it raises

    async def _column(
        self, name: str, fn: Callable, trajectories: Sequence[Trajectory], task: Task
    ) -> list[tuple[VerifierResult, str]]:
        """One verifier's results for `trajectories`: one call per trajectory, or one call for
        all of them when the verifier scores groups (`scores_groups`, e.g. a judge ranking a
        group)."""
        if not getattr(fn, "scores_groups", False):
            return list(await asyncio.gather(*(self._one(name, fn, t, task) for t in trajectories)))
        try:
            values = list(await fn.score_group(trajectories, task))
        except Exception as e:  # the verifier (or what it relies on) failed: unscorable, with why
            if self.strict:
                raise
            return [(VerifierResult(math.nan), f"{name}: {type(e).__name__}: {e}")] * len(
                trajectories
            )
        if len(values) != len(trajectories):
            raise TypeError(
                f"verifier {name!r} scored {len(values)} of a group of {len(trajectories)}"
            )
        return [(_as_result(name, v), "") for v in values]  # a wrong return type is a bug

    def _combine(self, outs: Sequence[tuple[VerifierResult, str]]) -> VerifierResult:
        """One trajectory's total from its verifiers' results, in `self.verifiers`' order."""
        parts, notes, info, total = {}, [], {}, 0.0
        for (name, _, weight), (res, err) in zip(self.verifiers, outs, strict=True):
            parts[name] = res.score
            if res.info:
                info[name] = dict(res.info)
            if err:
                notes.append(err)
            elif res.detail:
                notes.append(f"{name}: {res.detail}")
            if weight != 0.0:
                total += weight * res.score  # NaN propagates: one unscorable part, unscorable total
        return VerifierResult(total * self._scale, "; ".join(notes), parts, info)

    async def ascore(self, trajectory: Trajectory, task: Task) -> VerifierResult:
        """Score one trajectory: total, per-verifier `parts`, and why (errors, NaNs, details). A
        verifier that scores groups sees a group of one."""
        columns = await asyncio.gather(
            *(self._column(n, fn, [trajectory], task) for n, fn, _ in self.verifiers)
        )
        return self._combine([c[0] for c in columns])

    async def __call__(self, trajectory: Trajectory, task: Task) -> VerifierResult:
        return await self.ascore(trajectory, task)

    async def ascore_group(
        self, trajectories: Sequence[Trajectory], task: Task
    ) -> list[VerifierResult]:
        """Score all trajectories of a group concurrently (a verifier that scores groups once,
        with all of them), then apply `group_hook`."""
        columns = await asyncio.gather(
            *(self._column(n, fn, trajectories, task) for n, fn, _ in self.verifiers)
        )
        results = [self._combine([c[i] for c in columns]) for i in range(len(trajectories))]
        if self.group_hook is not None:
            results = self.group_hook(trajectories, task, results)
            if len(results) != len(trajectories) or not all(
                isinstance(r, VerifierResult) for r in results
            ):
                raise TypeError("group_hook must return one VerifierResult per trajectory")
        return results

    def score(self, trajectory: Trajectory, task: Task) -> VerifierResult:
        """Sync `ascore`, for code without a running event loop."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(self.ascore(trajectory, task))
        raise RuntimeError(
            "Rubric.score() called inside a running event loop; use `await rubric.ascore(...)`"
        )


def env_reward(trajectory: Trajectory, task: Task) -> float:
    """Verifier: the rewards the env's `step` returned, summed over the episode.

    When an env has a rubric, the rubric's sum is the reward and the env's own is kept aside
    (`Trajectory.reward`, `Score.env_reward`); list this verifier in the rubric to count it, with a
    weight.
    """
    return float(trajectory.reward)


async def score_group(
    rubric: Rubric,
    trajectories: Sequence[Trajectory],
    task: Task,
    *,
    tool_error_penalty: float = 0.0,
    deadline: float | None = None,
) -> list[Score]:
    """The scores of the finished trajectories of one group under `rubric`, one per trajectory.

    `Score.reward` = the rubric's weighted sum minus `tool_error_penalty` per tool error (the
    rollout's penalty applies whatever scores the episode), `parts` = each verifier's score,
    `detail` = the rubric's notes, `info` = what verifiers recorded (by name), and `env_reward` =
    the trajectory's own reward. The rubric replaces the env's own reward, as in
    willccbb/verifiers, where the rubric alone scores a rollout: one place defines the reward, and
    the env's own stays visible in `env_reward` and countable through the `env_reward` verifier.
    `group_hook` sees all of `trajectories` (pass the group's scorable ones: infrastructure
    failures are NaN already and left out of the group statistics anyway).

    An unscorable result (a verifier raised or returned NaN, or the absolute `time.monotonic()`
    `deadline` passed while scoring) gives reward NaN, never 0, and says why in `detail`.
    """
    wait = None if deadline is None else max(0.0, deadline - time.monotonic())
    try:
        results = await asyncio.wait_for(rubric.ascore_group(trajectories, task), wait)
    except asyncio.TimeoutError:
        if deadline is None or time.monotonic() < deadline - 1e-3:
            raise  # raised by a verifier under strict=True, not by our deadline
        results = [
            VerifierResult(math.nan, "the step deadline expired while the rubric scored the group")
            for _ in trajectories
        ]
    scores = []
    for t, r in zip(trajectories, results, strict=True):
        reward, detail = r.score - tool_error_penalty * t.tool_errors, r.detail
        if math.isnan(r.score):
            nan_parts = [name for name, v in r.parts.items() if math.isnan(v)]
            why = r.detail or ("NaN from " + ", ".join(nan_parts) if nan_parts else "NaN score")
            reward, detail = math.nan, f"unscorable: {why}"
        scores.append(Score(t.id, reward, r.parts, detail, env_reward=t.reward, info=r.info))
    return scores
