"""In-process transformers engine: batches concurrent `generate` calls on one model (CPU default).

`LocalEngine` is the embedded default of DESIGN.md: the whole GRPO loop runs in one process on a CPU
with no inference server. It speaks the same token-in/token-out `Engine` protocol as `SGLangEngine`.

How it works (decisions):
- **Continuous batching.** One background thread owns the model and runs a hand-written decode loop
  over a KV cache. `generate` only enqueues a request and awaits a future, so the event loop stays
  responsive and any number of asyncio tasks can call it. Between two decode steps the worker admits
  queued requests (up to `max_batch_size` rows): it prefills them (sorted by length, in chunks of at
  most `prefill_tokens` padded tokens) and merges their caches into the running batch, so a new
  turn of one trajectory does not wait for the longest sequence of the batch to finish. A request
  that finishes leaves the batch at once and its future resolves. When the worker is idle it waits
  `batch_window_s` after the first arrival so that a group launched together is prefilled together.
- **Layout.** Rows are left-padded so every row's newest token sits in the last cache column; an
  attention mask hides the padding and explicit position ids count only real tokens, so padding
  never changes a row's numbers beyond float rounding. When rows leave, cache columns that are
  padding for every remaining row are cut off.
- **Logprobs.** `Completion.logprobs[i]` is the log-probability of `token_ids[i]` under the
  distribution it was sampled from: `log_softmax(logits / T)`, restricted to the top-k / top-p set and
  renormalised when those are active (temperature first, then top-k, then top-p, as vLLM/SGLang
  order them; top-p keeps the smallest prefix of the sorted distribution whose mass reaches p, and
  always the most likely token). With `top_p == 1` and `top_k == -1` (the RL default) that is exactly
  `log_softmax(logits / T)` over the full vocabulary. `temperature == 0` is greedy (argmax) and
  reports `log_softmax(logits)` of the plain distribution (T = 1), as SGLang does. Note: SGLang
  reports the full-vocabulary value even with top-k/top-p; at the RL default the two agree.
- **Stopping.** The model's EOS ids (generation config, config and tokenizer) plus
  `params.stop_token_ids` end a request; the matched id is the last returned token and
  `finish_reason == "stop"`. Reaching `max_new_tokens` gives `"length"`. Prompt + completion never
  exceed `config.max_position_embeddings`: `max_new_tokens` is clamped to what fits and a request cut
  by that clamp (or whose prompt already fills the context, which returns no tokens) finishes with
  `"length"` and a `detail` saying so. `close()` finishes in-flight requests with `"abort"`.
- **Seeds.** A request with `params.seed` draws its random numbers from its own `torch.Generator`
  (one uniform per token, inverse-CDF sampling), so which other requests share its batch does not
  change them; requests without a seed share the engine's generator (`seed=` of the constructor).
  The logits themselves can differ in the last float bits with the batch composition (padding,
  batch size), so a seeded request is bit-reproducible when it runs with the same companions and in
  practice across compositions (a token flips only when its uniform lies within ~1e-6 of a CDF
  boundary). Two requests with the same seed in one batch sample the same tokens: give the members
  of a GRPO group distinct seeds or none.
- **Prefix cache** (`prefix_cache.py`; `prefix_cache_tokens`, 0 disables it). After a request's
  prefill the KV of its prompt is kept, and when it finishes, the KV of prompt + sampled ids (all but
  the last, which was never fed). A new request takes the cached entry sharing the longest common
  prefix with it and prefills only the rest; at least its last prompt id is always fed, for the
  logits. Before prefilling an admitted set, every prefix that several of them share is prefilled
  once, shortest first (the system prompt of several tasks, then each GRPO group's prompt), when
  that saves at least `_MIN_SAVED` ids of prefill. So G copies of a prompt cost one prefill plus G single ids, and turn k+1 (= turn k's
  prompt + sampled ids + env suffix) prefills only the last sampled id and the suffix. Rows of one
  prefill forward may reuse different lengths: every row feeds as many trailing ids as the row that
  needs the most (recomputing a few cached ones), so the padding stays on the left and costs what
  left padding costs anyway. Exactness: the KV of a token depends only on the ids up to it and its
  position id, so the result differs from a fresh prefill by float rounding only (tests check 1e-4).
  `update_weights` empties the cache (its KV was computed under the old weights).
- **Weights.** `update_weights` is queued behind the requests already submitted: the worker stops
  admitting, lets the running rows finish, copies the new tensors in place (tied weights stay tied),
  then sets `weight_version`. So every completion comes from exactly one version, the one it reports.
- **dtype.** float32 is the default. bfloat16 decodes ~2x faster on this CPU (AVX512-BF16) and halves
  the KV memory, but its logprobs differ from a float32 forward by ~0.03 on average (SmolLM2-135M),
  noise that a float32 learner's importance ratio would read as off-policy drift.
- Not done: shared storage of common prefixes between cache entries (a radix tree; see
  `prefix_cache.py`), speculative decoding, models with sliding-window caches (rejected at
  construction).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import queue
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from agentgrpo.engine.base import Completion, EngineError, FinishReason, SamplingParams
from agentgrpo.engine.prefix_cache import PrefixCache, shared_prefixes

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Request:
    prompt_ids: list[int]
    params: SamplingParams
    max_new: int  # after clamping to the context length
    clamped: bool  # True when the context length, not max_new_tokens, set max_new
    stop_ids: frozenset[int]
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    generator: torch.Generator | None = None
    version: str | None = None  # weight version at admission (updates drain the batch first)
    out_ids: list[int] = field(default_factory=list)
    out_logprobs: list[float] = field(default_factory=list)
    cancelled: bool = False  # set by the caller's task when it is cancelled; row is dropped


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


_STOP = object()  # sentinel that ends the worker


class LocalEngine:
    """Engine that runs a transformers causal LM in this process and batches concurrent requests.

    Args:
        model_or_path: a loaded `PreTrainedModel` (used as is; the engine owns it from now on, so do
            not train the same object concurrently) or a local directory to load (no network).
        tokenizer: optional; only its EOS id is used (merged with the model's). Loaded from the
            directory when a path is given and one is there. Exposed as `engine.tokenizer`.
        device: torch device for the model.
        dtype: dtype to load a path with; ignored for a loaded model. float32 (default) gives
            logprobs that match a float32 learner; bfloat16 decodes ~2x faster on CPUs with
            AVX512-BF16, but its logprobs differ from a float32 forward by ~0.03 on average (up
            to ~0.2) on SmolLM2, which an importance ratio would see as off-policy noise.
        max_batch_size: most rows decoded together; further requests wait in a queue.
        batch_window_s: how long an idle worker waits after the first request to collect more.
        prefill_tokens: budget of padded prompt tokens per prefill forward (bounds memory).
        prefix_cache_tokens: token budget of the prefix KV cache (0 disables it). A token costs
            `2 * layers * kv_heads * head_dim * dtype bytes`: 45 KiB for SmolLM2-135M in float32,
            so the default holds ~0.7 GiB, room for the prompts in flight plus the latest turn of
            ~30 trajectories waiting on their env.
        seed: seed of the generator used by requests without `params.seed` (None: random).
        weight_version: version reported by completions until the first `update_weights`.
        eos_token_ids: ids that end every request; default: the EOS ids of the generation config,
            the model config and the tokenizer. `()` leaves only `params.stop_token_ids`
            (benchmarks and tests that need exact lengths).

    Example:
        ```python
        import asyncio
        from agentgrpo.engine import LocalEngine, SamplingParams
        from agentgrpo.models import default_model_path

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
        max_batch_size: int = 32,
        batch_window_s: float = 0.005,
        prefill_tokens: int = 2048,
        prefix_cache_tokens: int = 16384,
        seed: int | None = None,
        weight_version: str | None = None,
        eos_token_ids: Iterable[int] | None = None,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if isinstance(model_or_path, (str, os.PathLike)):
            from agentgrpo.models import load_model, load_tokenizer

            path = Path(model_or_path)
            model = load_model(path, dtype=dtype)
            if tokenizer is None and (path / "tokenizer_config.json").is_file():
                tokenizer = load_tokenizer(path)
        else:
            model = model_or_path
        self.model = model.to(device).eval()
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self.max_batch_size = max_batch_size
        self.batch_window_s = batch_window_s
        self.prefill_tokens = prefill_tokens
        self.prefix_cache = PrefixCache(prefix_cache_tokens)  # worker thread only
        self.weight_version = weight_version
        config = self.model.config
        self.vocab_size: int = self.model.get_output_embeddings().weight.shape[0]
        self.max_context: int = int(getattr(config, "max_position_embeddings", 0) or 1 << 30)
        self.eos_token_ids: frozenset[int] = frozenset(
            self._eos_ids(tokenizer) if eos_token_ids is None else eos_token_ids
        )
        self._check_cache_kind()
        self._generator = torch.Generator()
        self._generator.manual_seed(seed if seed is not None else torch.seed())
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
        """Sample a completion of `prompt_ids`; see the module docstring for batching and logprobs."""
        prompt_ids = self._check_ids(prompt_ids, "prompt_ids")
        if not prompt_ids:
            raise ValueError("prompt_ids is empty")
        room = self.max_context - len(prompt_ids)
        if room <= 0:
            return Completion(
                [], [], "length", self.weight_version,
                detail=f"prompt of {len(prompt_ids)} tokens fills the context length {self.max_context}",
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
        """Load new weights in place, after the requests already submitted have finished.

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

    def close(self) -> None:
        """Stop the worker; in-flight and queued requests finish with `finish_reason="abort"`."""
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
            self._queue.put(item)

    # ----------------------------------------------------------------------------- worker thread
    def _run(self) -> None:
        """The worker: admit queued items between decode steps, decode, resolve futures."""
        batch = _Batch(self)
        waiting: collections.deque = collections.deque()
        stopping = False
        while not stopping:
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
            admit: list[_Request] = []
            while waiting:  # in arrival order; an update is a barrier for everything behind it
                item = waiting[0]
                if item is _STOP:
                    stopping = True
                    break
                if isinstance(item, _Request):
                    if item.cancelled:
                        waiting.popleft()
                        continue
                    if len(batch.rows) + len(admit) >= self.max_batch_size:
                        break
                    admit.append(waiting.popleft())
                elif isinstance(item, _Score):
                    waiting.popleft()
                    self._guarded(item, self._score_now, item)
                elif isinstance(item, _Update):
                    if batch.rows or admit:
                        break  # let the running rows finish under the weights they started with
                    waiting.popleft()
                    self._guarded(item, self._update_now, item)
            if stopping:
                break
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
            if isinstance(item, (_Update, _Score)):
                _resolve(item.loop, item.future, error=EngineError("LocalEngine is closed"))

    def _guarded(self, item: _Update | _Score, fn, *args: Any) -> None:
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
            weights = _read_safetensors(Path(weights))
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


class _Batch:
    """The running rows and their shared, left-padded KV cache (worker thread only)."""

    def __init__(self, engine: LocalEngine) -> None:
        self.engine = engine
        self.rows: list[_Request] = []
        self.cache: Any = None  # DynamicCache, layers of [B, H, T, D]
        self.mask: torch.Tensor | None = None  # [B, T] 1 = real token in the cache
        self.next_ids: torch.Tensor | None = None  # [B] sampled but not yet fed to the model
        self.next_pos: torch.Tensor | None = None  # [B] position id of next_ids

    @torch.inference_mode()
    def admit(self, requests: list[_Request]) -> None:
        """Prefill `requests`, sample their first token and merge them into the batch.

        With the prefix cache on, the prefixes they share are prefilled once first (`_warm`); then
        each request prefills only what its longest cached prefix leaves. Requests are sorted by the
        number of ids they still need and chunked so a forward holds at most `prefill_tokens`
        padded ids."""
        cache = self.engine.prefix_cache
        if cache.enabled:
            self._warm([r.prompt_ids for r in requests])
        todo = [_uncached(cache, r.prompt_ids) for r in requests]
        for chunk in _chunks(requests, todo, self.engine.prefill_tokens):
            self._prefill(chunk)

    def _warm(self, prompts: list[list[int]]) -> None:
        """Prefill into the prefix cache, once each, the prefixes that several `prompts` share.

        A shared prefix is prefilled when it saves >= `_MIN_SAVED` ids: (prompts sharing it - 1) x
        the ids it adds to what is cached or to a shorter shared prefix of it (below that, an extra
        forward costs more than it saves). Nested prefixes go in rounds, shortest first, so a
        group's prompt reuses the system prompt that it shares with other groups."""
        cache = self.engine.prefix_cache
        depth: dict[tuple[int, ...], int] = {}
        for prefix, sharers in shared_prefixes(prompts).items():  # shortest first
            parents = [p for p in depth if prefix[: len(p)] == p]
            have = max([cache.lookup(prefix, touch=False)[1]] + [len(p) for p in parents])
            if (sharers - 1) * (len(prefix) - have) >= _MIN_SAVED:
                depth[prefix] = 1 + max((depth[p] for p in parents), default=-1)
        for level in range(max(depth.values(), default=-1) + 1):
            jobs = [list(p) for p, d in depth.items() if d == level]
            todo = [_uncached(cache, ids) for ids in jobs]
            for chunk in _chunks(jobs, todo, self.engine.prefill_tokens):
                kv, _, _ = self._forward(chunk)
                for row, ids in enumerate(chunk):
                    self._store(kv, row, ids)

    def _prefill(self, requests: list[_Request]) -> None:
        engine = self.engine
        for req in requests:
            req.version = engine.weight_version
            if req.params.seed is not None:
                req.generator = torch.Generator().manual_seed(req.params.seed)
        cache, mask, logits = self._forward([r.prompt_ids for r in requests])
        if engine.prefix_cache.enabled:
            for row, req in enumerate(requests):
                self._store(cache, row, req.prompt_ids)
        next_pos = torch.tensor([len(r.prompt_ids) for r in requests], device=engine.device)
        self._merge(requests, cache, mask, next_pos)
        engine.stats["max_rows"] = max(engine.stats["max_rows"], len(self.rows))
        self._sample_and_record(logits, first=len(self.rows) - len(requests))

    def _forward(self, prompts: list[list[int]]) -> tuple[Any, torch.Tensor, torch.Tensor]:
        """Prefill `prompts` as one left-padded batch, reusing cached prefixes.

        Row i takes `reuse_i` rows of KV from the cache and feeds its last `len - reuse_i` ids.
        Every row feeds the same number S of trailing ids (the most any row needs), so a row with
        a longer cached prefix recomputes a few of its cached ids rather than leaving a hole of
        padding between its cached and its fed ids: the same work as padding, and each row's real
        columns stay contiguous at the right end, as `_merge`, `_retain` and `_store` expect.

        Returns the cache (layers [B, H, P + S, D]), the mask [B, P + S] and the logits of the
        last id of each row [B, V]."""
        from transformers import DynamicCache

        engine = self.engine
        hits = [engine.prefix_cache.lookup(ids) for ids in prompts]  # (entry, shared length)
        # S: the most ids any row has to feed.
        width = max(
            len(ids) - min(n, len(ids) - 1) for ids, (_, n) in zip(prompts, hits, strict=True)
        )
        reuse = [max(0, len(ids) - width) for ids in prompts]  # <= the hit, < len(ids)
        past = max(reuse)  # P
        B = len(prompts)
        ids = torch.zeros(B, width, dtype=torch.long)
        mask = torch.zeros(B, past + width, dtype=torch.long)
        for i, (prompt, r) in enumerate(zip(prompts, reuse, strict=True)):
            ids[i, width - (len(prompt) - r) :] = torch.tensor(prompt[r:])
            mask[i, past + width - len(prompt) :] = 1  # r cached + the fed ids, or only the fed
        ids, mask = ids.to(engine.device), mask.to(engine.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, past:]
        cache = DynamicCache(config=engine.model.config)
        if past:  # the cached rows, left-padded to P columns
            some = next(entry for entry, _ in hits if entry is not None)
            for li, layer in enumerate(cache.layers):
                k0, v0 = some.keys[li], some.values[li]
                keys = k0.new_empty(B, k0.shape[0], past, k0.shape[2])  # [B, H, P, D]
                values = v0.new_empty(B, v0.shape[0], past, v0.shape[2])
                for i, ((entry, _), r) in enumerate(zip(hits, reuse, strict=True)):
                    keys[i, :, : past - r] = 0
                    values[i, :, : past - r] = 0
                    if r:
                        keys[i, :, past - r :] = entry.keys[li][:, :r]
                        values[i, :, past - r :] = entry.values[li][:, :r]
                layer.lazy_initialization(keys, values)
                # Assigned, not `update`d: update concatenates, which would copy them once more.
                layer.keys, layer.values = keys, values
        # Long prompts go through in column chunks so attention scores stay within the budget.
        step = max(1, engine.prefill_tokens // B)
        for start in range(0, width, step):
            end = min(start + step, width)
            logits = engine.model(
                input_ids=ids[:, start:end], attention_mask=mask[:, : past + end],
                position_ids=positions[:, start:end], cache=cache, use_cache=True,
                logits_to_keep=1,
            ).logits[:, -1]  # fmt: skip
        engine.stats["prefills"] += 1
        engine.stats["prefill_tokens"] += sum(len(p) for p in prompts) - sum(reuse)
        engine.stats["cached_tokens"] += sum(reuse)
        return cache, mask, logits

    def _store(self, cache: Any, row: int, ids: list[int]) -> None:
        """Offer the KV of `ids`, the last `len(ids)` columns of `row` of `cache`, to the prefix
        cache (it copies them only if it keeps them)."""
        n = len(ids)
        self.engine.prefix_cache.insert(
            ids,
            [layer.keys[row, :, -n:] for layer in cache.layers],
            [layer.values[row, :, -n:] for layer in cache.layers],
        )

    def _merge(self, requests: list[_Request], cache: Any, mask: torch.Tensor, next_pos) -> None:
        """Append new rows; the shorter side is left-padded so the newest columns line up."""
        placeholder = torch.zeros(len(requests), dtype=torch.long, device=mask.device)
        if not self.rows:
            self.rows, self.cache, self.mask = list(requests), cache, mask
            self.next_ids, self.next_pos = placeholder, next_pos
            return
        width = max(self.mask.shape[1], mask.shape[1])
        for old, new in zip(self.cache.layers, cache.layers, strict=True):
            old.keys = torch.cat([_left_pad(old.keys, width, 2), _left_pad(new.keys, width, 2)])
            old.values = torch.cat(
                [_left_pad(old.values, width, 2), _left_pad(new.values, width, 2)]
            )
        self.mask = torch.cat([_left_pad(self.mask, width, 1), _left_pad(mask, width, 1)])
        self.rows += requests
        self.next_ids = torch.cat([self.next_ids, placeholder])
        self.next_pos = torch.cat([self.next_pos, next_pos])

    @torch.inference_mode()
    def step(self) -> None:
        """Feed every row its pending token, sample the next one, retire finished rows."""
        engine = self.engine
        self.mask = torch.cat([self.mask, self.mask.new_ones(len(self.rows), 1)], dim=1)
        logits = engine.model(
            input_ids=self.next_ids[:, None], attention_mask=self.mask,
            position_ids=self.next_pos[:, None], cache=self.cache, use_cache=True,
        ).logits[:, -1]  # fmt: skip
        self.next_pos = self.next_pos + 1
        engine.stats["steps"] += 1
        self._sample_and_record(logits, first=0)

    def _sample_and_record(self, logits_BV: torch.Tensor, first: int) -> None:
        """Sample for rows[first:] from `logits_BV` (one row each), append, retire finished rows."""
        rows = self.rows[first:]
        uniforms = torch.empty(len(rows), dtype=torch.float64)
        for i, req in enumerate(rows):
            uniforms[i] = torch.rand(
                (), dtype=torch.float64, generator=req.generator or self.engine._generator
            )
        ids_B, logprobs_B = sample(
            logits_BV.float(),
            temperature=[r.params.temperature for r in rows],
            top_k=[r.params.top_k for r in rows],
            top_p=[r.params.top_p for r in rows],
            uniforms=uniforms.to(logits_BV.device),
        )
        self.next_ids[first:] = ids_B
        self.engine.stats["tokens"] += len(rows)
        keep: list[int] = list(range(first))
        for i, (req, tok, lp) in enumerate(
            zip(rows, ids_B.tolist(), logprobs_B.tolist(), strict=True)
        ):
            req.out_ids.append(tok)
            req.out_logprobs.append(lp)
            if req.cancelled:
                continue
            done = tok in req.stop_ids or len(req.out_ids) >= req.max_new
            if done and self.engine.prefix_cache.enabled:
                # The next turn starts with these ids; the last sampled one was never fed.
                self._store(self.cache, first + i, req.prompt_ids + req.out_ids[:-1])
            if tok in req.stop_ids:
                self.finish(req, "stop")
            elif len(req.out_ids) >= req.max_new:
                detail = f"context length {self.engine.max_context} reached" if req.clamped else ""
                self.finish(req, "length", detail)
            else:
                keep.append(first + i)
        if len(keep) < len(self.rows):
            self._retain(keep)

    def _retain(self, keep: list[int]) -> None:
        """Keep only rows `keep`; cut cache columns that are padding for every remaining row."""
        self.rows = [self.rows[i] for i in keep]
        if not self.rows:
            self.cache = self.mask = self.next_ids = self.next_pos = None
            return
        index = torch.tensor(keep, device=self.mask.device)
        mask = self.mask.index_select(0, index)
        start = int(mask.any(0).long().argmax())  # first column some row still uses
        self.mask = mask[:, start:]
        for layer in self.cache.layers:
            layer.keys = layer.keys.index_select(0, index)[:, :, start:]
            layer.values = layer.values.index_select(0, index)[:, :, start:]
        self.next_ids = self.next_ids.index_select(0, index)
        self.next_pos = self.next_pos.index_select(0, index)

    def finish(self, req: _Request, reason: FinishReason, detail: str = "") -> None:
        completion = Completion(
            token_ids=req.out_ids, logprobs=req.out_logprobs, finish_reason=reason,
            weight_version=req.version if req.out_ids else self.engine.weight_version,
            detail=detail, meta={"prompt_tokens": len(req.prompt_ids)},
        )  # fmt: skip
        _resolve(req.loop, req.future, completion)


def sample(
    logits_BV: torch.Tensor,
    *,
    temperature: list[float],
    top_k: list[int],
    top_p: list[float],
    uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row and return `(ids_B, logprobs_B)`.

    Settings are per row. `uniforms` (float64 in [0, 1), one per row) drive inverse-CDF sampling,
    so a row's randomness comes only from its own generator. Logprobs are of the distribution the
    token was sampled from: `log_softmax(logits / T)`, then (if active) top-k, renormalise, top-p,
    renormalise, as vLLM orders them. Greedy rows (T == 0) take the argmax and report
    `log_softmax(logits)`.

    Truncated rows sample among the `max(_CANDIDATES, top_k)` most likely tokens (a `topk`, much
    cheaper than sorting the vocabulary); when a top-p-only row's candidates hold less mass than p
    the whole vocabulary is sorted instead, so the result is always exact.
    """
    B, V = logits_BV.shape
    device = logits_BV.device
    temp_B = torch.tensor(temperature, dtype=logits_BV.dtype, device=device)
    greedy_B = temp_B == 0
    logp_BV = torch.log_softmax(logits_BV / torch.where(greedy_B, 1.0, temp_B)[:, None], dim=-1)
    cdf_BV = logp_BV.exp().cumsum(-1, dtype=torch.float64)
    ids_B = torch.searchsorted(cdf_BV, (uniforms * cdf_BV[:, -1])[:, None], right=True)[:, 0]
    ids_B = torch.where(ids_B < V, ids_B, logp_BV.argmax(-1))  # float rounding past the end
    ids_B = torch.where(greedy_B, logits_BV.argmax(-1), ids_B)
    logprobs_B = logp_BV.gather(-1, ids_B[:, None])[:, 0]

    k_B = torch.tensor([k if 0 < k < V else V for k in top_k], device=device)
    p_B = torch.tensor(top_p, dtype=logits_BV.dtype, device=device)
    truncate_B = ((k_B < V) | (p_B < 1)) & ~greedy_B
    if not bool(truncate_B.any()):
        return ids_B, logprobs_B
    K = min(V, max([_CANDIDATES] + k_B[truncate_B & (k_B < V)].tolist()))
    cand_BK, order_BK = logp_BV.topk(K, dim=-1)  # sorted, most likely first
    uncovered_B = truncate_B & (k_B > K) & (cand_BK.exp().sum(-1) < p_B)
    if K < V and bool(uncovered_B.any()):
        K = V
        cand_BK, order_BK = logp_BV.sort(dim=-1, descending=True)
    drop_BK = torch.arange(K, device=device)[None, :] >= k_B[:, None]
    kept_BK = cand_BK.masked_fill(drop_BK, float("-inf"))
    prob_BK = (kept_BK - torch.logsumexp(kept_BK, dim=-1, keepdim=True)).exp()
    # Top-p keeps the smallest prefix whose mass reaches p (always the first token).
    drop_BK |= (prob_BK.cumsum(-1) - prob_BK >= p_B[:, None]) & (p_B < 1)[:, None]
    drop_BK[:, 0] = False
    kept_BK = cand_BK.masked_fill(drop_BK, float("-inf"))
    kept_BK = kept_BK - torch.logsumexp(kept_BK, dim=-1, keepdim=True)
    cdf_BK = kept_BK.exp().cumsum(-1, dtype=torch.float64)
    pick_B = torch.searchsorted(cdf_BK, (uniforms * cdf_BK[:, -1])[:, None], right=True)[:, 0]
    pick_B = pick_B.clamp(max=K - 1)
    pick_B = torch.where(drop_BK.gather(-1, pick_B[:, None])[:, 0], 0, pick_B)  # rounding guard
    trunc_ids_B = order_BK.gather(-1, pick_B[:, None])[:, 0]
    trunc_logprobs_B = kept_BK.gather(-1, pick_B[:, None])[:, 0]
    return (
        torch.where(truncate_B, trunc_ids_B, ids_B),
        torch.where(truncate_B, trunc_logprobs_B, logprobs_B),
    )


_CANDIDATES = 256  # tokens kept by the cheap topk path of truncated sampling (see `sample`)
# Prefill ids a shared prefix must save to get a forward of its own (see `_Batch._warm`): ~the
# cost of one small forward of SmolLM2 on a CPU, in ids of prefill.
_MIN_SAVED = 32


def _uncached(cache: PrefixCache, ids: list[int]) -> int:
    """How many ids of `ids` a prefill has to feed given the cache (always at least the last)."""
    return len(ids) - min(cache.lookup(ids, touch=False)[1], len(ids) - 1)


def _chunks(items: list, todo: list[int], budget: int) -> list[list]:
    """`items` sorted by `todo` (ids each still needs), cut so that a chunk's padded size
    (rows x the most any row needs) stays within `budget` (a single item may exceed it)."""
    chunks: list[list] = []
    chunk: list = []
    for n, item in sorted(zip(todo, items, strict=True), key=lambda x: x[0]):
        if chunk and (len(chunk) + 1) * n > budget:
            chunks.append(chunk)
            chunk = []
        chunk.append(item)
    if chunk:
        chunks.append(chunk)
    return chunks


def _left_pad(x: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    """Zero-pad `x` on the left of `dim` up to `width`."""
    missing = width - x.shape[dim]
    if missing == 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x.new_zeros(shape), x], dim=dim)


def _resolve(loop: asyncio.AbstractEventLoop, future: asyncio.Future, result: Any = None,
             error: BaseException | None = None) -> None:  # fmt: skip
    """Complete an asyncio future from the worker thread (a closed loop means nobody waits)."""

    def _set() -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    try:
        loop.call_soon_threadsafe(_set)
    except RuntimeError:  # the caller's event loop is closed: nobody is waiting any more
        pass


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {path}")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        weights.update(load_file(file))
    return weights
