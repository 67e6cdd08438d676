"""What the chat layer raises when a template cannot give token-exact multi-turn rollouts."""

from __future__ import annotations


class TemplateError(ValueError):
    """The chat template cannot produce token-exact multi-turn rollouts for this conversation."""


class HistoryRewritten(TemplateError):
    """The template renders the history differently once the new messages follow, or (a turn that
    ends at the next role token) opens them with another token than the one the model stopped on,
    so the tokens sampled so far cannot be continued as one sequence (a new segment can start
    instead)."""
