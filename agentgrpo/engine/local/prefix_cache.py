"""Exact prefix KV cache for `LocalEngine`: reuse the keys and values of token ids already seen.

A token's KV depends only on the ids up to it and its position id, so the KV rows of one sequence
are those of any sequence that starts with the same ids: reuse changes float rounding only. A flat
LRU of token-id tuples, bounded by a token budget; a lookup returns the entry sharing the longest
common prefix. The owner empties it when weights change (this cache knows nothing of them); only
the engine's worker thread touches it. Decisions: docs/rollouts.md ("How the local engine works").

Example:
    ```python
    cache = PrefixCache(max_tokens=4096)
    cache.insert(ids, keys, values)            # keys/values: per layer [H, len(ids), D]
    entry, n = cache.lookup(ids + more_ids)    # n == len(ids): the first n KV rows are reusable
    ```
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(eq=False)
class PrefixEntry:
    """The KV of one token sequence: per layer, keys and values of shape [H, T, D], T = len(ids)."""

    ids: tuple[int, ...]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]


class PrefixCache:
    """LRU of token sequences and their KV rows, bounded by `max_tokens` (0 disables it).

    Args:
        max_tokens: most tokens held over all entries. An entry longer than this is not stored.
    """

    def __init__(self, max_tokens: int) -> None:
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        self.max_tokens = max_tokens
        self._entries: collections.OrderedDict[tuple[int, ...], PrefixEntry] = (
            collections.OrderedDict()
        )  # least recently used first
        self.tokens = 0  # sum of the lengths of the entries held

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def enabled(self) -> bool:
        return self.max_tokens > 0

    def keys(self) -> list[tuple[int, ...]]:
        """Ids of the entries, least recently used first (for tests and diagnostics)."""
        return list(self._entries)

    def lookup(self, ids: Sequence[int], *, touch: bool = True) -> tuple[PrefixEntry | None, int]:
        """The entry sharing the longest common prefix with `ids`, and that length (0: no entry).

        `touch` marks the entry as recently used (a lookup that will use it)."""
        ids = tuple(ids)
        best, best_n = None, 0
        for key, entry in self._entries.items():
            n = common_prefix_len(key, ids)
            if n > best_n:
                best, best_n = entry, n
        if best is not None and touch:
            self._entries.move_to_end(best.ids)
        return best, best_n

    def insert(
        self, ids: Sequence[int], keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]
    ) -> bool:
        """Store the KV of `ids` (per layer [H, len(ids), D]; copied, so views of a larger cache do
        not keep it alive), evicting least recently used entries to stay within the budget.

        Returns False when nothing was stored: the cache is disabled, `ids` is longer than the
        budget, or an entry already covers `ids` (that entry is marked recently used instead)."""
        ids = tuple(ids)
        if not ids or len(ids) > self.max_tokens:
            return False
        for key in self._entries:
            if len(key) >= len(ids) and key[: len(ids)] == ids:
                self._entries.move_to_end(key)
                return False
        if any(k.shape[-2] != len(ids) for k in keys):
            raise ValueError(f"KV rows {[k.shape[-2] for k in keys]} do not match {len(ids)} ids")
        for key in [k for k in self._entries if ids[: len(k)] == k]:  # covered by the new entry
            self._drop(key)
        entry = PrefixEntry(ids, [k.clone() for k in keys], [v.clone() for v in values])
        self._entries[ids] = entry
        self.tokens += len(ids)
        while self.tokens > self.max_tokens:
            self._drop(next(iter(self._entries)))
        return True

    def clear(self) -> None:
        self._entries.clear()
        self.tokens = 0

    def _drop(self, key: tuple[int, ...]) -> None:
        del self._entries[key]
        self.tokens -= len(key)


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two id tuples (binary search over slice compares,
    which run in C: ~20 comparisons of at most len(a) ids instead of a Python loop per id)."""
    lo, hi = 0, min(len(a), len(b))  # invariant: a[:lo] == b[:lo]; the answer is <= hi
    if a[:hi] == b[:hi]:
        return hi
    while hi - lo > 1:  # a[:hi] != b[:hi]
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def shared_prefixes(prompts: Sequence[Sequence[int]]) -> dict[tuple[int, ...], int]:
    """Distinct prefixes that two or more of `prompts` share, shortest first, each mapped to how
    many of `prompts` start with it. Each is cut one id short of the shorter prompt (a request
    always feeds its last prompt id itself, to get the logits it samples from).

    Any two prompts' common prefix is the common prefix of two neighbours in sorted order (the
    minimum of the neighbour LCPs between them, which is one of them), so neighbours suffice.

    Example: 8 copies of prompt A and 8 of prompt B, both starting with a 250-id system prompt,
    give `{A[:250]: 16, A[:-1]: 8, B[:-1]: 8}`.
    """
    ordered = sorted(tuple(p) for p in prompts)
    found: set[tuple[int, ...]] = set()
    for a, b in itertools.pairwise(ordered):
        n = min(common_prefix_len(a, b), len(a) - 1, len(b) - 1)
        if n > 0:
            found.add(a[:n])
    return {
        prefix: sum(1 for p in ordered if p[: len(prefix)] == prefix)
        for prefix in sorted(found, key=lambda p: (len(p), p))
    }
