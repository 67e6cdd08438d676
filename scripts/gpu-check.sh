#!/usr/bin/env bash
# Every GPU check in one go, for a CUDA machine with torch, transformers and accelerate: the learner
# benchmark (bench/learner_gpu.py, ~0.5B Qwen2-shaped model, random weights, nothing downloaded;
# every variant, varlen attention against the 4D mask included; about 4 minutes on an H200 before
# the varlen variants, which add an estimated minute), then the tests marked `gpu`
# (tests/test_gpu.py, varlen's equality with the mask included; about 1.5 minutes before varlen's
# 4). Each part has a time limit, so the whole takes at most ~8 minutes (330 + 150 s and the set-up):
# give the device call a timeout of about 540 s. Logs, the GPU's name and the benchmark's JSON go
# to $OUT (default runs/gpu-check).
#
# A GPU machine without network: fetch the pure-Python packages it lacks as wheels on a machine
# with pip access (`bash scripts/gpu-check.sh --fetch-wheels`, into .whl/, which git ignores) and
# copy .whl/ along; they are installed into /tmp/site before the checks (scripts/gpu-env.sh). The project's H200 machine
# (as its tool library lists it, 2026-11) has torch 2.11, transformers 5.17 (the floor that
# scripts/test-floor.sh runs the suite on) and accelerate 1.15, and lacks only the wheels below.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--fetch-wheels" ]; then  # versions as pinned in this checkout's venv, for Python 3.12
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "${PYVER:-3.12}" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
    gymnasium==1.4.0 farama-notifications==0.0.6 typing-extensions==4.16.0 \
    gguf==0.19.0 starlette==1.10.0 uvicorn==0.55.0 sniffio==1.3.1
  # (pydantic 2.14 needs typing-extensions >= 4.16; gguf, starlette, uvicorn and sniffio: what
  # scripts/gpu-default-run.sh's training run imports beyond the machine's packages)
  exit $?
fi
# shellcheck source=scripts/gpu-env.sh
source scripts/gpu-env.sh gpu-check
# The benchmark first (it is what a short GPU session is for), each part under a time limit so one
# that hangs or compiles for too long leaves the other its share; the benchmark rewrites its JSON
# after each batch shape, so a cut-off run keeps what it measured.
echo "$(date -u +%T) benchmark (limit ${BENCH_LIMIT_S:=330} s)"
timeout "$BENCH_LIMIT_S" python3 bench/learner_gpu.py "$@" 2>&1 | tee "$OUT/learner_gpu.log"
bench=${PIPESTATUS[0]}
echo "$(date -u +%T) gpu tests (limit ${TESTS_LIMIT_S:=150} s)"
timeout "$TESTS_LIMIT_S" python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py 2>&1 | tee "$OUT/gpu-tests.log"
tests=${PIPESTATUS[0]}
# SGLang's live tests (tests/test_vllm_server.py -m sglang: token-exactness, logprobs against the
# learner, a partial rollout across a push, the calculator run with a push and probe per step),
# against AGENTGRPO_SGLANG_URL, or a server started here on AGENTGRPO_SGLANG_MODEL (default: the
# embedded model) where SGLang is installed; about 3 minutes (not timed on a GPU yet).
live=0
if [ -z "${AGENTGRPO_SGLANG_URL:-}" ] && python3 -c "import sglang" 2>/dev/null; then
  model=${AGENTGRPO_SGLANG_MODEL:-$(python3 -c 'from agentgrpo.models import default_model_path as p; print(p())')}
  python3 -m agentgrpo.engine.sglang.launch "$model" --port 30123 --log-file "$OUT/sglang.log" \
    --ready-timeout 300 >"$OUT/sglang-ready.log" 2>&1 &
  sglang_pid=$!
  trap 'kill -TERM $sglang_pid 2>/dev/null; wait $sglang_pid 2>/dev/null' EXIT
  for _ in $(seq 300); do grep -q "ready at" "$OUT/sglang-ready.log" && break; sleep 1; done
  export AGENTGRPO_SGLANG_URL=http://127.0.0.1:30123 AGENTGRPO_SGLANG_MODEL=$model
fi
if [ -n "${AGENTGRPO_SGLANG_URL:-}" ]; then
  echo "$(date -u +%T) SGLang live tests against $AGENTGRPO_SGLANG_URL (limit ${LIVE_LIMIT_S:=240} s)"
  timeout "$LIVE_LIMIT_S" python3 -m pytest -q -p no:cacheprovider -m sglang tests/test_vllm_server.py 2>&1 | tee "$OUT/sglang-live.log"
  live=${PIPESTATUS[0]}
else
  echo "SGLang is not installed here and AGENTGRPO_SGLANG_URL is unset: its live tests did not run"
fi
echo "$(date -u +%T) gpu tests rc=$tests, benchmark rc=$bench, SGLang live rc=$live (124: cut off at its limit)"
[ "$tests" = 0 ] && [ "$bench" = 0 ] && [ "$live" = 0 ]
