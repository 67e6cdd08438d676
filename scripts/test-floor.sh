#!/usr/bin/env bash
# The test suite once more on the oldest transformers that pyproject.toml admits (its floor).
# transformers renames and reshapes APIs between minor versions (5.2x renamed past_key_values to
# cache; 5.17's GGUF conversion picks another EOS): a floor nobody runs is a guess. The floor's
# wheel (and a huggingface_hub it accepts) go into .venv/transformers-floor, put in front of the
# venv's own by PYTHONPATH; everything else is the venv's. Run by scripts/test.sh after the main
# suite (AGENTGRPO_FLOOR_TESTS=0 skips it there); arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
floor=$(sed -n 's/^ *"transformers>=\([0-9.]*\)".*/\1/p' pyproject.toml)
[ -n "$floor" ] || { echo "test-floor: no transformers>=X.Y in pyproject.toml" >&2; exit 1; }
[[ $floor == *.*.* ]] || floor=$floor.0  # 5.17 -> transformers==5.17.0, as the package reports it
dir=.venv/transformers-floor
if [ "$(cat "$dir/VERSION" 2>/dev/null)" != "$floor" ]; then
  rm -rf "$dir"
  # 5.x needs huggingface_hub 1.x (the venv may hold 2.x); their other needs are the venv's.
  out=$(.venv/bin/python -m pip install -q --disable-pip-version-check --no-deps --target "$dir" \
    "transformers==$floor" "huggingface_hub>=1.5,<2" 2>&1) || { echo "$out" >&2; exit 1; }
fi
export PYTHONPATH="$PWD/$dir${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
.venv/bin/python -c "import transformers as t; assert t.__version__ == '$floor', t.__version__; print('test-floor: transformers', t.__version__)"
echo "$floor" > "$dir/VERSION"  # only once the floor imports: a failed install is retried next time
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
