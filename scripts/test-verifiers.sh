#!/usr/bin/env bash
# The verifiers adapter's tests (tests/test_env_verifiers.py) in their own venv, .venv-verifiers
# (scripts/setup-verifiers.sh says why). Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-verifiers.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
AGENTGRPO_REQUIRE_VERIFIERS=1 bash scripts/pytest.sh .venv-verifiers/bin/python \
  tests/test_env_verifiers.py "$@"
