#!/usr/bin/env bash
# System packages the sandbox uses, for a fresh Debian 12 machine (run as root; idempotent).
#   bubblewrap: the `bwrap` fallback backend (unprivileged hosts) and its tests.
# The `namespaces` backend needs nothing beyond the kernel and root; seccomp filters are built in
# Python (agentgrpo/verify/_seccomp.py), so no libseccomp bindings are required.
set -euo pipefail
if ! command -v bwrap >/dev/null 2>&1; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "sandbox-deps: bubblewrap missing and not root; the bwrap backend tests will skip" >&2
    exit 0
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends bubblewrap >/dev/null
fi
bwrap --version
