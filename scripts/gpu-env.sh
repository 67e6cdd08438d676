# Sourced by the GPU scripts (scripts/gpu-check.sh, scripts/gpu-default-run.sh) on the device
# machine: $OUT (default runs/$1), offline settings, the carried wheels of .whl/ installed into
# /tmp/site and put on PYTHONPATH, and the GPU and library versions into $OUT/gpu.txt.
OUT=${OUT:-runs/$1}
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} || exit 1
fi
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
fi
python3 -c "import torch, transformers, accelerate; print('torch', torch.__version__, 'transformers',
transformers.__version__, 'accelerate', accelerate.__version__)" | tee -a "$OUT/gpu.txt"
