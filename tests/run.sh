#!/usr/bin/env bash
# The test command of README.md: sets up what the tests need on a fresh machine, then runs pytest.
# Idempotent: a second run reuses the virtualenv, the Slurm cluster and the browser.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup.sh --test           # virtualenv with the package, vLLM (CPU) and test tools
. .venv/bin/activate
bash tests/slurm/start.sh              # single-node Slurm cluster with accounting (slurmdbd)
bash tests/browser/install.sh          # Debian's chromium for the report test
bash tests/realdata/install.sh         # real count matrices that Debian packages ship
bash tests/deseq2/install.sh           # DESeq2 and limma (R), the condition tests' oracles

ruff check .
snakefmt --check Snakefile workflow  # the Snakefiles' style, configured in pyproject.toml
exec python -m pytest "$@"
