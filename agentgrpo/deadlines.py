"""The deadlines of one episode: every await of the rollout runs under the earliest of its turn,
episode and step deadlines (absolute `time.monotonic()` times), and a passed deadline is a
`DeadlineExpired` naming which one, so the trajectory ends as TIMEOUT with the reason.

A tool call's own deadline (`tool_timeout_s`) counts only the time it runs, not the time it waits
for shared capacity (`WaitClock`, `waiting_for_capacity`, `run_charging_only_running_time`)."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

T = TypeVar("T")


class DeadlineExpired(Exception):
    """Raised inside an episode when one of its deadlines passes; `str(e)` names the deadline."""

    def __init__(self, which: str, detail: str) -> None:
        super().__init__(detail)
        self.which = which  # "turn" | "episode" | "step"


class Deadlines:
    """The absolute deadlines (time.monotonic) that bound every await of one episode."""

    def __init__(
        self,
        turn_timeout_s: float | None,
        episode_timeout_s: float | None,
        step_deadline: float | None,
    ) -> None:
        self.turn_timeout_s = turn_timeout_s
        now = time.monotonic()
        self.fixed: list[tuple[float, str, str]] = []
        if episode_timeout_s is not None:
            self.fixed.append(
                (
                    now + episode_timeout_s,
                    "episode",
                    f"episode deadline of {episode_timeout_s:g} s expired",
                )
            )
        if step_deadline is not None:
            self.fixed.append(
                (step_deadline, "step", "step deadline expired (rollout.step_timeout_s)")
            )
        self.turn: tuple[float, str, str] | None = None

    def start_turn(self, number: int) -> None:
        if self.turn_timeout_s is not None:
            self.turn = (
                time.monotonic() + self.turn_timeout_s,
                "turn",
                f"turn {number} exceeded its deadline of {self.turn_timeout_s:g} s",
            )

    def earliest(self) -> tuple[float, str, str] | None:
        found = self.fixed + ([self.turn] if self.turn else [])
        return min(found) if found else None

    async def run(self, aw: Awaitable[T]) -> T:
        """Await `aw` until the earliest deadline; raise DeadlineExpired when it passes first."""
        limit = self.earliest()
        if limit is None:
            return await aw
        at, which, detail = limit
        if at <= time.monotonic():
            if inspect.iscoroutine(aw):
                aw.close()  # never started: close it so Python does not warn it was never awaited
            raise DeadlineExpired(which, detail)
        try:
            if (
                _timeout_at is not None
            ):  # Python >= 3.11: no extra task per await (wait_for makes one)
                loop_time = asyncio.get_running_loop().time()  # the loop's clock may not be ours
                async with _timeout_at(loop_time + at - time.monotonic()):
                    return await aw
            return await asyncio.wait_for(aw, at - time.monotonic())
        except asyncio.TimeoutError:
            if time.monotonic() < at - 1e-3:
                raise  # raised by the awaited code itself, not by our deadline
            raise DeadlineExpired(which, detail) from None


_timeout_at = getattr(asyncio, "timeout_at", None)


# ---------------------------------------------------------------------------------------------
# Waiting for shared capacity is not the tool's running time


class WaitClock:
    """The time one tool call has spent waiting for shared capacity (a worker thread, a sandbox
    slot, or whatever its code marks with `waiting_for_capacity`).

    `ToolEnv` gives each call its own clock and charges only the rest to `tool_timeout_s`: an
    instant `print(2+2)` queued behind other episodes' sandbox jobs is load, not the model's
    choice, so it must not come back as a TOOL_TIMEOUT the model is trained on. A call that waits
    too long is still bounded by the turn, episode and step deadlines (a TIMEOUT, unscorable).
    Thread-safe: the waits are marked from worker threads and the sandbox's dispatcher.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waited = 0.0
        self._open = 0  # waits in progress (a call's concurrent sub-calls may overlap)
        self._since = 0.0  # start of the current stretch with at least one wait open

    def start(self) -> Callable[[], None]:
        """Open a wait; returns its `stop`, which may be called any number of times (a dispatch
        callback and the waiter's `finally` may both call it)."""
        with self._lock:
            if self._open == 0:
                self._since = time.monotonic()
            self._open += 1
        stopped = False

        def stop() -> None:
            nonlocal stopped
            with self._lock:
                if stopped:
                    return
                stopped = True
                self._open -= 1
                if self._open == 0:
                    self._waited += time.monotonic() - self._since

        return stop

    @property
    def waiting(self) -> bool:
        return self._open > 0

    def waited_s(self) -> float:
        """Seconds waited so far, the wait in progress included."""
        with self._lock:
            return self._waited + (time.monotonic() - self._since if self._open else 0.0)


_WAIT_CLOCK: contextvars.ContextVar[WaitClock | None] = contextvars.ContextVar(
    "agentgrpo_wait_clock", default=None
)


def start_wait() -> Callable[[], None]:
    """Open a wait on the clock of the tool call this code runs in and return its idempotent
    `stop`; outside a tool call both are no-ops. Context variables follow the call into
    `to_user_thread` workers, so a sandbox queue or a thread pool can mark its own waits."""
    clock = _WAIT_CLOCK.get()
    return clock.start() if clock is not None else _no_wait


def _no_wait() -> None:
    pass


@contextlib.contextmanager
def waiting_for_capacity() -> Iterator[None]:
    """Mark a stretch of a tool's code as waiting for a shared resource (a rate-limited API, a
    pool of workers): `tool_timeout_s` does not count it. A no-op outside a tool call."""
    stop = start_wait()
    try:
        yield
    finally:
        stop()


_WAIT_POLL_S = 0.05


async def run_charging_only_running_time(
    aw: Awaitable[T], timeout_s: float | None
) -> tuple[T, float]:
    """Await `aw` with a deadline of `timeout_s` seconds of time not spent waiting for capacity
    (None: no deadline, as for `asyncio.wait_for`).

    Returns the result and the seconds waited; raises `asyncio.TimeoutError` once the running
    time passes `timeout_s` (never while a wait is open), with `aw` cancelled. `aw` runs in a task
    of its own whose context holds a fresh `WaitClock`. While a wait is open the deadline is looked
    at every `_WAIT_POLL_S` at most (a wait ends in another thread, which does not wake this loop).
    """
    clock = WaitClock()

    async def with_clock() -> T:
        _WAIT_CLOCK.set(clock)  # the task runs in its own copy of the context
        return await aw

    task = asyncio.ensure_future(with_clock())
    start = time.monotonic()
    try:
        if timeout_s is None:
            return await task, clock.waited_s()
        while True:
            remaining = start + timeout_s + clock.waited_s() - time.monotonic()
            if remaining <= 0 and not clock.waiting:
                raise asyncio.TimeoutError(f"ran for more than {timeout_s:g} s")
            # while a wait is open `remaining` stays put: wake then and look again
            await asyncio.wait(
                {task}, timeout=max(remaining, _WAIT_POLL_S if clock.waiting else 1e-3)
            )
            if task.done():
                return task.result(), clock.waited_s()
    finally:
        if not task.done():
            # not awaited: a tool that ignores cancellation must not hold up the episode
            task.cancel()
            task.add_done_callback(_retrieve)


def _retrieve(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()  # read, so asyncio does not log "exception was never retrieved"
