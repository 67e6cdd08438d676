#!/usr/bin/env bash
# The tests marked `vllm`: real vLLM servers (vLLM's CPU build, from .venv-vllm) against the
# client, the weight sync and the training loop. Sets up both venvs first (idempotent), then runs
# them with the interpreter they start servers from. Arguments go to pytest.
# Time and memory: docs/development.md.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/vllm-setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export AGENTGRPO_VLLM_PYTHON=${AGENTGRPO_VLLM_PYTHON:-$PWD/.venv-vllm/bin/python}
exec .venv/bin/python -m pytest -q -p no:cacheprovider -p no:xdist -m vllm tests/test_vllm_server.py "$@"
