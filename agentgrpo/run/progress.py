"""The live display of a training run (`Progress`): one bar per step, its phase, the time left,
and the seconds spent in each phase (logged as `phase_s/*` whether or not anyone watches).
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections import deque
from collections.abc import Callable
from typing import IO, Any

from tqdm.auto import tqdm

from agentgrpo.types import Score, Trajectory


def _is_terminal(file: IO[str]) -> bool:
    """A terminal a bar can redraw in place: a TTY with a width (a pty of 0 columns, as some CI
    runners allocate, makes tqdm print empty lines; such output gets the plain per-step lines)."""
    try:
        return file.isatty() and os.get_terminal_size(file.fileno()).columns > 0
    except (AttributeError, OSError, ValueError):  # StringIO, closed or detached streams
        return False


def _duration(s: float) -> str:
    s = max(0, int(round(s)))
    return (
        f"{s}s"
        if s < 60
        else f"{s // 60}m{s % 60:02d}s"
        if s < 3600
        else f"{s // 3600}h{s % 3600 // 60:02d}m"
    )


class Progress:
    """What a training run is doing now: one progress bar per step, its phase, and the time left.

    The bar of a step counts the rollouts finished so far and shows their running mean reward and
    sampled tokens per second; its label names the phase (rollout / train / sync / checkpoint /
    eval, or any name the loop passes). When a step ends it keeps the step's final reward, loss,
    tokens/s and the estimated time left (mean duration of the last 10 steps times the steps to go,
    minus the time already spent in the current step). On a terminal the bar updates in place; in a
    log file (not a TTY) it writes one plain line per step instead, with the seconds spent in each
    phase. `enabled=False` turns the display off; the phase timings (`phase_times`, logged as
    `phase_s/*`) are kept either way, so metrics do not depend on whether anyone watched.

    Example (the training loop's calls in one step, written to a log file; the clock moves 2 s
    per reading):
        >>> import itertools, sys
        >>> from agentgrpo.run.progress import Progress
        >>> clock = itertools.count(0.0, 2.0).__next__
        >>> progress = Progress(total_steps=30, file=sys.stdout, live=False, clock=clock)
        >>> progress.phase("rollout")  # then collect(..., on_done=progress.rollout_done)
        >>> progress.phase("train")  # then metrics = learner.train_step(rows)
        >>> progress.phase("sync")
        >>> progress.step_done(1, {"reward_mean": 0.5, "loss": 0.01})
        step 1/30 · reward 0.5 · loss 0.01 · ... · 6.0s (rollout 2.0s, train 2.0s, sync 2.0s) · ...
        >>> progress.close()
    """

    def __init__(
        self,
        total_steps: int,
        *,
        start_step: int = 0,
        rollouts_per_step: int | None = None,
        enabled: bool = True,
        file: IO[str] | None = None,
        live: bool | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.total_steps, self.step = total_steps, start_step  # `step`: steps finished so far
        self.rollouts_per_step = rollouts_per_step
        self.enabled = enabled
        self.file = file if file is not None else sys.stderr
        self.live = _is_terminal(self.file) if live is None else live
        self.clock = clock
        self._bar = None
        self._in_step = False
        self._phase = ""
        self._phase_t0 = self._step_t0 = 0.0
        self.phase_s: dict[str, float] = {}  # seconds per phase in the current (or last) step
        self._durations: deque[float] = deque(maxlen=10)
        self._n = self._tokens = self._rewards_n = 0
        self._rewards_sum = 0.0
        self._count_phase, self._count_t0, self._count_t_last = (
            "",
            0.0,
            0.0,
        )  # who reported rollouts, when

    # -- what the loop calls -------------------------------------------------------------------

    def phase(self, name: str, total: int | None = None) -> None:
        """Enter phase `name` (starts the next step's bar if no step is in progress).

        `total` is the number of rollouts the phase will report (default for "rollout":
        `rollouts_per_step`); the rollout counter and running reward restart with each phase
        that reports rollouts.
        """
        now = self.clock()
        if not self._in_step:
            if self.step >= self.total_steps:  # after the last step (final checkpoint): just say so
                if self.enabled:
                    print(
                        f"{name} after step {self.step}/{self.total_steps}",
                        file=self.file,
                        flush=True,
                    )
                return
            self._begin_step(now)
        self._close_phase(now)
        self._phase, self._phase_t0 = name, now
        if total is not None or name == "rollout":
            self._n = self._tokens = self._rewards_n = 0
            self._rewards_sum = 0.0
            self._count_phase, self._count_t0, self._count_t_last = name, now, now
            if self._bar is not None:
                self._bar.reset(total=total if total is not None else self.rollouts_per_step)
        self._refresh()

    def rollout_done(self, traj: Trajectory, score: Score) -> None:
        """One trajectory finished and scored (`collect(..., on_done=progress.rollout_done)`)."""
        if not self.enabled or not self._in_step:
            return
        self._n += 1
        self._count_t_last = self.clock()
        self._tokens += traj.num_sampled
        if math.isfinite(score.reward):
            self._rewards_sum += score.reward
            self._rewards_n += 1
        if self._bar is not None:
            if self._bar.total is not None and self._n > self._bar.total:
                self._bar.total = self._n  # dynamic sampling drew extra rounds
            self._refresh(force=False)
            self._bar.update(1)  # redraws at most every tqdm mininterval

    def step_done(self, step: int, metrics: dict[str, float]) -> None:
        """Step `step` (1-based, as logged) is finished; `metrics` are the ones written to
        metrics.jsonl."""
        now = self.clock()
        if not self._in_step:
            self._begin_step(now)
        self._close_phase(now)
        self._durations.append(now - self._step_t0)
        self.step, self._in_step, self._phase = step, False, "done"
        if not self.enabled:
            return
        parts = [
            f"reward {_fmt(metrics.get('reward_mean'))}"
            + (f" ± {_fmt(metrics['reward_std'])}" if "reward_std" in metrics else ""),
            f"loss {_fmt(metrics.get('loss'))}",
            f"{_fmt(metrics.get('tokens_per_s'), '.0f')} tok/s",
            f"{now - self._step_t0:.1f}s ("
            + ", ".join(f"{k} {v:.1f}s" for k, v in self.phase_s.items())
            + ")",
            f"eta {_duration(self.eta())}",
        ]
        if self._bar is not None:
            self._bar.set_description_str(f"step {step}/{self.total_steps} done", refresh=False)
            self._bar.set_postfix_str(" · ".join(parts))
            self._bar.close()
            self._bar = None
        else:
            print(
                f"step {step}/{self.total_steps} · " + " · ".join(parts), file=self.file, flush=True
            )

    def close(self) -> None:
        """Close a bar left open (the run failed or was interrupted inside a step)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        self._in_step = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- what it shows ------------------------------------------------------------------------

    def eta(self) -> float:
        """Seconds left: mean of the last (<= 10) step durations times the steps still to run,
        minus what the current step already took. NaN before the first step finished."""
        if not self._durations:
            return math.nan
        per_step = sum(self._durations) / len(self._durations)
        spent = self.clock() - self._step_t0 if self._in_step else 0.0
        return max(0.0, (self.total_steps - self.step) * per_step - spent)

    def phase_times(self) -> dict[str, float]:
        """Seconds spent in each phase of the current step so far (for `phase_s/<name>` metrics)."""
        out = dict(self.phase_s)
        if self._in_step and self._phase:
            out[self._phase] = out.get(self._phase, 0.0) + self.clock() - self._phase_t0
        return out

    def _begin_step(self, now: float) -> None:
        self._in_step, self._step_t0, self._phase = True, now, ""
        self.phase_s = {}
        if self.live and self.enabled:
            self._bar = tqdm(
                total=self.rollouts_per_step,
                file=self.file,
                leave=True,
                dynamic_ncols=True,
                desc=f"step {self.step + 1}/{self.total_steps}",
                unit="rollout",
                bar_format="{desc} |{bar:20}| {n_fmt}/{total_fmt} rollouts{postfix}",
            )

    def _close_phase(self, now: float) -> None:
        if self._phase:
            self.phase_s[self._phase] = self.phase_s.get(self._phase, 0.0) + now - self._phase_t0

    def _refresh(self, force: bool = True) -> None:
        if self._bar is None:
            return
        self._bar.set_description_str(
            f"step {self.step + 1}/{self.total_steps} · {self._phase}", refresh=False
        )
        span = self._count_t_last - self._count_t0
        label = "reward" if self._count_phase in ("rollout", "") else f"{self._count_phase} reward"
        reward = self._rewards_sum / self._rewards_n if self._rewards_n else math.nan
        eta = self.eta()
        self._bar.set_postfix_str(
            f"{label} {_fmt(reward)} · {_fmt(self._tokens / span if span > 0 else None, '.0f')} "
            f"tok/s · eta {_duration(eta) if math.isfinite(eta) else '?'}",
            refresh=force,
        )


def _fmt(v: Any, spec: str = ".4g") -> str:
    return format(v, spec) if isinstance(v, (int, float)) and math.isfinite(v) else "—"
