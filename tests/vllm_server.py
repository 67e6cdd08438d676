"""Real inference servers for the live tests (tests/test_vllm_server.py): a vLLM server (its CPU
build here) serving the embedded SmolLM2 in float32, started from the interpreter in
`AGENTGRPO_VLLM_PYTHON` (the venv `scripts/vllm-setup.sh` makes) and always stopped, even when a
test fails; or an SGLang server someone else runs, named by `AGENTGRPO_SGLANG_URL`.

Without those variables the tests skip: the main suite starts no server, `scripts/test-vllm.sh`
sets the first, `scripts/gpu-check.sh` the second where SGLang is installed. With them, a CPU
that vLLM's CPU build cannot run on (no AVX2) skips with that reason; anything else that keeps a
server from starting fails.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from agentgrpo.engine.vllm.launch import VLLMServer

PYTHON_ENV = "AGENTGRPO_VLLM_PYTHON"
SGLANG_URL_ENV = "AGENTGRPO_SGLANG_URL"  # an SGLang server (>= 0.5.9) serving...
SGLANG_MODEL_ENV = "AGENTGRPO_SGLANG_MODEL"  # ...this model directory (default: the embedded one)
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


def sglang_url() -> str:
    """The SGLang server's URL, or a skip that says how to give one."""
    url = os.environ.get(SGLANG_URL_ENV)
    if not url:
        pytest.skip(f"SGLang live tests: set {SGLANG_URL_ENV} (scripts/gpu-check.sh does)")
    return url


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
