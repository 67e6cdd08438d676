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
    (`hold`)."""

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


def printed(dicts: list[dict[str, Any]], tools: list[dict] | None) -> list[str]:
    """Every string of `dicts` and `tools` a template may print (`_texts`)."""
    return [t for d in dicts for t in _texts(d)] + list(_texts(tools or [], skip=None))


def hold(
    special_text: re.Pattern[str] | None,
    dicts: list[dict[str, Any]],
    tools: list[dict] | None = None,
    avoid: str = "",
) -> _Placeholders:
    """`dicts` and `tools` with every match of `special_text` (the tokenizer's special tokens)
    inside any string the template may print (the content, and as much the tool name a model
    chose or a tool call id; every string of a tool schema, which an MCP server or an endpoint
    client wrote; `_texts`) replaced by a placeholder.

    The placeholders are ASCII letters and digits (`agentgrpo<n>h<i>e`, `n` chosen so that
    neither a content nor `avoid`, the real render, holds `agentgrpo<n>h`), which template
    filters such as `trim` and `tojson` leave as they are: the template renders the real content
    around them, and `ChatFormat._encode_rendered` puts the special texts back as plain text."""
    protected = _Placeholders(dicts, tools)
    if special_text is None:
        return protected
    contents = printed(dicts, tools)
    if not any(special_text.search(c) for c in contents):
        return protected
    nonce = 0
    while any(f"agentgrpo{nonce}h" in c for c in [*contents, avoid]):
        nonce += 1

    def mark(m: re.Match) -> str:
        protected.texts.append(m.group())
        return f"agentgrpo{nonce}h{len(protected.texts) - 1}e"

    protected.dicts = [_map_texts(d, lambda t: special_text.sub(mark, t)) for d in dicts]
    if tools:
        protected.tools = _map_texts(tools, lambda t: special_text.sub(mark, t), skip=None)
    protected.pattern = re.compile(f"agentgrpo{nonce}h([0-9]+)e")
    return protected


def special_tokens(tokenizer: Any) -> tuple[re.Pattern[str] | None, dict[str, tuple[bool, bool]]]:
    """A pattern matching any of the tokenizer's special tokens (None: it has none), and the
    whitespace each added special token absorbs on its (left, right), as the tokenizer's own
    added-token split does."""
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    specials = {t.content for t in decoder.values() if getattr(t, "special", False)}
    specials = {t for t in specials | set(getattr(tokenizer, "all_special_tokens", []) or []) if t}
    strips = {
        t.content: (bool(getattr(t, "lstrip", False)), bool(getattr(t, "rstrip", False)))
        for t in decoder.values()
        if t.content in specials
    }
    # One alternation: ~4 us on 4 KB against Llama 3's 256 special tokens (`any(t in s)`: ~140 us).
    pattern = (
        re.compile("|".join(map(re.escape, sorted(specials, key=len, reverse=True))))
        if specials
        else None
    )
    return pattern, strips


def split_at_specials(
    text: str, special_text: re.Pattern[str] | None, strips: dict[str, tuple[bool, bool]]
) -> Iterator[tuple[str, str | None]]:
    """`text` as (plain piece, the special token after it or None at the end), split at the
    template's own special tokens (held texts are placeholders there) as the tokenizer's
    added-token split does, the whitespace a token with lstrip/rstrip absorbs left out.

    Tokenizing each piece with special tokens split into plain text lets BPE merges run across
    held text as across ordinary text, and ordinary text tokenizes as `ChatFormat.encode` does.
    This assumes the tokenizer treats each piece between added tokens the same wherever it starts,
    as byte-level BPE tokenizers (Qwen, Llama 3, DeepSeek-V3, SmolLM2) do; a SentencePiece one that
    prepends "▁" to its input shows an extra "▁" after each special token on this rare path."""
    pos, absorb_left = 0, False
    for m in special_text.finditer(text) if special_text is not None else ():
        lstrip, rstrip = strips.get(m.group(), (False, False))
        piece = text[pos : m.start()]
        piece = piece.lstrip() if absorb_left else piece
        yield (piece.rstrip() if lstrip else piece), m.group()
        pos, absorb_left = m.end(), rstrip
    piece = text[pos:]
    yield (piece.lstrip() if absorb_left else piece), None
