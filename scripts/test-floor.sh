#!/usr/bin/env bash
# The test suite once more on the oldest versions that pyproject.toml admits (its floors).
# Libraries rename and reshape APIs between minor versions (transformers 5.2x renamed
# past_key_values to cache; 5.17's GGUF conversion picks another EOS; accelerate before 1.6 has no
# FSDP2; torch 2.6 has no dcp.save(no_dist=...)): a floor nobody runs is a guess. scripts/floors.py
# names the floored packages (torch and the pure-Python ones); their floor wheels, and what those
# need that the venv lacks (torch's CUDA libraries, pydantic's exact pydantic-core, a huggingface_hub
# 1.x for transformers 5.17), go into .venv/floors (6.7 GB), put in front of the venv's own by
# PYTHONPATH; everything else is the venv's. Run by .ci/run after scripts/test.sh (setup and the main
# suite); arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
py=.venv/bin/python
dir=.venv/floors
pins=$($py scripts/floors.py pins)
pip_in() {  # each round into a folder of its own, then merged in: pip's --target skips (with a
  # warning) a top-level folder that is already there, and torch's CUDA wheels share nvidia/
  local out
  rm -rf "$dir.round"
  out=$($py -m pip install -q --disable-pip-version-check --no-cache-dir --no-deps \
    --target "$dir.round" "$@" 2>&1) \
    || { echo "$out" >&2; exit 1; }
  if [ -d "$dir" ]; then
    cp -al --remove-destination "$dir.round/." "$dir/" && rm -rf "$dir.round"
  else
    mv "$dir.round" "$dir"
  fi
}
need_gb=8  # the unpacked floors (6.7 GB) and the largest wheel while it unpacks; no pip cache
if [ "$(cat "$dir/PINS" 2>/dev/null)" != "$pins" ]; then
  rm -rf "$dir" .venv/transformers-floor  # (the old overlay, of transformers alone)
  free_gb=$(df -P -BG . | awk 'NR == 2 { print int($4) }')
  if [ "$free_gb" -lt "$need_gb" ]; then
    echo "test-floor: the floors need about $need_gb GB of disk and $PWD's disk has $free_gb GB free" >&2
    df -h . "${TMPDIR:-/tmp}" >&2
    exit 1
  fi
  # shellcheck disable=SC2086  # word splitting wanted: one pin a word
  pip_in $pins
  for _ in 1 2 3 4 5; do  # their needs, and the needs of those (floors.py check says if any are left)
    needs=$(PYTHONPATH="$PWD/$dir" $py scripts/floors.py missing "$dir")
    [ -z "$needs" ] && break
    # shellcheck disable=SC2086
    pip_in $needs
  done
fi
export PYTHONPATH="$PWD/$dir${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# the optional extras are not floored: their tests skip where they do not import on the floors
export AGENTGRPO_FLOORS=1
$py scripts/floors.py check "$dir"
echo "$pins" > "$dir/PINS"  # only once the floors are in place: a failed install is retried next time
bash scripts/pytest.sh "$py" "$@"
