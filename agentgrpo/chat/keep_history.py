"""The keep_history fallback: where a template rewrites earlier turns, the suffix is its rendering
of the new messages only, found behind the last assistant turn, so the sampled history stays
verbatim (`ChatFormat(fallback="keep_history")`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from agentgrpo.chat.errors import TemplateError
from agentgrpo.chat.template import Render


def _last_of(text: str, tokens: Sequence[str], end: int | None = None) -> tuple[int, str]:
    """(position, token) of the last occurrence in `text[:end]` of any of `tokens`; (-1, "")."""
    return max(((text.rfind(t, 0, end), t) for t in tokens), default=(-1, ""))


def suffix_after_last_turn(
    render: Render,
    end_of_turns: tuple[str, ...],
    history_dicts: list[dict[str, Any]],
    new_dicts: list[dict[str, Any]],
    tools: list[dict] | None,
    after: str,
    glue: str,
) -> tuple[str, str]:
    """The text `after` (the render of history + new) has behind the last assistant turn, and
    the end-of-turn token it follows.

    The new messages are located by a probe render in which each new message's content starts
    with a placeholder (`agentgrpo<n>m<i>e`, absent from `after`): the last end-of-turn marker
    before the first placeholder ends the assistant turn just sampled. Marker text is never
    counted (a dropped `<think>` block may hold it, and special-token text in the new contents
    is already held as placeholders). Raises TemplateError when a new message's content is not
    rendered after that marker, when the probe's text up to the marker differs from `after`'s
    (the template renders history differently for the placeholder content, e.g. Qwen3 on a user
    message that starts with `<tool_response>`), or when the template's glue after the marker
    changed.
    """
    nonce = 0
    while f"agentgrpo{nonce}m" in after:
        nonce += 1
    marks = [f"agentgrpo{nonce}m{i}e" for i in range(len(new_dicts))]
    marked = [d.get("content") is None or isinstance(d.get("content"), str) for d in new_dicts]
    probe_dicts = [
        {**d, "content": mark + (d.get("content") or "")} if m else d
        for d, mark, m in zip(new_dicts, marks, marked, strict=True)
    ]
    probe = render(history_dicts + probe_dicts, tools, True)
    found = [probe.find(mark) for mark, m in zip(marks, marked, strict=True) if m]
    cut, eot = _last_of(probe, end_of_turns, min(found)) if found and min(found) >= 0 else (-1, "")
    end = cut + len(eot)
    tail = after[end:] if cut >= 0 else ""
    if (
        cut < 0
        or any(f < end for f in found)
        or probe[:end] != after[:end]
        or not tail.startswith(glue)
        or tail == glue
    ):
        raise TemplateError(
            "keep_history fallback: cannot locate the new messages in the template's rendering "
            "(a new message is not rendered after the last "
            f"{' or '.join(map(repr, end_of_turns))} of the history, "
            "or the history "
            "renders differently depending on the new messages' content)"
        )
    return tail, eot
