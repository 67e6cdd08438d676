"""Shared fixtures: the real SmolLM2 tokenizer, a tiny random model with its vocabulary."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# `auto` precision follows the CPU (agentgrpo.models.hardware); the tests' fp32 tolerances need one
# answer on every CPU kind, in the processes they spawn too. tests/test_hardware.py covers both
# answers.
os.environ.setdefault("AGENTGRPO_CPU_BF16", "0")

DATA = Path(__file__).resolve().parent / "data"  # test data the repository carries


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    """Tell scripts/pytest.sh that the session ended, and how: what the interpreter does after this
    (an abort in its finalization, pytorch#38228) is then told apart from a crash during a test."""
    path = os.environ.get("AGENTGRPO_PYTEST_STATUS_FILE")
    if path and not hasattr(
        session.config, "workerinput"
    ):  # an xdist worker's end is not the run's
        Path(path).write_text(str(int(exitstatus)))


@pytest.fixture(scope="session")
def smol_path() -> Path:
    from agentgrpo.models.embedded import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def smol_tokenizer(smol_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smol_path)


@pytest.fixture(scope="session")
def chat(smol_tokenizer):
    from agentgrpo.chat.format import ChatFormat

    return ChatFormat(smol_tokenizer)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smol_tokenizer) -> Path:
    """A randomly initialised 2-layer Llama with SmolLM2's vocabulary, saved like a real model."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(smol_tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        eos_token_id=smol_tokenizer.eos_token_id,
        pad_token_id=smol_tokenizer.pad_token_id,
    )
    d = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(cfg).save_pretrained(d)
    smol_tokenizer.save_pretrained(d)
    return d


def shipped_template(name: str) -> str:
    """The text of a chat template shipped in agentgrpo/chat/templates/ (`qwen3`, `qwen3.jinja`)."""
    from agentgrpo.chat.shipped import load_template

    return load_template(name.removesuffix(".jinja"))


def template_file(name: str) -> Path:
    """The file of a shipped chat template, for what takes a path (`--template`, a config)."""
    from agentgrpo.chat.shipped import template_path

    return template_path(name.removesuffix(".jinja"))


def llama31_chat(tokenizer):
    """Llama 3.1's real template over a copy of `tokenizer` that knows its special tokens."""
    import copy

    from agentgrpo.chat.format import ChatFormat

    tok = copy.deepcopy(tokenizer)
    tok.add_special_tokens(
        {
            "additional_special_tokens": [
                "<|eot_id|>",
                "<|start_header_id|>",
                "<|end_header_id|>",
                "<|python_tag|>",
            ]
        }
    )
    return ChatFormat(
        tok,
        template=shipped_template("llama3_1.jinja"),
        parser="llama3_json",
        end_of_turn="<|eot_id|>",
    )


@pytest.fixture(scope="session")
def stopping_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny random model with 5,000 token ids declared as EOS: ~10% of its turns end within a
    few tokens (and get a reward), the rest hit the token limit, so rewards and advantages vary."""
    import json
    import shutil

    d = tmp_path_factory.mktemp("stopping") / "model"
    shutil.copytree(tiny_model_dir, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["eos_token_id"] = [cfg["eos_token_id"], *range(1000, 6000)]
    (d / "config.json").write_text(json.dumps(cfg))
    return d
