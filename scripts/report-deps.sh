#!/usr/bin/env bash
# System package for the report's headless-browser test (tests/test_report.py), for a fresh Debian 12
# machine (run as root; idempotent). Without it that one test skips; the report itself needs nothing.
#   chromium: loads report.html headless (--dump-dom) to check that its script runs and filters.
set -euo pipefail
if ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "report-deps: chromium missing and not root; the headless-browser report test will skip" >&2
    exit 0
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends chromium >/dev/null
fi
chromium --version
