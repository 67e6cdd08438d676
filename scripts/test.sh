#!/usr/bin/env bash
# Sets everything up and runs the test suite once (the README's test command; CI runs it, then
# scripts/test-floor.sh). Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# System packages: bubblewrap (sandbox) and chromium (the report's browser test); need root.
if [ "$(id -u)" = 0 ]; then bash scripts/system-deps.sh; else echo "not root: tests that need bubblewrap or chromium may skip"; fi
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
.venv/bin/ruff check --quiet .
.venv/bin/ruff format --check --quiet .
bash scripts/pytest.sh .venv/bin/python "$@"
