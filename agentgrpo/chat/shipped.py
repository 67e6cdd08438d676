"""Chat templates shipped with agentgrpo: the original templates of the model families people train,
byte for byte as their models distribute them, so a run, a test or `check-template` can name one
(`model.chat_template: qwen3`) instead of pointing at a file.

Every file under `templates/` was taken unchanged from its source (`ShippedTemplate.source`):
the collection of original templates in huggingface/trl (`trl/chat_templates/`), which keeps them
as the checkpoints below ship them, and for DeepSeek-V3 with tools, whose own template never shows
the tools, the tool template SGLang publishes for serving it with its `deepseekv3` parser. Which of
them trains token-exactly, and in which trajectory mode, is in docs/environments.md (the families
table); `check-template` audits any.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path

TRL_COMMIT = "f2cd57710ae345ea6428ae95363267fcf38a3dc8"
TRL_SOURCE = f"huggingface/trl trl/chat_templates/ at {TRL_COMMIT}"
SGLANG_DEEPSEEK_V3_TOOLS = (
    "sgl-project/sglang examples/chat_template/tool_chat_template_deepseekv3.jinja at "
    "3e090330d192ebb124c43d808882af19f64c18f5"
)


@dataclass(frozen=True)
class ShippedTemplate:
    name: str
    models: str
    """The checkpoints that ship this template (the source of the copy)."""
    notes: str
    """What makes it matter for token-in/token-out training."""
    source: str = TRL_SOURCE
    """Where the file was copied from: repository, path and commit."""


SHIPPED: dict[str, ShippedTemplate] = {
    t.name: t
    for t in (
        ShippedTemplate(
            "qwen2_5", "Qwen/Qwen2.5-*-Instruct", "Hermes <tool_call>; results in a user turn"
        ),
        ShippedTemplate("qwen3", "Qwen/Qwen3-* (hybrid thinking)", "drops earlier <think> blocks"),
        ShippedTemplate("qwen3_instruct_2507", "Qwen/Qwen3-4B-Instruct-2507", "no thinking"),
        ShippedTemplate(
            "qwen3_5_think", "Qwen/Qwen3.5 (4B and larger)", "XML <function=...> calls"
        ),
        ShippedTemplate("qwen3_6", "Qwen/Qwen3.6-27B, Qwen3.6-35B-A3B", "preserve_thinking flag"),
        ShippedTemplate("llama3_1", "meta-llama/Llama-3.1-*-Instruct", "one bare JSON call a turn"),
        ShippedTemplate("deepseekv3", "deepseek-ai/DeepSeek-V3", "special-token call markers"),
        ShippedTemplate(
            "deepseekv3_tools",
            "deepseek-ai/DeepSeek-V3, DeepSeek-V3-0324 served with tools",
            "lists the tools in the system message (V3's own template never shows them)",
            SGLANG_DEEPSEEK_V3_TOOLS,
        ),
        ShippedTemplate("gemma3", "google/gemma-3-*-it", "no tool role"),
        ShippedTemplate("phi3_5", "microsoft/Phi-3.5-mini-instruct", "no tools"),
        ShippedTemplate("gptoss", "openai/gpt-oss-20b, gpt-oss-120b", "harmony channels"),
        ShippedTemplate("glm4moe", "zai-org/GLM-4.5, GLM-4.5-Air", "XML <arg_key> calls"),
        ShippedTemplate(
            "nemotron_3_nano", "nvidia/NVIDIA-Nemotron-3-Nano-*", "XML calls, reasoning"
        ),
        ShippedTemplate("lfm2_2_5", "LiquidAI/LFM2.5-*", "Python-style [name(k=v)] calls"),
    )
}


def template_path(name: str) -> Path:
    """The file of the shipped template `name` (a key of `SHIPPED`)."""
    if name not in SHIPPED:
        raise KeyError(
            f"no shipped chat template named {name!r}; shipped: {', '.join(sorted(SHIPPED))}"
        )
    return Path(str(resources.files("agentgrpo.chat") / "templates" / f"{name}.jinja"))


def load_template(name_or_path: str | Path) -> str:
    """The text of a chat template: a shipped one by name (`qwen3`), else a Jinja file's path."""
    if isinstance(name_or_path, str) and name_or_path in SHIPPED:
        return template_path(name_or_path).read_text()
    path = Path(name_or_path)
    if not path.is_file():
        raise FileNotFoundError(
            f"chat template {str(name_or_path)!r} is neither a file nor a shipped template "
            f"({', '.join(sorted(SHIPPED))})"
        )
    return path.read_text()
