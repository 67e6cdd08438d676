"""The deadlines of one episode: every await of the rollout runs under the earliest of its turn,
episode and step deadlines (absolute `time.monotonic()` times), and a passed deadline is a
`DeadlineExpired` naming which one, so the trajectory ends as TIMEOUT with the reason."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")

class DeadlineExpired(Exception):
    """Raised inside an episode when one of its deadlines passes; `str(e)` names the deadline."""

    def __init__(self, which: str, detail: str) -> None:
        super().__init__(detail)
        self.which = which  # "turn" | "episode" | "step"


class Deadlines:
    """The absolute deadlines (time.monotonic) that bound every await of one episode."""

    def __init__(self, turn_timeout_s: float | None, episode_timeout_s: float | None,
                 step_deadline: float | None) -> None:
        self.turn_timeout_s = turn_timeout_s
        now = time.monotonic()
        self.fixed: list[tuple[float, str, str]] = []
        if episode_timeout_s is not None:
            self.fixed.append((now + episode_timeout_s, "episode",
                               f"episode deadline of {episode_timeout_s:g} s expired"))
        if step_deadline is not None:
            self.fixed.append((step_deadline, "step", "step deadline expired (rollout.step_timeout_s)"))
        self.turn: tuple[float, str, str] | None = None

    def start_turn(self, number: int) -> None:
        if self.turn_timeout_s is not None:
            self.turn = (time.monotonic() + self.turn_timeout_s, "turn",
                         f"turn {number} exceeded its deadline of {self.turn_timeout_s:g} s")

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
            if _timeout_at is not None:  # Python >= 3.11: no extra task per await (wait_for makes one)
                loop_time = asyncio.get_running_loop().time()  # the loop's clock may not be ours
                async with _timeout_at(loop_time + at - time.monotonic()):
                    return await aw
            return await asyncio.wait_for(aw, at - time.monotonic())
        except asyncio.TimeoutError:
            if time.monotonic() < at - 1e-3:
                raise  # raised by the awaited code itself, not by our deadline
            raise DeadlineExpired(which, detail) from None


_timeout_at = getattr(asyncio, "timeout_at", None)
