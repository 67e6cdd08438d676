"""The text <-> token boundary: chat templates, the suffix tokens of new messages, and the tool-call
parsers of each model family's format. Nothing outside this package encodes or decodes history."""

from agentgrpo.chat.format import ChatFormat

__all__ = ["ChatFormat"]
