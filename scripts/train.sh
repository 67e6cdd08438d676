#!/usr/bin/env bash
# Sets everything up and trains the embedded model on the calculator example:
#   bash scripts/train.sh [key=value ...]      e.g. bash scripts/train.sh train.steps=2
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/agentgrpo train examples/calculator.yaml "$@"
