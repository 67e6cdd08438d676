"""Special-token text inside messages and tool schemas, held as placeholders while a template
renders, so that content stays data: it can never forge a turn boundary or an end of sequence."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Any

from agentgrpo.chat.errors import TemplateError


def _texts(obj: Any, key: str = "", skip: str | None = "role") -> Iterator[str]:
    """Every string a template may print: values and keys at any depth of a message dict (content,
    name, tool_call_id, a tool call's name and arguments), all but the `role` it branches on
    (`skip`); of a tool schema (`skip=None`), every one (name, description, parameter names,
    descriptions, enum values, titles)."""
    if isinstance(obj, str) and key != skip:
        yield obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _texts(k, "", skip)
            yield from _texts(v, k, skip)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _texts(v, "", skip)


def _map_texts(obj: Any, f: Callable[[str], str], key: str = "", skip: str | None = "role") -> Any:
    """`obj` with `f` applied to each string `_texts` yields (a copy; `obj` is left as it is)."""
    if isinstance(obj, str):
        return obj if key == skip else f(obj)
    if isinstance(obj, dict):
        return {
            (f(k) if isinstance(k, str) else k): _map_texts(v, f, k, skip) for k, v in obj.items()
        }
    if isinstance(obj, (list, tuple)):
        return [_map_texts(v, f, "", skip) for v in obj]
    return obj


class _Placeholders:
    """Message dicts and tool schemas whose special-token texts are replaced by placeholders
    (`ChatFormat._hold`)."""

    def __init__(self, dicts: list[dict[str, Any]], tools: list[dict] | None = None) -> None:
        self.dicts, self.tools = dicts, tools
        self.texts: list[str] = []  # the special texts, in placeholder order
        self.pattern: re.Pattern[str] | None = None  # matches a placeholder; None: nothing held

    def restore(self, text: str) -> str:
        """`text` with the held special texts back in place of their placeholders."""
        if self.pattern is None:
            return text
        return self.pattern.sub(lambda m: self.texts[int(m.group(1))], text)

    def check(self, rendered: str, real: str) -> None:
        """Raise TemplateError unless `rendered` (from `self.dicts`) with the special texts put back
        is `real`, the template's render of the real content (a template that escapes, drops or
        rewrites special-token text in content is refused rather than shown other text)."""
        if self.restore(rendered) != real:
            at = _common_prefix(self.restore(rendered), real)
            raise TemplateError(
                "the chat template renders special-token text inside message content or tool "
                f"schemas differently from other text (at character {at}: "
                f"{real[max(0, at - 40) : at + 40]!r}); it cannot be kept as plain text"
            )


def _common_prefix(a: str, b: str) -> int:
    return next(
        (k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )
