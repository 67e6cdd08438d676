#!/usr/bin/env bash
# The default run (examples/calculator.yaml: the embedded SmolLM2-135M-Instruct, the local engine
# decoding on the GPU beside the learner) end to end on a CUDA machine: its wall time, the steps'
# split into rollout, train and weight sync, and its GPU memory, into $OUT (default
# runs/gpu-default-run): train.log, metrics.jsonl, gpu-mem.csv (nvidia-smi every 0.5 s) and
# summary.json.
#
# The model's GGUF (98 MB) is more than one device call may carry (64 MiB with the working tree),
# so it travels in two halves. Here, once: `bash scripts/gpu-default-run.sh --split` (writes
# .gpu-model/part00 and part01 and the whole file's SHA256; git ignores the folder), and
# `bash scripts/gpu-check.sh --fetch-wheels`. Then two device calls, the second at once after the
# first (a warm machine keeps what a call left in the checkout, and is given back after 30 s idle):
#   1. carry [".whl", ".gpu-model/part00", ".gpu-model/SHA256"], command `bash scripts/gpu-check.sh`
#   2. carry [".whl", ".gpu-model/part01"], command `bash scripts/gpu-default-run.sh`
# This script joins the halves, checks the sum, converts the model as the install does on its first
# use (agentgrpo.models.embedded.convert_gguf), and trains. Extra arguments go to `agentgrpo train` as
# overrides (a local dry run on a CPU: `bash scripts/gpu-default-run.sh train.steps=1`).
set -uo pipefail
cd "$(dirname "$0")/.."
parts=.gpu-model
if [ "${1:-}" = "--split" ]; then
  gguf=$(.venv/bin/python -c "from agentgrpo.models.embedded import gguf_path; print(gguf_path())") || exit 1
  rm -rf "$parts" && mkdir -p "$parts"
  split -n 2 -d "$gguf" "$parts/part"
  sha256sum < "$gguf" | cut -d' ' -f1 > "$parts/SHA256"
  ls -l "$parts"
  exit 0
fi
for f in part00 part01 SHA256; do
  if [ ! -f "$parts/$f" ]; then
    echo "gpu-default-run: $parts/$f is missing: carry part00 and SHA256 in the call before this" \
      "one and part01 in this one, on the same warm machine (see this script's header)" >&2
    exit 2
  fi
done
# shellcheck source=scripts/gpu-env.sh
source scripts/gpu-env.sh gpu-default-run
work=${GPU_RUN_DIR:-/tmp/agentgrpo-gpu-run}
rm -rf "$work" && mkdir -p "$work/gguf"
gguf="$work/gguf/SmolLM2-135M-Instruct.Q4_1.gguf"
cat "$parts/part00" "$parts/part01" > "$gguf"
if [ "$(sha256sum < "$gguf" | cut -d' ' -f1)" != "$(cat "$parts/SHA256")" ]; then
  echo "gpu-default-run: the joined model does not match $parts/SHA256 (halves of two splits?)" >&2
  exit 2
fi
echo "$(date -u +%T) converting the model"
python3 -c "import sys; from pathlib import Path; from agentgrpo.models.embedded import convert_gguf
convert_gguf(Path(sys.argv[1]), Path(sys.argv[2]))" "$gguf" "$work/model" || exit 1
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 > "$OUT/gpu-mem.csv" &
  sampler=$!
fi
echo "$(date -u +%T) training (limit ${RUN_LIMIT_S:=420} s)"
start=$(date +%s.%N)
# The env by module path: the checkout is not pip-installed there, so no entry points name it.
timeout "$RUN_LIMIT_S" python3 -m agentgrpo.cli train examples/calculator.yaml \
  "model.path=$work/model" "output_dir=$work/run" env.name=envs.calculator:CalculatorEnv \
  log.progress=false "$@" 2>&1 | tee "$OUT/train.log"
rc=${PIPESTATUS[0]}
end=$(date +%s.%N)
[ -n "${sampler:-}" ] && kill "$sampler"
cp "$work/run/metrics.jsonl" "$OUT/" 2>/dev/null
python3 - "$work/run/metrics.jsonl" "$OUT/gpu-mem.csv" "$start" "$end" "$rc" <<'PY' | tee "$OUT/summary.json"
import json, statistics, sys
from pathlib import Path
metrics, mem, start, end, rc = sys.argv[1:]
steps = [json.loads(line) for line in Path(metrics).read_text().splitlines()] if Path(metrics).exists() else []
used = [float(x) for x in Path(mem).read_text().split()] if Path(mem).exists() else []
total = lambda key: sum(s.get(key, 0.0) for s in steps)
rewards = [s["reward_mean"] for s in steps]
print(json.dumps({
    "rc": int(rc), "wall_s": float(end) - float(start), "steps": len(steps),
    "steps_s": total("step_s"), "rollout_s": total("phase_s/rollout"),
    "train_s": total("phase_s/train"), "sync_s": total("phase_s/sync"),
    "learner_peak_gb": max((s["mem/peak_gb"] for s in steps if "mem/peak_gb" in s), default=None),
    "gpu_used_max_mib": max(used, default=None),
    "reward_first5": statistics.fmean(rewards[:5]) if rewards else None,
    "reward_last5": statistics.fmean(rewards[-5:]) if rewards else None,
}, indent=1))
PY
exit "$rc"
