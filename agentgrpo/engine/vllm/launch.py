"""Start a vLLM server for RL: `agentgrpo serve-vllm MODEL [vllm args]` runs vLLM's server
(`python -m vllm.entrypoints.openai.api_server`) in the foreground until Ctrl-C; `VLLMServer` does
the same as a context manager (the shared machinery and defaults: `engine/launch.py`).

Unless the user gave them, it adds dev mode (`VLLM_SERVER_DEV_MODE=1`, the RL API),
`--enable-scale-out` (the token route) and `--logprobs-mode processed_logprobs` (the tempered
distribution's logprobs). On a machine without CUDA it also sets the CPU build's platform and KV
cache size, runs eagerly, and serves a tied model from an untied copy (removed at `stop()`), since
an in-place reload does not reach the CPU build's prepacked projection. docs/rollouts.md has the
reason for each. `--python` runs the server with another interpreter, e.g. the venv
`scripts/vllm-setup.sh` makes.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from agentgrpo.engine.launch import ServerProcess, serve_main

DEFAULT_PORT = 8000


def _has_cuda() -> bool:
    return shutil.which("nvidia-smi") is not None


def untied_copy(model_dir: Path) -> Path | None:
    """A temporary copy of the model directory with its tied output projection as a tensor of its
    own (`lm_head.weight`, equal to the input embedding) and `tie_word_embeddings: false`; None
    when the model is not a local directory of a tied model with safetensors weights."""
    config_file = model_dir / "config.json"
    if not config_file.is_file():
        return None
    config = json.loads(config_file.read_text())
    if not config.get("tie_word_embeddings"):
        return None
    from safetensors.torch import load_file, save_file

    weights: dict = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        weights.update(load_file(str(f)))
    embed = [k for k in weights if k.endswith("embed_tokens.weight")]
    if len(embed) != 1:
        return None
    out = Path(tempfile.mkdtemp(prefix="agentgrpo-vllm-untied-"))
    for f in model_dir.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and not f.name.endswith(".index.json"):
            shutil.copy(f, out / f.name)
    weights.setdefault("lm_head.weight", weights[embed[0]].clone())
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    return out


class VLLMServer(ServerProcess):
    """One vLLM server process (see `ServerProcess`).

    Example:
        ```python
        with VLLMServer(model_dir, port=0, python=".venv-vllm/bin/python",
                        extra_args=["--max-model-len", "2048"]) as srv:
            engine = VLLMEngine([srv.url])
            ...
        ```
    """

    name = "vLLM"
    default_module = "vllm.entrypoints.openai.api_server"
    default_port = DEFAULT_PORT
    model_flag = "--model"
    health_path = "/health"
    default_api_key_env = "VLLM_API_KEY"

    def rl_args(self) -> list[str]:
        args = ["--enable-scale-out", "--logprobs-mode", "processed_logprobs"]
        return args if _has_cuda() else [*args, "--enforce-eager"]

    _untied: Path | None = None

    def start(self) -> str:
        at = self.command.index(self.model_flag) + 1
        if not _has_cuda() and self._untied is None:
            self._untied = untied_copy(Path(self.command[at]))
            if self._untied is not None:
                print(f"vLLM on the CPU: serving an untied copy, {self._untied}", file=sys.stderr)
                self.command[at] = str(self._untied)
        return super().start()

    def stop(self, grace_s: float = 30.0) -> int | None:
        rc = super().stop(grace_s)
        if self._untied is not None:
            shutil.rmtree(self._untied, ignore_errors=True)
            self._untied = None
        return rc

    def server_env(self, env: dict[str, str]) -> dict[str, str]:
        env["VLLM_SERVER_DEV_MODE"] = "1"
        if not _has_cuda():
            env.setdefault("VLLM_TARGET_DEVICE", "cpu")
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        return env


def main(argv: Sequence[str] | None = None) -> int:
    """`agentgrpo serve-vllm MODEL [--python PY] [--ready-timeout S] [--log-file F] [vllm args]`."""
    ap = argparse.ArgumentParser(
        prog="agentgrpo serve-vllm",
        description="Start a vLLM server with the settings RL needs, wait until it is ready, and "
        "keep it running until Ctrl-C. Arguments after MODEL that are not listed here go to "
        "vLLM's server unchanged (e.g. --tensor-parallel-size 2 --port 8001).",
    )
    ap.add_argument("model", help="model directory or hub id (vLLM's --model)")
    ap.add_argument(
        "--python",
        default=None,
        help="the interpreter that has vLLM (default: this one), e.g. .venv-vllm/bin/python",
    )
    return serve_main(VLLMServer, ap, argv)


if __name__ == "__main__":
    sys.exit(main())
