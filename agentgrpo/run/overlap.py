"""How a learner step shares the machine with the engine.

- `train_while_collecting` (`train.max_staleness: 1`): the engine samples the next step's rollouts
  while the learner trains this one, one step off-policy.
- `train_beside` (`train.max_staleness` >= 2): the learner trains in its thread while the event
  loop runs the asynchronous pipeline's producer (`agentgrpo.run.pipeline`).
- `memory_lent` (`engine.sglang.release_memory_during_training`, and the local engine's prefix
  cache): nothing samples while the learner trains, so the engine hands its memory over for the
  step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

import torch

from agentgrpo.engine.base import Engine, release_memory, resume_memory
from agentgrpo.learner.learner import Learner

T = TypeVar("T")
# Overlapped train steps run in this one thread: in asyncio's shared pool a step landed on another
# thread each time and paid torch's per-thread warm-up again (bench/overlap.py: 5.6 s vs 2.4 s).
_TRAIN_THREAD = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="agentgrpo-train")


def set_train_threads(threads: int) -> None:
    """torch threads of the training thread (its own OpenMP team; other threads keep theirs)."""
    _TRAIN_THREAD.submit(torch.set_num_threads, threads).result()


async def train_while_collecting(
    train_step: Callable[[], dict[str, float]],
    collecting: Awaitable[T],
    abandon: Callable[[], bool],
) -> tuple[dict[str, float], T | None]:
    """Run the blocking `train_step()` in a worker thread while `collecting` runs on this event loop
    (the engine samples the next step while the learner trains), then wait for the collection, or
    cancel it when `abandon()` says so after training (a stop was requested) or the step failed."""
    task = asyncio.ensure_future(collecting)
    try:
        metrics = await asyncio.get_running_loop().run_in_executor(_TRAIN_THREAD, train_step)
        return metrics, (None if abandon() else await task)
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def train_beside(train_step: Callable[[], dict[str, float]]) -> dict[str, float]:
    """Run the blocking `train_step()` in the training thread while this event loop goes on
    running what it holds (the asynchronous pipeline's producer and episodes)."""
    return await asyncio.get_running_loop().run_in_executor(_TRAIN_THREAD, train_step)


@contextlib.contextmanager
def memory_lent(
    learner: Learner, engine: Engine | None, loop: asyncio.AbstractEventLoop, *, colocated: bool
) -> Iterator[None]:
    """While the learner trains and nothing samples, the engine lends it its memory: rank 0 has it
    released (`release_memory`: SGLang's weights and KV cache when `colocated`, the local engine's
    prefix cache, dead once the weights change) and resumed before the push. `colocated`: the
    servers share the learner's GPUs, so no rank trains before the release, and every rank returns
    its cached CUDA blocks before the resume."""
    sync = learner.accelerator.wait_for_everyone if colocated else lambda: None
    if learner.is_main:
        loop.run_until_complete(release_memory(engine))
    sync()
    try:
        yield
    except BaseException:
        if learner.is_main:  # best effort: the step's own error is the one to report
            with contextlib.suppress(Exception):
                loop.run_until_complete(resume_memory(engine))
        raise
    if colocated and torch.cuda.is_available():
        torch.cuda.empty_cache()
    sync()
    if learner.is_main:
        loop.run_until_complete(resume_memory(engine))
