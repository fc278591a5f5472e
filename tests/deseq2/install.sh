#!/usr/bin/env bash
# Install the R oracles of the cohort's condition tests: Bioconductor's DESeq2 (Debian's
# r-bioc-deseq2, ~50 packages) for tests/test_cohort_de.py and limma (r-bioc-limma) for
# tests/test_cohort_composition.py. R is a test dependency only: the pipeline runs PyDESeq2 and
# its own limma statistics. Idempotent: does nothing when both load. Needs apt-get as root.
set -euo pipefail

if Rscript -e 'suppressMessages({library(DESeq2); library(limma)})' >/dev/null 2>&1; then
  echo "DESeq2 and limma already installed"
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "tests/deseq2/install.sh: must run as root to apt-get install r-bioc-deseq2 r-bioc-limma" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -q >/dev/null
apt-get install -y -q --no-install-recommends r-bioc-deseq2 r-bioc-limma >/dev/null
echo "DESeq2 $(Rscript -e 'cat(format(packageVersion("DESeq2")))')," \
  "limma $(Rscript -e 'cat(format(packageVersion("limma")))')"
