"""Real vLLM servers for the tests marked `vllm` (`scripts/test-vllm.sh` runs them): vLLM's CPU
build serving the embedded SmolLM2 in float32, started from the interpreter in
`AGENTGRPO_VLLM_PYTHON` (the venv `scripts/vllm-setup.sh` makes) and always stopped, even when a
test fails.

Without that variable the tests skip: the main suite does not start servers, `test-vllm.sh` sets
it. With it, a CPU vLLM's CPU build cannot run on (no AVX2) skips with that reason; anything else
that stops a server from starting fails.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agentgrpo.engine.vllm.launch import VLLMServer

PYTHON_ENV = "AGENTGRPO_VLLM_PYTHON"
# Small on purpose (docs/development.md): 1 GiB of KV cache is ~23,000 tokens of SmolLM2 in fp32.
SERVER_ARGS = ["--max-model-len", "2048", "--max-num-seqs", "16", "--dtype", "float32"]


def vllm_python() -> str:
    """The interpreter with vLLM, or a skip that says why the tests cannot run here."""
    python = os.environ.get(PYTHON_ENV)
    if not python:
        pytest.skip(f"real-server tests: run by scripts/test-vllm.sh ({PYTHON_ENV} unset)")
    if not Path(python).exists():
        pytest.fail(f"{PYTHON_ENV}={python} does not exist: run scripts/vllm-setup.sh")
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else "avx2"
    if "avx2" not in flags:
        pytest.skip("vLLM's CPU build needs AVX2, which this CPU lacks")
    return python


def start_server(model: Path, log: Path, *extra: str) -> VLLMServer:
    """A started vLLM server on a free port (stop it with `.stop()`)."""
    server = VLLMServer(
        str(model),
        port=0,
        python=vllm_python(),
        extra_args=[*SERVER_ARGS, *extra],
        log_path=log,
        ready_timeout_s=300,
    )
    server.start()
    return server
