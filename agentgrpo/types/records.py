"""What the frozen records share: `FrozenDict` (the read-only mapping inside a finished record), the
one helper that writes a frozen record's fields, and strict-JSON numbers."""

from __future__ import annotations

import math
from typing import Any


class FrozenDict(dict):
    """A dict that refuses every change: the mappings inside a finished record (tool-error counts,
    the env's info, reward parts). It reads, compares, pickles and serialises as a dict."""

    def _refuse(self, *_args: Any, **_kwargs: Any) -> Any:
        raise TypeError("a record's mapping is read-only: records do not change once made")

    __setitem__ = __delitem__ = __ior__ = _refuse  # type: ignore[assignment]
    clear = pop = popitem = setdefault = update = _refuse  # type: ignore[assignment]

    def __reduce__(self) -> tuple[Any, ...]:
        return (FrozenDict, (dict(self),))


def _set(record: Any, *as_tuples: str, **values: Any) -> None:
    """Normalise fields of a frozen record in its `__post_init__`: the fields named in `as_tuples`
    become tuples, the others take `values` (dicts as FrozenDict, say). The one place a frozen
    record is written."""
    values.update((name, tuple(getattr(record, name))) for name in as_tuples)
    for name, value in values.items():
        object.__setattr__(record, name, value)


_TOKENS = ("token_ids", "loss_mask", "logprobs")  # a token sequence's three parallel fields


def _number(x: float | None) -> float | None:
    """Strict JSON: NaN is written as null."""
    return None if x is None or math.isnan(x) else x
