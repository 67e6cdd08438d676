"""The running batch of `LocalEngine`: prefill, the shared KV cache and one decode step.

`LocalEngine` (`engine.py`) is the concurrency side of the engine: the request queue, the worker
thread, admission order and when weight updates land. Between two decode steps its worker hands
the requests it admits to `_Batch`, the tensor side: it prefills them (prefixes that several share
first, then each request from its longest cached prefix), merges their KV into the running
left-padded cache, feeds every row its pending token, samples the next one (`sampling.sample`),
retires finished rows (cutting cache columns nobody uses any more) and resolves their futures.
The layout and the prefix-cache rules it implements: docs/rollouts.md ("How the local engine
works": Layout, Prefix cache). Worker thread only: `_Batch` is given the engine and reads its
model, device, budgets, prefix cache, stats and shared generator.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from agentgrpo.engine.base import Completion, FinishReason, SamplingParams
from agentgrpo.engine.local.prefix_cache import PrefixCache, shared_prefixes
from agentgrpo.engine.local.sampling import sample

if TYPE_CHECKING:  # engine.py imports this module; the engine is passed in at run time
    from agentgrpo.engine.local.engine import LocalEngine


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
    updates_seen: int = 0  # the engine's `updates_applied` at prefill: its prompt KV's weights
    # Which weights sampled out_ids, run-length: [(count, version), ...]. One run unless an update
    # landed while the row decoded (`LocalEngine(partial_rollouts=True)`).
    version_runs: list[tuple[int, str | None]] = field(default_factory=list)
    out_ids: list[int] = field(default_factory=list)
    out_logprobs: list[float] = field(default_factory=list)
    cancelled: bool = False  # set by the caller's task when it is cancelled; row is dropped


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
            req.updates_seen = engine.updates_applied
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
                position_ids=positions[:, start:end], use_cache=True, **{engine.cache_kwarg: cache},
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
            position_ids=self.next_pos[:, None], use_cache=True, **{engine.cache_kwarg: self.cache},
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
        version = self.engine.weight_version
        for i, (req, tok, lp) in enumerate(
            zip(rows, ids_B.tolist(), logprobs_B.tolist(), strict=True)
        ):
            req.out_ids.append(tok)
            req.out_logprobs.append(lp)
            runs = req.version_runs
            if runs and runs[-1][1] == version:
                runs[-1] = (runs[-1][0] + 1, version)
            else:
                runs.append((1, version))
            if req.cancelled:
                continue
            done = tok in req.stop_ids or len(req.out_ids) >= req.max_new
            # The next turn starts with these ids; the last sampled one was never fed. A row that
            # ran across a weight update holds KV of the old weights: never handed to new requests.
            if (
                done
                and self.engine.prefix_cache.enabled
                and req.updates_seen == self.engine.updates_applied
            ):
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
        runs = req.version_runs
        completion = Completion(
            token_ids=req.out_ids, logprobs=req.out_logprobs, finish_reason=reason,
            weight_version=runs[-1][1] if runs else self.engine.weight_version,
            detail=detail, meta={"prompt_tokens": len(req.prompt_ids)},
            version_runs=list(runs) if len(runs) > 1 else None,
        )  # fmt: skip
        _resolve(req.loop, req.future, completion)


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
