"""The in-process engine: a transformers model that batches concurrent requests (the CPU
default)."""

from agentgrpo.engine.local.engine import LocalEngine

__all__ = ["LocalEngine"]
