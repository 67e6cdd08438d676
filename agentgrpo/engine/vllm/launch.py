"""Start a vLLM server for RL: `agentgrpo serve-vllm MODEL [vllm args]` runs vLLM's server
(`python -m vllm.entrypoints.openai.api_server`) in the foreground until Ctrl-C; `VLLMServer` does
the same as a context manager (the shared machinery and defaults: `engine/launch.py`).

What it adds for vLLM, each unless the user gave it (docs/rollouts.md):
- `VLLM_SERVER_DEV_MODE=1` in the server's environment: the RL API (pause, resume, weight updates,
  `/collective_rpc`, `/server_info`) exists only in dev mode;
- `--enable-scale-out`: the token-in/token-out route `/inference/v1/generate`;
- `--logprobs-mode processed_logprobs`: logprobs of the tempered distribution it samples from
  (vLLM's default returns those of the raw logits);
- on a machine without CUDA, `VLLM_TARGET_DEVICE=cpu` (vLLM's CPU build detects its platform only
  so), `VLLM_CPU_KVCACHE_SPACE=1` (GiB of KV cache; without it vLLM claims 92% of the machine's
  memory and refuses to start when less is free) and `--enforce-eager` (a multi-minute compile
  warm-up on a small CPU, otherwise).
`--python` runs the server with another interpreter, e.g. the venv `scripts/vllm-setup.sh` makes.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from collections.abc import Sequence

from agentgrpo.engine.launch import ServerProcess, serve_main

DEFAULT_PORT = 8000


def _has_cuda() -> bool:
    return shutil.which("nvidia-smi") is not None


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
