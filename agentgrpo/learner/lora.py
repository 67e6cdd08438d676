"""LoRA through peft: adapters on the policy, the base weights as the reference, merged weights out.

- `apply_lora(model, cfg)` wraps a transformers causal LM in a peft `PeftModel`; only the adapter
  trains (the optimizer sees only trainable parameters).
- The KL reference is the same model with the adapter disabled (`PolicyForward(...,
  disable_adapter=True)`): no second copy of the weights in memory.
- Engines (SGLang, `LocalEngine`) load plain checkpoints, so weight sync pushes *merged* weights
  under the base model's names: `merged_state_dict` computes W + scaling * B @ A out of place (the
  training weights are never merged and unmerged, which would drift them by float rounding), and
  `MergedModel` presents them to `WeightSync` as an ordinary model.
- Checkpoints hold the adapter only (peft's `save_pretrained` / `adapter_weights`); the base comes
  from `model.path` when the run resumes.
"""

from __future__ import annotations

from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field
from safetensors.torch import load_file


class LoraConfig(BaseModel):
    """LoRA adapter of the policy (peft). Set `learner.lora` to train adapters instead of all
    weights."""

    model_config = ConfigDict(extra="forbid")

    r: int = Field(16, ge=1, description="adapter rank")
    alpha: float = Field(32.0, gt=0, description="scaling numerator: delta W = alpha / r * B @ A")
    dropout: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="dropout on the adapter input (0: exact "
        "old logprobs recomputation and a deterministic reference)",
    )
    target_modules: list[str] | str = Field(
        "all-linear",
        description="module names to adapt, or 'all-linear' (every linear layer but the head)",
    )


def apply_lora(model: torch.nn.Module, cfg: LoraConfig) -> torch.nn.Module:
    """`model` with LoRA adapters (a peft `PeftModel`); base weights frozen."""
    try:
        import peft
    except ImportError as e:  # optional dependency: say which extra brings it
        raise ImportError("learner.lora needs peft: pip install 'agentgrpo[lora]'") from e
    pcfg = peft.LoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=cfg.target_modules,
        task_type="CAUSAL_LM",
    )
    return peft.get_peft_model(model, pcfg)


def _lora_layers(peft_model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    from peft.tuners.lora import LoraLayer

    base = peft_model.get_base_model()
    return {name: m for name, m in base.named_modules() if isinstance(m, LoraLayer)}


def merged_state_dict(
    peft_model: torch.nn.Module, state_dict: dict[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """The base model's state dict (its own parameter names) with every adapter merged in.

    `state_dict` is the peft base model's state dict (names with `.base_layer.` and `lora_A/B`); by
    default it is read from `peft_model`. Pass a gathered one under FSDP.
    """
    sd = state_dict if state_dict is not None else peft_model.get_base_model().state_dict()
    adapter = peft_model.active_adapter
    out: dict[str, torch.Tensor] = {}
    for name, layer in _lora_layers(peft_model).items():
        if not isinstance(layer.get_base_layer(), torch.nn.Linear):
            raise ValueError(f"{name}: only LoRA on nn.Linear layers can be merged for weight sync")
        w = sd[f"{name}.base_layer.weight"]
        a = sd[f"{name}.lora_A.{adapter}.weight"].to(torch.float32)
        b = sd[f"{name}.lora_B.{adapter}.weight"].to(torch.float32)
        if getattr(layer, "fan_in_fan_out", False):
            raise ValueError(f"{name}: fan_in_fan_out (Conv1D) layers are not supported")
        delta = (b @ a) * layer.scaling[adapter]
        out[f"{name}.weight"] = (w.to(torch.float32) + delta).to(w.dtype)
    for key, t in sd.items():
        if "lora_" in key or ".base_layer.weight" in key:
            continue
        out[key.replace(".base_layer.", ".")] = t
    return out


class MergedModel(torch.nn.Module):
    """A LoRA policy as `WeightSync` needs it: `forward` runs the adapted model (numerically the
    merged one), `state_dict()` / `save_pretrained()` give merged weights under the base names."""

    def __init__(self, peft_model: torch.nn.Module) -> None:
        super().__init__()
        self.inner = peft_model
        self.config = peft_model.get_base_model().config

    def forward(self, *args, **kwargs):
        return self.inner(*args, **kwargs)

    def state_dict(self, *args, **kwargs) -> dict[str, torch.Tensor]:  # type: ignore[override]
        return merged_state_dict(self.inner)

    def save_pretrained(
        self, directory: str | Path, state_dict: dict[str, torch.Tensor] | None = None, **kwargs
    ) -> None:
        self.inner.get_base_model().save_pretrained(
            directory,
            state_dict=state_dict if state_dict is not None else self.state_dict(),
            **kwargs,
        )


def adapter_weights(peft_model: torch.nn.Module, directory: Path) -> dict[str, torch.Tensor]:
    """The adapter peft's `save_pretrained` wrote (`adapter_model.safetensors`), under the peft
    model's own parameter names.

    peft's files drop the adapter name (`...q_proj.lora_A.weight`); the live parameters carry it
    (`...q_proj.lora_A.default.weight`). Putting it back lets the learner load the adapter with
    torch's `set_model_state_dict`, which works the same on a plain, DDP or FSDP-sharded model.
    Only Linear LoRA layers exist here (`merged_state_dict` refuses others), so `lora_A`/`lora_B`
    are the only names to map.
    """
    adapter = peft_model.active_adapter
    out = {}
    for key, t in load_file(directory / "adapter_model.safetensors").items():
        for part in ("lora_A", "lora_B"):
            key = key.replace(f".{part}.weight", f".{part}.{adapter}.weight")
        out[key] = t
    return out
