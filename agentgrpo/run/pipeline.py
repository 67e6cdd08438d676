"""Groups sampled continuously, trained within a bound on their staleness (`train.max_staleness`).

The synchronous loop samples a step's groups, trains on them, and samples again: the engine idles
while the learner trains, and the learner waits for the step's slowest episode. Here a producer
keeps the engine busy: it admits groups as long as each can still be trained within `k` updates of
the weights it starts with, and the learner takes a step's groups as soon as they are ready.

Staleness. A group admitted while the learner is at version `v` (v updates applied; the engine
serves v or, mid-push, newer) samples every token with weights `v` or newer, so trained at step `s`
its policy lag (`s` minus the oldest version that sampled any of its tokens) is at most `s - v`.
Each group therefore gets a *deadline* `v + k`, the last step that may train it, and a *slot*, the
step it is meant for, with at most `per_step` groups per slot and every slot at or before its
group's deadline:

- admission: a new group goes into the earliest slot in `[v, v + k]` with room (none: the producer
  waits for the learner). This is the throttle: at most `(k + 1) * per_step` groups are ahead of
  the learner, and none starts unless it can finish within the bound (AReaL bounds its rollouts in
  the same spirit; here the bound is per group, not only on a count).
- step `s` trains the groups of slot `s`. Before waiting for a late one, the learner lets it trade
  places with a finished group of a later slot that is still within its deadline (a long-tailed
  episode moves back, up to its deadline; a fast group moves forward), and fills free room in slot
  `s` with finished groups of later slots. It waits only for a group whose deadline is `s` itself.
  So no group is ever trained beyond `k`, and none is discarded for being slow: discarding biases
  training toward the fast tasks.

Dynamic sampling: a finished group that `keep` rejects (all rewards equal) leaves its slot, which
the producer fills again; after `max_dropped` rejections in one slot it takes no more (the step
trains on what it has, as the synchronous loop does after `shaping.max_extra_rounds`).

Each group is named by its task's place in the task stream (`position`), from which the caller
derives its task and seeds. `pending()` lists the positions admitted and not trained yet, in
admission order: a checkpoint stores them, and the resumed run admits them first
(`agentgrpo.run.train`), so no task is lost or trained twice across a stop.

`k = 0` is the synchronous loop (slot `v` only, admitted once the learner is at `v`) and `k = 1`
one step of overlap; the training loop keeps its own code for those two (`agentgrpo.run.overlap`)
and uses this class from `k = 2` on; the benchmark (`bench/async_pipeline.py`) runs it for every
`k`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(eq=False)
class Ticket(Generic[T]):
    """One admitted group: where it stands in the pipeline."""

    position: int  # the task's place in the stream: names the group, its task and seeds
    version: int  # the learner's version when it was admitted
    deadline: int  # the last step that may train it: version + k
    slot: int  # the step it is meant for (<= deadline)
    admitted_at: float = field(default_factory=time.monotonic)
    job: asyncio.Task | None = None

    @property
    def finished(self) -> bool:
        return self.job is not None and self.job.done()


class StalenessPipeline(Generic[T]):
    """The bounded-staleness producer and the learner's side of it (see the module docstring).

    `produce(ticket)` samples the group of `ticket.position` (its task and seeds follow from it);
    `next_position()` hands out the next new position (called only when a group is admitted).
    `resume` lists positions to admit before any new one (a checkpoint's pending groups). `steps`:
    the run's last step + 1, past which nothing is admitted. Call `start()` on the event loop,
    `take(step)` for each step's groups, `advance(version)` once the engine serves the new weights,
    and `close()` at the end.
    """

    def __init__(
        self,
        produce: Callable[[Ticket[T]], Awaitable[T]],
        next_position: Callable[[], int],
        *,
        per_step: int,
        max_staleness: int,
        steps: int,
        version: int = 0,
        resume: Iterable[int] = (),
        keep: Callable[[T], bool] | None = None,
        max_dropped: int | None = None,
    ) -> None:
        if per_step < 1:
            raise ValueError(f"per_step must be >= 1, got {per_step}")
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        self.produce, self.next_position = produce, next_position
        self.per_step, self.k, self.steps = per_step, max_staleness, steps
        self.version = version
        self.next_step = version  # slots before it were trained: nothing is admitted there
        self.resume = list(resume)
        self.keep, self.max_dropped = keep, max_dropped
        self.tickets: list[Ticket[T]] = []  # admitted, not taken, in admission order
        self.dropped: dict[int, int] = {}  # slot -> groups `keep` rejected there
        self.admitted = self.rejected = 0
        self._changed = asyncio.Event()
        self._producer: asyncio.Task | None = None
        self._error: BaseException | None = None

    # -- the learner's side ----------------------------------------------------------------------

    def start(self) -> None:
        """Start admitting (on the running event loop)."""
        if self._producer is None:
            self._producer = asyncio.ensure_future(self._admit_forever())

    async def take(self, step: int) -> list[T]:
        """The groups step `step` trains on, once they are ready: every group of slot `step`
        finished, after late ones traded places with finished groups of later slots where their
        deadline allows. In admission order."""
        if step != self.version:
            raise ValueError(f"take({step}) while the learner is at version {self.version}")
        while True:
            self._raise_if_failed()
            self._rearrange(step)
            mine = self._slot(step)
            if all(t.finished for t in mine) and (len(mine) == self.per_step or self._closed(step)):
                break
            self._changed.clear()
            await self._changed.wait()
        for t in mine:
            self.tickets.remove(t)
        self.next_step = step + 1
        self._changed.set()
        return [t.job.result() for t in mine]

    def advance(self, version: int) -> None:
        """The engine serves the learner's weights `version` now: admit against it."""
        self.version = version
        self._changed.set()

    def pending(self) -> list[int]:
        """Positions admitted (or to be re-admitted) and not trained, in admission order: what a
        checkpoint stores."""
        return [t.position for t in self.tickets] + self.resume

    def in_flight(self) -> int:
        return sum(not t.finished for t in self.tickets)

    def ready_ahead(self) -> int:
        """Finished groups waiting for a later step than the learner's."""
        return sum(t.finished and t.slot > self.version for t in self.tickets)

    async def close(self) -> None:
        """Stop admitting and cancel every group in flight."""
        jobs = [t.job for t in self.tickets if t.job is not None]
        if self._producer is not None:
            jobs.append(self._producer)
        for job in jobs:
            job.cancel()
        await asyncio.gather(*jobs, return_exceptions=True)
        self._producer = None

    # -- the producer ----------------------------------------------------------------------------

    async def _admit_forever(self) -> None:
        try:
            while True:
                slot = self._free_slot()
                if slot is None:
                    self._changed.clear()
                    await self._changed.wait()
                    continue
                position = self.resume.pop(0) if self.resume else self.next_position()
                v = self.version
                ticket: Ticket[T] = Ticket(position, v, v + self.k, slot)
                ticket.job = asyncio.ensure_future(self.produce(ticket))
                ticket.job.add_done_callback(lambda _job, t=ticket: self._finished(t))
                self.tickets.append(ticket)
                self.admitted += 1
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - next_position failed: the learner raises it
            self._error = e
            self._changed.set()

    def _free_slot(self) -> int | None:
        """The earliest slot in [version, version + k], not trained yet and before `steps`, with
        room."""
        last = min(self.version + self.k, self.steps - 1)
        for s in range(max(self.version, self.next_step), last + 1):
            if len(self._slot(s)) < self.per_step and not self._closed(s):
                return s
        return None

    def _finished(self, ticket: Ticket[T]) -> None:
        job = ticket.job
        if job.cancelled():
            return
        if job.exception() is not None:
            self._error = self._error or job.exception()
        elif self.keep is not None and not self.keep(job.result()):
            self.tickets.remove(ticket)
            self.rejected += 1
            self.dropped[ticket.slot] = self.dropped.get(ticket.slot, 0) + 1
        self._changed.set()

    # -- slots -----------------------------------------------------------------------------------

    def _slot(self, s: int) -> list[Ticket[T]]:
        return [t for t in self.tickets if t.slot == s]

    def _closed(self, s: int) -> bool:
        return self.max_dropped is not None and self.dropped.get(s, 0) >= self.max_dropped

    def _rearrange(self, step: int) -> None:
        """Bring finished groups of later slots into slot `step`: into free room, and in place of
        a late group whose deadline lets it wait for the later slot."""
        ahead = sorted(
            (t for t in self.tickets if t.finished and t.slot > step), key=lambda t: t.slot
        )
        mine = self._slot(step)
        for late in [t for t in mine if not t.finished]:
            swap = next((t for t in ahead if t.slot <= late.deadline), None)
            if swap is not None:
                ahead.remove(swap)
                late.slot, swap.slot = swap.slot, step
        room = self.per_step - len(self._slot(step))
        for t in ahead[: max(room, 0)]:
            t.slot = step

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error
