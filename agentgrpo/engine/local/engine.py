"""In-process transformers engine: batches concurrent `generate` calls on one model (CPU default).

`LocalEngine` is the embedded default: the whole GRPO loop runs in one process with no inference
server, behind the same token-in/token-out `Engine` protocol as the server clients. This module
holds the request queue, the worker thread that owns the model, and weight updates; the running
batch is `batch.py`, sampling `sampling.py`, the prefix KV cache `prefix_cache.py`.

Contract: `Completion.logprobs` are the tempered full distribution's (as SGLang's and the
learner's), also under top-k / top-p; a seeded request draws from its own generator; prompt plus
completion never exceed the model's context (cut with "length" and a detail); by default an
update waits for the running rows, so each completion comes from the one version it reports
(`partial_rollouts=True`: updates land between decode steps and `version_runs` says which version
sampled which ids). The decisions behind each point: docs/rollouts.md ("How the local engine
works", "Partial rollouts").
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import inspect
import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from agentgrpo.engine.base import Completion, EngineError, SamplingParams
from agentgrpo.engine.local.batch import _Batch, _Request, _resolve
from agentgrpo.engine.local.prefix_cache import PrefixCache
from agentgrpo.models.embedded import load_model, load_tokenizer, read_safetensors
from agentgrpo.models.hardware import engine_dtype

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Update:
    weights: Any
    version: str
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop


@dataclass(eq=False)
class _Score:
    prompt_ids: list[int]
    completion_ids: list[int]
    temperature: float
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop


@dataclass(eq=False)
class _Release:
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop


_STOP = object()  # sentinel that ends the worker

_RUNNING: weakref.WeakSet[LocalEngine] = weakref.WeakSet()  # engines whose worker has started


@atexit.register
def _close_running() -> None:
    """Close the engines still running at exit (before finalization): a daemon worker left inside a
    torch call when finalization starts makes CPython 3.11 abort the process (pytorch#38228)."""
    for engine in list(_RUNNING):
        engine.close()


class LocalEngine:
    """Engine that runs a transformers causal LM in this process and batches concurrent requests.

    Args:
        model_or_path: a loaded `PreTrainedModel` (used as is; the engine owns it from now on, so do
            not train the same object concurrently) or a local directory to load (no network).
        tokenizer: optional; only its EOS id is used (merged with the model's). Loaded from the
            directory when a path is given and one is there. Exposed as `engine.tokenizer`.
        device: torch device for the model.
        dtype: dtype to load a path with; ignored for a loaded model. float32 (default) gives
            logprobs that match a float32 learner; bfloat16's differ from a float32 forward by
            ~0.03 on average (up to ~0.2) on SmolLM2, which an importance ratio would see as
            off-policy noise. `auto`: `weights_dtype`, but float32 where bfloat16 is not native
            (`agentgrpo.models.hardware.engine_dtype`); the reason is in `engine.dtype_reason`.
        weights_dtype: with `dtype="auto"`, the dtype of the weights the learner will send.
        max_batch_size: most rows decoded together; further requests wait in a queue.
        batch_window_s: how long an idle worker waits after the first request to collect more.
        prefill_tokens: budget of padded prompt tokens per prefill forward (bounds memory).
        prefix_cache_tokens: token budget of the prefix KV cache (0 disables it). A token costs
            `2 * layers * kv_heads * head_dim * dtype bytes`: 45 KiB for SmolLM2-135M in float32,
            so the default holds ~0.7 GiB, room for the prompts in flight plus the latest turn of
            ~30 trajectories waiting on their env.
        seed: seed of the generator used by requests without `params.seed` (None: random). The
            engine draws only from that generator: torch's global RNG is left as it was.
        weight_version: version reported by completions until the first `update_weights`.
        partial_rollouts: False (default): an update waits until the running rows finish, so a
            completion comes from one version. True: it lands between two decode steps and the
            running rows continue with the new weights over their old KV cache (docs/rollouts.md,
            "Partial rollouts"; `Completion.version_runs` says which version sampled which ids).
        eos_token_ids: ids that end every request; default: the EOS ids of the generation config,
            the model config and the tokenizer. `()` leaves only `params.stop_token_ids`
            (benchmarks and tests that need exact lengths).
        threads: torch (OpenMP) threads of the decoding thread, set in that thread only; None
            keeps the process's. The training loop sets it when the engine samples while the
            learner trains on the same CPU (`agentgrpo.models.hardware.share_cpu`).

    Example:
        ```python
        import asyncio
        from agentgrpo.engine import LocalEngine, SamplingParams
        from agentgrpo.models.embedded import default_model_path

        async def main():
            with LocalEngine(default_model_path()) as engine:
                tok = engine.tokenizer
                prompt = tok.apply_chat_template(
                    [{"role": "user", "content": "What is 2+3?"}], add_generation_prompt=True
                )["input_ids"]
                # One group of 8 samples: distinct seeds (equal seeds would give equal samples).
                params = [SamplingParams(max_new_tokens=32, seed=i) for i in range(8)]
                outs = await asyncio.gather(*(engine.generate(prompt, p) for p in params))
                for c in outs:
                    print(c.finish_reason, tok.decode(c.token_ids), sum(c.logprobs))

        asyncio.run(main())
        ```
    """

    def __init__(
        self,
        model_or_path: Any,
        *,
        tokenizer: Any = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | str = torch.float32,
        weights_dtype: str = "float32",
        max_batch_size: int = 32,
        batch_window_s: float = 0.005,
        prefill_tokens: int = 2048,
        prefix_cache_tokens: int = 16384,
        seed: int | None = None,
        weight_version: str | None = None,
        eos_token_ids: Iterable[int] | None = None,
        threads: int | None = None,
        partial_rollouts: bool = False,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if isinstance(model_or_path, (str, os.PathLike)):
            path = Path(model_or_path)
            dtype, self.dtype_reason = engine_dtype(dtype, device, weights_dtype)
            model = load_model(path, dtype=dtype)
            if tokenizer is None and (path / "tokenizer_config.json").is_file():
                tokenizer = load_tokenizer(path)
        else:
            model = model_or_path
            self.dtype_reason = "a loaded model, used in its own dtype"
        self.model = model.to(device).eval()
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self.max_batch_size = max_batch_size
        self.batch_window_s = batch_window_s
        self.prefill_tokens = prefill_tokens
        self.prefix_cache = PrefixCache(prefix_cache_tokens)  # worker thread only
        self.weight_version = weight_version
        self.threads = threads  # torch threads of the worker; None = the process's setting
        self.partial_rollouts = partial_rollouts
        self.updates_applied = 0  # updates the worker has applied (worker thread only)
        config = self.model.config
        self.vocab_size: int = self.model.get_output_embeddings().weight.shape[0]
        self.max_context: int = int(getattr(config, "max_position_embeddings", 0) or 1 << 30)
        self.eos_token_ids: frozenset[int] = frozenset(
            self._eos_ids(tokenizer) if eos_token_ids is None else eos_token_ids
        )
        self._check_cache_kind()
        self.cache_kwarg = _cache_kwarg(self.model)
        self._generator = torch.Generator()
        # Only this generator: torch.seed() would also reseed torch's global RNG, after the caller
        # seeded it (a training run's dropout would then differ between two runs with one seed).
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False
        # Diagnostics, written by the worker: decode steps, prefill forwards, most rows decoded at
        # once, tokens sampled, prompt ids fed to prefill forwards (padding not counted), prompt
        # ids whose KV came from the prefix cache instead.
        self.stats: dict[str, int] = {
            "steps": 0, "prefills": 0, "max_rows": 0, "tokens": 0,
            "prefill_tokens": 0, "cached_tokens": 0,
        }  # fmt: skip

    # ----------------------------------------------------------------------------- public API
    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Completion:
        """Sample a completion of `prompt_ids`; batching and logprobs: docs/rollouts.md ("How the
        local engine works")."""
        prompt_ids = self._check_ids(prompt_ids, "prompt_ids")
        if not prompt_ids:
            raise ValueError("prompt_ids is empty")
        room = self.max_context - len(prompt_ids)
        if room <= 0:
            return Completion(
                [], [], "length", self.weight_version,
                detail=f"prompt of {len(prompt_ids)} tokens fills the context length "
                f"{self.max_context}",
            )  # fmt: skip
        loop = asyncio.get_running_loop()
        req = _Request(
            prompt_ids=prompt_ids,
            params=params,
            max_new=min(params.max_new_tokens, room),
            clamped=params.max_new_tokens > room,
            stop_ids=self.eos_token_ids | frozenset(params.stop_token_ids),
            future=loop.create_future(),
            loop=loop,
        )
        self._submit(req)
        try:
            return await req.future
        except asyncio.CancelledError:
            req.cancelled = True  # the worker drops the row at its next step
            raise

    async def update_weights(self, weights: Any, *, version: str) -> None:
        """Load new weights in place, after the requests already submitted have finished (with
        `partial_rollouts`: at the next decode step, the running requests continuing under them).

        `weights` is a state dict (name -> tensor; names as in `model.state_dict()`) or a path to a
        `.safetensors` file or a directory of them. Names left out keep their values; an unknown
        name or a wrong shape raises `ValueError` before anything changes. Later completions carry
        `weight_version == version`.
        """
        loop = asyncio.get_running_loop()
        item = _Update(weights, str(version), loop.create_future(), loop)
        self._submit(item)
        await item.future

    async def score(
        self, prompt_ids: list[int], completion_ids: list[int], temperature: float = 1.0
    ) -> list[float]:
        """Logprobs of `completion_ids` after `prompt_ids` under the current weights:
        `log_softmax(logits / T)` at each completion token (T = 1 when `temperature == 0`, matching
        greedy generation). Used to check that a weight sync reached the engine. Runs between decode
        steps, after any earlier `update_weights`."""
        prompt_ids = self._check_ids(prompt_ids, "prompt_ids")
        completion_ids = self._check_ids(completion_ids, "completion_ids")
        if not prompt_ids:
            raise ValueError("prompt_ids is empty")
        if len(prompt_ids) + len(completion_ids) > self.max_context:
            raise ValueError(f"prompt + completion exceed the context length {self.max_context}")
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if not completion_ids:
            return []
        loop = asyncio.get_running_loop()
        item = _Score(prompt_ids, completion_ids, temperature, loop.create_future(), loop)
        self._submit(item)
        return await item.future

    async def release_memory(self) -> None:
        """Empty the prefix cache (the training loop's hook for the time the learner trains: the
        next weight push would empty it anyway). Running requests keep their own KV."""
        loop = asyncio.get_running_loop()
        item = _Release(loop.create_future(), loop)
        self._submit(item)
        await item.future

    def close(self) -> None:
        """Stop the worker at its next step: in-flight and queued requests finish at once with
        `finish_reason="abort"` (what they sampled so far); queued updates, scores and releases
        fail with `EngineError`."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
        if thread is not None:
            self._queue.put(_STOP)
            thread.join()

    async def aclose(self) -> None:
        await asyncio.to_thread(self.close)

    def __enter__(self) -> LocalEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> LocalEngine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # ----------------------------------------------------------------------------- setup helpers
    def _eos_ids(self, tokenizer: Any) -> set[int]:
        ids: set[int] = set()
        gen_config = getattr(self.model, "generation_config", None)
        for source in (gen_config, self.model.config, tokenizer):
            value = getattr(source, "eos_token_id", None) if source is not None else None
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, Iterable):
                ids.update(int(v) for v in value)
        if not ids:
            log.warning(
                "LocalEngine: the model declares no EOS id; only stop_token_ids end requests"
            )
        return ids

    def _check_cache_kind(self) -> None:
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        layers = DynamicCache(config=self.model.config).layers
        if any(type(layer) is not DynamicLayer for layer in layers):
            raise NotImplementedError(
                "LocalEngine batches by editing full-attention KV caches; this model uses "
                f"{sorted({type(x).__name__ for x in layers})}, which it does not support"
            )

    def _check_ids(self, ids: list[int], name: str) -> list[int]:
        ids = [int(i) for i in ids]
        if ids and not (0 <= min(ids) and max(ids) < self.vocab_size):
            raise ValueError(f"{name} has ids outside the vocabulary [0, {self.vocab_size})")
        return ids

    def _submit(self, item: object) -> None:
        with self._lock:
            if self._closed:
                raise EngineError("LocalEngine is closed")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="LocalEngine", daemon=True)
                self._thread.start()
                _RUNNING.add(self)
            self._queue.put(item)

    # ----------------------------------------------------------------------------- worker thread
    def _run(self) -> None:
        """The worker: admit queued items between decode steps, decode, resolve futures."""
        if self.threads is not None:  # this thread's own OpenMP team; other threads keep theirs
            torch.set_num_threads(self.threads)
        batch = _Batch(self)
        waiting: collections.deque = collections.deque()
        while True:
            if not batch.rows and not waiting:
                item = self._queue.get()  # idle: block until something arrives
                waiting.append(item)
                if self.batch_window_s > 0:
                    time.sleep(self.batch_window_s)
            while True:
                try:
                    waiting.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            # close() ends everything at once, also what is queued ahead of the stop (behind a full
            # batch or an update it would otherwise wait for): aborted or failed below.
            if any(item is _STOP for item in waiting):
                break
            admit: list[_Request] = []
            no_room: list[_Request] = []  # partial rollouts: requests waiting for a free row
            # In arrival order; an update is a barrier for everything behind it. With partial
            # rollouts it lands at once instead, also ahead of the requests still waiting for a
            # row (a saturated engine always has some): they, and those admitted in this round
            # (prefilled after it), start under the new weights.
            while waiting:
                item = waiting[0]
                if isinstance(item, _Request):
                    if item.cancelled:
                        waiting.popleft()
                        continue
                    if len(batch.rows) + len(admit) >= self.max_batch_size:
                        if not self.partial_rollouts:
                            break
                        no_room.append(waiting.popleft())
                        continue
                    admit.append(waiting.popleft())
                elif isinstance(item, _Score):
                    waiting.popleft()
                    self._guarded(item, self._score_now, item)
                elif isinstance(item, _Release):
                    waiting.popleft()
                    self._guarded(item, self.prefix_cache.clear)
                elif isinstance(item, _Update):
                    if (batch.rows or admit) and not self.partial_rollouts:
                        break  # let the running rows finish under the weights they started with
                    waiting.popleft()
                    self._guarded(item, self._update_now, item)
            waiting.extendleft(reversed(no_room))  # still first in line, in arrival order
            try:
                if admit:
                    batch.admit(admit)
                if batch.rows:
                    batch.step()
            except Exception as exc:  # noqa: BLE001 - fail these requests, keep serving the rest
                log.exception("LocalEngine: decode step failed")
                for req in [*batch.rows, *admit]:  # rows already resolved ignore this
                    _resolve(req.loop, req.future, error=EngineError(f"LocalEngine: {exc!r}"))
                batch = _Batch(self)
        for req in [*batch.rows, *(w for w in waiting if isinstance(w, _Request))]:
            batch.finish(req, "abort", "engine closed")
        for item in waiting:
            if isinstance(item, (_Update, _Score, _Release)):
                _resolve(item.loop, item.future, error=EngineError("LocalEngine is closed"))

    def _guarded(self, item: _Update | _Score | _Release, fn, *args: Any) -> None:
        try:
            result = fn(*args)
        except Exception as exc:  # noqa: BLE001 - delivered to the caller's await
            _resolve(item.loop, item.future, error=exc)
        else:
            _resolve(item.loop, item.future, result)

    @torch.inference_mode()
    def _score_now(self, item: _Score) -> list[float]:
        ids = torch.tensor([item.prompt_ids + item.completion_ids[:-1]], device=self.device)
        n = len(item.completion_ids)
        logits = self.model(input_ids=ids, use_cache=False, logits_to_keep=n).logits[0].float()
        temperature = item.temperature if item.temperature > 0 else 1.0
        logp = torch.log_softmax(logits / temperature, dim=-1)
        target = torch.tensor(item.completion_ids, device=self.device)
        return logp.gather(-1, target[:, None])[:, 0].tolist()

    def _update_now(self, item: _Update) -> None:
        weights = item.weights
        if isinstance(weights, (str, os.PathLike)):
            weights = read_safetensors(Path(weights))
        if not isinstance(weights, Mapping):
            raise TypeError(f"weights must be a state dict or a path, got {type(weights).__name__}")
        own = self.model.state_dict(keep_vars=True)
        unknown = sorted(set(weights) - set(own))
        if unknown:
            raise ValueError(f"update_weights: unknown names {unknown[:5]} ({len(unknown)} in all)")
        for name, tensor in weights.items():
            if tuple(tensor.shape) != tuple(own[name].shape):
                raise ValueError(
                    f"update_weights: {name} has shape {tuple(tensor.shape)}, "
                    f"the model expects {tuple(own[name].shape)}"
                )
        self.prefix_cache.clear()  # its KV was computed under the weights being replaced
        with torch.no_grad():
            for name, tensor in weights.items():
                own[name].copy_(tensor)
        self.weight_version = item.version
        self.updates_applied += 1


def _cache_kwarg(model: torch.nn.Module) -> str:
    """The name under which the model's forward takes a KV cache: transformers renamed
    `past_key_values` to `cache` in 5.2x (the old name deprecated, to go in 5.40). Passing the name
    a version does not know is no error there: the kwarg lands in `**kwargs` and every decode step
    silently runs without the cache, so the engine asks the signature once instead of guessing."""
    params = inspect.signature(model.forward).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    raise NotImplementedError(
        f"LocalEngine: {type(model).__name__}.forward takes no KV cache argument (cache or "
        "past_key_values); it needs a transformers causal LM"
    )
