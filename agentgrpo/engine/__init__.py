"""Inference engines. `LocalEngine`, `SGLangEngine` and `VLLMEngine` are imported lazily so that
importing the protocol pulls in neither torch nor httpx."""

from agentgrpo.engine.base import Completion, Engine, EngineError, FinishReason, SamplingParams

__all__ = [
    "Completion",
    "Engine",
    "EngineError",
    "FinishReason",
    "SamplingParams",
    "LocalEngine",
    "SGLangEngine",
    "VLLMEngine",
]


def __getattr__(name: str):
    if name == "LocalEngine":
        from agentgrpo.engine.local.engine import LocalEngine

        return LocalEngine
    if name == "SGLangEngine":
        from agentgrpo.engine.sglang.client import SGLangEngine

        return SGLangEngine
    if name == "VLLMEngine":
        from agentgrpo.engine.vllm.client import VLLMEngine

        return VLLMEngine
    raise AttributeError(name)
