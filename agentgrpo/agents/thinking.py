"""A thinking model's reasoning, split from its reply text and joined back exactly.

Templates of thinking models (Qwen3, DeepSeek-R1, GLM) have the model write `<think>...</think>`
before its answer; the chat reply carries it in `content`. The Responses API returns it as a
`reasoning` item and Anthropic's Messages API as a `thinking` block, and clients send both back
with the next call. Joining them back must give the exact content the endpoint replied with, so
the next prompt continues the episode's tokens (a different string would render from scratch and
start a new segment). The whitespace around the tags (`framing`) is kept with the reasoning: in
the Anthropic block's `signature`, and in the Responses item's `encrypted_content` and the
episode's table of item ids. Reasoning sent without its framing gets the usual one.
"""

from __future__ import annotations

import base64
import json
import re
from dataclasses import dataclass

_THOUGHT = re.compile(r"(\s*(?:<think>)?\s*)(.*?)(\s*</think>\s*)", re.S)
DEFAULT_FRAMING = ("<think>\n", "\n</think>\n\n")


@dataclass(frozen=True)
class Thought:
    """The reasoning text and what surrounds it: content == before + text + after + answer."""

    text: str
    before: str = DEFAULT_FRAMING[0]
    after: str = DEFAULT_FRAMING[1]

    @property
    def signature(self) -> str:
        """The framing as an opaque string (Anthropic's `signature`, the Responses API's
        `encrypted_content`)."""
        return base64.urlsafe_b64encode(json.dumps([self.before, self.after]).encode()).decode()

    @classmethod
    def signed(cls, text: str, signature: str | None) -> Thought:
        """The reasoning with the framing its signature holds (the usual one for a signature this
        endpoint did not make)."""
        try:
            before, after = json.loads(base64.urlsafe_b64decode(signature or ""))
            if isinstance(before, str) and isinstance(after, str):
                return cls(text, before, after)
        except (ValueError, TypeError):
            pass  # a client's own or empty signature: the usual framing
        return cls(text)


def split_thinking(content: str) -> tuple[Thought | None, str]:
    """(the reasoning, the answer) of a reply; no reasoning when it has no `</think>`."""
    m = _THOUGHT.match(content)
    if m is None or "<think>" in m[2]:
        return None, content
    return Thought(m[2], m[1], m[3]), content[m.end() :]


def join_thinking(thought: Thought | None, answer: str) -> str:
    """The reply content `split_thinking` split."""
    return answer if thought is None else thought.before + thought.text + thought.after + answer
