#!/usr/bin/env bash
# System packages the tests use, for a fresh Debian 12 machine (run as root; idempotent; one apt
# update for all of them). Without one of them the tests that need it skip; nothing else needs them.
#   bubblewrap: the sandbox's `bwrap` fallback backend (unprivileged hosts) and its tests. The
#               `namespaces` backend needs only the kernel and root; its seccomp filters are built
#               in Python (agentgrpo/verify/_seccomp.py).
#   chromium:   loads report.html headless (--dump-dom) in tests/test_report.py to check that its
#               script runs and filters.
set -euo pipefail
declare -A command_of=([bubblewrap]=bwrap [chromium]=chromium)
missing=()
for pkg in bubblewrap chromium; do
  command -v "${command_of[$pkg]}" >/dev/null 2>&1 || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "system-deps: ${missing[*]} missing and not root; the tests that need them will skip" >&2
    exit 0
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
bwrap --version
chromium --version
