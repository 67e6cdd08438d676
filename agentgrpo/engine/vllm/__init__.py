"""vLLM: the HTTP client of its token-in/token-out route and RL API, and the launcher."""

from agentgrpo.engine.vllm.client import VLLMEngine

__all__ = ["VLLMEngine"]
