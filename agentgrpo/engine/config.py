"""`EngineConfig` (the `engine:` block of a run config) and `build_engine`, which makes the engine
it describes: the in-process `LocalEngine`, or a client of SGLang or vLLM servers."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from agentgrpo.engine.base import Engine
from agentgrpo.engine.local.engine import LocalEngine
from agentgrpo.engine.sglang.config import SGLangConfig
from agentgrpo.engine.vllm.config import VLLMConfig

_LOCAL_ONLY = (
    "max_batch_size",
    "dtype",
    "prefix_cache_tokens",
    "threads",
    "partial_rollouts",
    "device",
)


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    kind: Literal["local", "sglang", "vllm"] = Field(
        "local",
        description="local: in-process transformers engine; sglang: SGLang servers over HTTP; "
        "vllm: vLLM servers over HTTP",
    )
    max_batch_size: int = Field(32, ge=1, description="local engine: sequences decoded together")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto",
        description="local engine: weight dtype; auto = learner.dtype, but float32 where "
        "bfloat16 is not native (CUDA and CPUs with AVX512-BF16 or AMX have it; "
        "agentgrpo.models.hardware.engine_dtype)",
    )
    prefix_cache_tokens: int = Field(
        16384,
        ge=0,
        description="local engine: token budget of the prefix KV cache that lets a "
        "group's copies of a prompt and a trajectory's next turn skip prefilling what was already "
        "computed (45 KiB a token for SmolLM2-135M in float32); 0 disables it",
    )
    threads: int | None = Field(
        None,
        ge=1,
        description="local engine: torch threads of its decoding thread; None = auto: where it "
        "samples while the learner trains on the CPU (train.max_staleness >= 1), half of the "
        "run's threads and the learner the rest (models.hardware.share_cpu), else the run's",
    )
    partial_rollouts: bool = Field(
        False,
        description="local engine: a weight update lands between two decode steps instead of "
        "waiting for the running requests, which keep their tokens and KV cache and finish "
        "under the new weights (Completion.version_runs says which version sampled which ids); "
        "false: an update waits until they finish",
    )
    device: str = Field(
        "auto",
        description="local engine: where it decodes; auto = the learner's device (on a GPU the "
        "engine decodes beside the learner on rank 0's GPU, on a CPU on the CPU), or a torch "
        "device: cpu, cuda, cuda:1",
    )
    sglang: SGLangConfig | None = Field(
        None, description="kind=sglang: the servers and client settings"
    )
    vllm: VLLMConfig | None = Field(None, description="kind=vllm: the servers and client settings")

    @field_validator("device")
    @classmethod
    def _torch_device(cls, value: str) -> str:
        if value == "auto":
            return value
        try:
            torch.device(value)
        except (RuntimeError, ValueError):
            raise ValueError(
                f"engine.device={value!r} is not a torch device (auto, cpu, cuda, cuda:N)"
            ) from None
        return value

    @model_validator(mode="after")
    def _one_kind(self) -> EngineConfig:
        # A block for an engine that is not used would be silently ignored: reject it instead.
        for server in ("sglang", "vllm"):
            if self.kind == server and getattr(self, server) is None:
                raise ValueError(
                    f"engine.kind is {server} but there is no engine.{server} block (urls, ...)"
                )
            if self.kind != server and getattr(self, server) is not None:
                raise ValueError(
                    f"engine.{server} is set but engine.kind is {self.kind}; set engine.kind: "
                    f"{server}"
                )
        if self.kind != "local":  # compared with the defaults, so a dumped config.yaml loads again
            changed = [
                f"engine.{name}={getattr(self, name)}"
                for name in _LOCAL_ONLY
                if getattr(self, name) != type(self).model_fields[name].default
            ]
            if changed:
                raise ValueError(
                    f"{', '.join(changed)} configure the local engine, but engine.kind is "
                    f"{self.kind} (its servers batch and cache on their own: set that at launch)"
                )
        return self


def build_engine(
    cfg: EngineConfig,
    model_path: Path,
    tokenizer: Any,
    *,
    seed: int,
    weights_dtype: str = "float32",
    threads: int | None = None,
    learner_device: str | None = None,
) -> Engine:
    """The engine `cfg` describes, serving the model at `model_path` (the local engine; SGLang
    servers load their own model at launch). `seed` seeds the local engine's sampling;
    `weights_dtype` is the learner's weight dtype, which `dtype: auto` follows; `threads` the
    local engine's decoding threads (None: the process's); `learner_device` the device that
    `device: auto` follows (None: the CPU)."""
    # The clients are imported only here: loading a run config imports neither httpx nor them.
    if cfg.kind == "sglang":
        from agentgrpo.engine.sglang.client import SGLangEngine

        return SGLangEngine.from_config(cfg.sglang)
    if cfg.kind == "vllm":
        from agentgrpo.engine.vllm.client import VLLMEngine

        return VLLMEngine.from_config(cfg.vllm)
    device = (learner_device or "cpu") if cfg.device == "auto" else cfg.device
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"engine.device={cfg.device}: torch sees no CUDA device on this machine")
    return LocalEngine(
        model_path,
        tokenizer=tokenizer,
        device=device,
        dtype=cfg.dtype,
        weights_dtype=weights_dtype,
        max_batch_size=cfg.max_batch_size,
        prefix_cache_tokens=cfg.prefix_cache_tokens,
        seed=seed,
        threads=threads,
        partial_rollouts=cfg.partial_rollouts,
    )
