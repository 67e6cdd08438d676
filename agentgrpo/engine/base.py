"""The inference-engine seam: what the rollout loop needs from any engine.

Rollout code depends only on this module. Engines take token ids and return token ids (TITO): the
caller never sends text, so what the learner trains on is exactly what the engine saw.
"""

from __future__ import annotations

import asyncio
import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from agentgrpo.types import InfrastructureError

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings for one request.

    `stop_token_ids` are added to the model's own end-of-turn/EOS ids; the matched stop token is
    returned as the last sampled id (never trimmed). `temperature == 0` means greedy.
    """

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    # The episode the request belongs to (every turn of it carries the same id): an engine with
    # several servers keeps a session's requests on one server while it is healthy, where its
    # prefix cache holds the episode so far. Not a sampling setting; engines may ignore it.
    session_id: str | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass
class Completion:
    """What an engine returns for one request.

    `token_ids` are the sampled ids, including the stop/EOS token when `finish_reason == "stop"`;
    `logprobs[i]` is the log-probability of `token_ids[i]` under the distribution it was sampled
    from (after temperature). `weight_version` names the weights that produced it: the version
    when the request finished. A request that ran across a weight update (partial rollouts: the
    engine swapped weights between two decode steps and kept the request) says which tokens came
    from which version in `version_runs`, run-length: `[(n1, v1), (n2, v2)]` = the first n1 ids
    from v1, the next n2 from v2; the counts sum to `len(token_ids)`. None = all from
    `weight_version` (`token_version_runs` reads both forms).
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    weight_version: str | None = None
    detail: str = ""  # why it finished when that is not obvious (context length, abort message)
    meta: dict[str, Any] = field(default_factory=dict)
    version_runs: list[tuple[int, str]] | None = None

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(
                f"Completion: {len(self.token_ids)} token ids but {len(self.logprobs)} logprobs"
            )
        if self.version_runs is not None:
            if any(n < 0 for n, _ in self.version_runs):
                raise ValueError(f"Completion: negative count in version_runs {self.version_runs}")
            if (total := sum(n for n, _ in self.version_runs)) != len(self.token_ids):
                raise ValueError(
                    f"Completion: version_runs cover {total} ids, the completion has "
                    f"{len(self.token_ids)}"
                )

    @property
    def token_version_runs(self) -> list[tuple[int, str | None]]:
        """(count, version) runs over `token_ids` in order, empty runs left out."""
        runs = self.version_runs or [(len(self.token_ids), self.weight_version)]
        return [(n, v) for n, v in runs if n > 0]


class EngineError(InfrastructureError):
    """The engine failed for infrastructure reasons (after its own retries). Never a model error."""


@runtime_checkable
class Engine(Protocol):
    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Completion: ...

    async def update_weights(self, weights: Any, *, version: str) -> None:
        """Load new policy weights. `weights` is a state dict (in-process engines) or a path to a
        directory of safetensors files that the engine can read."""
        ...


# Optional engine hooks. An engine without them is left alone: they are not part of `Engine`, so
# every engine written against the protocol keeps working.
#   async def wait_ready(self, *, seeded: bool) -> None: wait until the engine can serve (and, when
#       `seeded`, refuse if it cannot honour SamplingParams.seed); the training loop calls
#       it once, before the first weight push (SGLang: the servers have loaded the model, and
#       their versions and context lengths are read)
# These two are called by the training loop around a learner step that does not overlap with
# sampling (the engine is idle from the end of the rollouts to the weight push):
#   async def release_memory(self) -> None: give up what the coming weights make useless or what
#       the learner can use meanwhile (SGLang's weights and KV cache with its memory saver, the
#       local engine's prefix cache, whose KV the next push invalidates anyway)
#   async def resume_memory(self) -> None: take it back, before the weights are pushed


async def wait_ready(engine: Any, *, seeded: bool = False) -> None:
    """`engine.wait_ready(seeded=...)` when the engine has that hook (see above), else nothing;
    `seeded`: every request will carry a seed, so an engine that cannot honour one refuses now."""
    if (hook := getattr(engine, "wait_ready", None)) is not None:
        await hook(seeded=seeded)


async def release_memory(engine: Any) -> None:
    """`engine.release_memory()` when the engine has that hook (see above), else nothing."""
    if (hook := getattr(engine, "release_memory", None)) is not None:
        await hook()


async def resume_memory(engine: Any) -> None:
    """`engine.resume_memory()` when the engine has that hook, else nothing."""
    if (hook := getattr(engine, "resume_memory", None)) is not None:
        await hook()


def close_all(loop: asyncio.AbstractEventLoop, *closers: Callable[[], Any] | None) -> None:
    """Run each closer (async or not; None skipped) on `loop`, then close the loop. One that fails
    (destroying the weight-update group on a dead server, say) is a warning: the others still
    run, and the run's own error, if any, is the one that propagates."""
    for close in closers:
        if close is None:
            continue
        try:
            result = close()
            if inspect.isawaitable(result):
                loop.run_until_complete(result)
        except Exception as e:  # noqa: BLE001 - cleanup: report, go on with the rest
            warnings.warn(
                f"closing {getattr(close, '__qualname__', close)} failed: {type(e).__name__}: {e}",
                stacklevel=2,
            )
    loop.close()
