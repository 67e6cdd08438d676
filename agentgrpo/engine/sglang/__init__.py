"""SGLang: the HTTP client of its native API, its server pool, the launcher and NCCL weight
pushes."""

from agentgrpo.engine.sglang.client import SGLangEngine

__all__ = ["SGLangEngine"]
