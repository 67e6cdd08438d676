"""The one scheduler of the training loop: groups sampled within a bound on their staleness.

A producer keeps the engine busy: it admits groups as long as each can still be trained within
`k = train.max_staleness` updates of the weights it starts with, and the learner takes a step's
groups as soon as they are ready. `k = 0` is the synchronous loop (a step's groups are admitted
once the learner serves its weights, nothing samples while it trains), `k = 1` samples the next
step while this one trains, and larger `k` lets long-tailed groups run over several steps. How
the bound holds (slots, deadlines, trades), dynamic sampling, checkpoint fences and resuming are
described in docs/rollouts.md ("One scheduler for every max_staleness").

Each group is named by its task's place in the task stream (`position`), from which the caller
derives its task and seeds; `pending()` lists the positions admitted and not trained, which a
checkpoint stores and the resumed run admits first. Nothing here knows about models or engines:
the benchmark (`bench/async_pipeline.py`) drives it with a simulated engine.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
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
    # done and judged by `keep`: set by the job's callback, which runs after the job is done (a
    # group whose job is done but not yet judged must not be trained)
    finished: bool = False


@dataclass
class Taken(Generic[T]):
    """What `take(step)` hands the learner: the step's groups, in admission order, and what
    dynamic sampling did for it."""

    groups: list[T]
    rejected: int = 0  # finished groups of this step that `keep` rejected
    replaced: int = 0  # of those, how many a newly admitted group replaced


class StalenessPipeline(Generic[T]):
    """The bounded-staleness producer and the learner's side of it (see the module docstring).

    `produce(ticket)` samples the group of `ticket.position` (its task and seeds follow from it);
    `next_position()` hands out the next new position (called only when a group is admitted).
    `resume` lists positions to admit before any new one (a checkpoint's pending groups). `steps`:
    the run's last step + 1, past which nothing is admitted. `keep(group)`: dynamic sampling, False
    drops a finished group; at most `max_replaced` dropped groups per step are replaced by new
    admissions (None: all), the others shrink the step. `fenced(step)`: a checkpoint is planned
    after `step`, so nothing admitted before it may be trained after it (see `fence`). `trade`:
    False keeps every group in the slot it was admitted for (a step waits for its late groups), so
    which step trains a group does not depend on timing (deterministic runs).
    Call `start()` on the event loop, `take(step)` for each step's groups, `settle(step + 1)`
    before the weights change, `advance(version)` once the engine serves the new weights, and
    `close()` at the end.
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
        max_replaced: int | None = None,
        fenced: Callable[[int], bool] | None = None,
        trade: bool = True,
    ) -> None:
        if per_step < 1:
            raise ValueError(f"per_step must be >= 1, got {per_step}")
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        if max_replaced is not None and max_replaced < 0:
            raise ValueError(f"max_replaced must be >= 0 or None, got {max_replaced}")
        self.produce, self.next_position = produce, next_position
        self.per_step, self.k, self.steps = per_step, max_staleness, steps
        self.version = version
        self.next_step = version  # slots before it were trained: nothing is admitted there
        self.resume = list(resume)
        self.keep, self.max_replaced = keep, max_replaced
        self.fenced = fenced or (lambda step: False)
        self.trade = trade
        self.fence_at: int | None = None  # an unplanned checkpoint after this step (`fence`)
        self.tickets: list[Ticket[T]] = []  # admitted, not taken, in admission order
        self.rejected_in: Counter[int] = Counter()  # slot -> groups `keep` rejected there
        self.replaced_in: Counter[int] = Counter()  # slot -> of them, replaced by a new admission
        self.admitted = self.rejected = 0
        self._changed = asyncio.Event()
        self._producer: asyncio.Task | None = None
        self._error: BaseException | None = None

    # -- the learner's side ----------------------------------------------------------------------

    def start(self) -> None:
        """Start admitting (on the running event loop)."""
        if self._producer is None:
            self._producer = asyncio.ensure_future(self._admit_forever())

    async def take(self, step: int) -> Taken[T]:
        """The groups step `step` trains on, once they are ready: every group of slot `step`
        finished, after late ones traded places with finished groups of later slots where their
        deadline allows. In admission order."""
        if step != self.version:
            raise ValueError(f"take({step}) while the learner is at version {self.version}")
        while True:
            self._raise_if_failed()
            if self.trade:
                self._rearrange(step)
            mine = self._slot(step)
            if all(t.finished for t in mine) and len(mine) >= self._capacity(step):
                break
            self._changed.clear()
            await self._changed.wait()
        for t in mine:
            self.tickets.remove(t)
        self.next_step = step + 1
        self._changed.set()
        rejected, replaced = self.rejected_in.pop(step, 0), self.replaced_in.pop(step, 0)
        return Taken([t.job.result() for t in mine], rejected, replaced)

    async def settle(self, step: int) -> None:
        """Wait until every group that step `step` must train (its deadline) has finished: call
        it before the weights change for that step to spare them a weight change mid-episode (an
        SGLang push without partial rollouts aborts and resends their requests). At k = 1 that is
        every group in flight: the training loop settles there, so each group samples with one
        version. At k >= 2 it would hold back admissions until the stragglers finish, which cost
        throughput (docs/performance.md, the pipeline): the loop does not settle there."""
        while True:
            self._raise_if_failed()
            if all(t.finished for t in self.tickets if t.deadline <= step):
                return
            self._changed.clear()
            await self._changed.wait()

    def fence(self, step: int) -> list[int]:
        """A checkpoint follows `step`, decided only now (a time-based one): the groups admitted
        for later slots are withdrawn (cancelled, finished or not) and admitted again first, with
        the weights the checkpoint saves; nothing is admitted for them before. So no group sampled
        before a checkpoint is trained after it, and a run resumed from it samples what this one
        does. Returns the withdrawn positions, in admission order."""
        later = [t for t in self.tickets if t.slot > step]
        for t in later:
            self.tickets.remove(t)
            if t.job is not None:
                t.job.cancel()
        for slot in [s for s in self.rejected_in | self.replaced_in if s > step]:
            self.rejected_in.pop(slot, None)
            self.replaced_in.pop(slot, None)
        withdrawn = [t.position for t in later]
        self.resume = withdrawn + self.resume
        self.fence_at = step
        return withdrawn

    def advance(self, version: int) -> None:
        """The engine serves the learner's weights `version` now: admit against it."""
        self.version = version
        if self.fence_at is not None and self.fence_at < version:
            self.fence_at = None
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
        """The earliest slot in [version, version + k], not trained yet, before `steps` and not
        past the next checkpoint, with room."""
        last = min(self.version + self.k, self.steps - 1)
        if self.fence_at is not None:
            last = min(last, self.fence_at)
        last = next((s for s in range(self.version, last) if self.fenced(s)), last)
        for s in range(max(self.version, self.next_step), last + 1):
            if len(self._slot(s)) < self._capacity(s):
                return s
        return None

    def _finished(self, ticket: Ticket[T]) -> None:
        job = ticket.job
        if job.cancelled() or ticket not in self.tickets:  # withdrawn by a fence, or closing
            return
        ticket.finished = True
        if job.exception() is not None:
            self._error = self._error or job.exception()
        elif self.keep is not None and not self.keep(job.result()):
            self.tickets.remove(ticket)
            self.rejected += 1
            self.rejected_in[ticket.slot] += 1
            # the slot's room is filled again while its budget lasts, else the step shrinks
            if self.max_replaced is None or self.replaced_in[ticket.slot] < self.max_replaced:
                self.replaced_in[ticket.slot] += 1
        self._changed.set()

    # -- slots -----------------------------------------------------------------------------------

    def _slot(self, s: int) -> list[Ticket[T]]:
        return [t for t in self.tickets if t.slot == s]

    def _capacity(self, s: int) -> int:
        """How many groups slot `s` trains: `per_step`, less the rejections past the budget."""
        return self.per_step - (self.rejected_in[s] - self.replaced_in[s])

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
