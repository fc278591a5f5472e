#!/usr/bin/env bash
# Install Debian's chromium for the headless-browser test of the cohort report. Idempotent:
# does nothing when a chromium binary is already on PATH. Needs root (CI runs as root).
set -euo pipefail

if command -v chromium >/dev/null 2>&1; then
  echo "chromium already installed: $(chromium --version 2>/dev/null || echo unknown version)"
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "tests/browser/install.sh: must run as root to apt-get install chromium" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
# fonts-dejavu-core: readable text in screenshots on a bare machine
apt-get install -y -q --no-install-recommends chromium fonts-dejavu-core
chromium --version
