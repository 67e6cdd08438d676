"""Gymnasium spaces over chat: `String`, one `Message` (`MessageSpace`, an env's action space) and
a list of messages (`MessagesSpace`, its observation space).
"""

from __future__ import annotations

from typing import Any

import gymnasium
import numpy as np

from agentgrpo.types import Message

_ALPHABET = np.array(list("abcdefghijklmnopqrstuvwxyz 0123456789+-*/=.,"))


class String(gymnasium.spaces.Space):
    """Any Python string (Unicode included). Gymnasium's `Text` admits only a small charset and
    counts characters, which fits neither model output nor tokens."""

    def __init__(self, max_sample_length: int = 32, seed: int | None = None) -> None:
        super().__init__(shape=None, dtype=None, seed=seed)
        self.max_sample_length = max_sample_length

    def sample(self, mask: Any = None, probability: Any = None) -> str:
        n = int(self.np_random.integers(1, self.max_sample_length + 1))
        return "".join(self.np_random.choice(_ALPHABET, size=n))

    def contains(self, x: Any) -> bool:
        return isinstance(x, str)

    @property
    def is_np_flattenable(self) -> bool:
        return False

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, String)


class MessageSpace(gymnasium.spaces.Space):
    """One chat message (the action space: what the model said)."""

    def __init__(self, role: str = "assistant", seed: int | None = None) -> None:
        super().__init__(shape=None, dtype=None, seed=seed)
        self.role = role
        self._text = String()

    def seed(self, seed: int | None = None) -> list[int]:
        out = super().seed(seed)
        self._text.seed(int(self.np_random.integers(2**31)))
        return out

    def sample(self, mask: Any = None, probability: Any = None) -> Message:
        return Message(role=self.role, content=self._text.sample())

    def contains(self, x: Any) -> bool:
        return isinstance(x, Message)

    @property
    def is_np_flattenable(self) -> bool:
        return False

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, MessageSpace) and other.role == self.role


class MessagesSpace(gymnasium.spaces.Space):
    """A list of chat messages (the observation space: what the env says)."""

    def __init__(self, seed: int | None = None) -> None:
        super().__init__(shape=None, dtype=None, seed=seed)
        self._msg = MessageSpace(role="user")

    def seed(self, seed: int | None = None) -> list[int]:
        out = super().seed(seed)
        self._msg.seed(int(self.np_random.integers(2**31)))
        return out

    def sample(self, mask: Any = None, probability: Any = None) -> list[Message]:
        return [self._msg.sample() for _ in range(int(self.np_random.integers(1, 3)))]

    def contains(self, x: Any) -> bool:
        return isinstance(x, list) and all(isinstance(m, Message) for m in x)

    @property
    def is_np_flattenable(self) -> bool:
        return False

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, MessagesSpace)
