#!/usr/bin/env bash
# Fetch the real count matrices that Debian packages ship, for tests/test_real_data.py, and install
# Bioconductor's DropletUtils (Debian's r-bioc-dropletutils: R and ~70 packages, ~300 MB), the
# oracle of tests/test_cells_dropletutils.py; R is a test dependency only.
# Installing r-cran-seurat would bring R and ~180 packages for one 40 kB text file, so the .deb is
# downloaded and unpacked (no scripts run) under $SCAGENT_REALDATA (default
# /var/cache/scagent-realdata). Idempotent: does nothing when the files are there. Needs apt-get
# (run as root for `apt-get update` on a bare machine). The PyPI sets come with the test extra.
set -euo pipefail

if ! Rscript -e 'library(DropletUtils)' >/dev/null 2>&1; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "tests/realdata/install.sh: must run as root to apt-get install r-bioc-dropletutils" >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >/dev/null
  apt-get install -y -q --no-install-recommends r-bioc-dropletutils >/dev/null
  echo "DropletUtils $(Rscript -e 'cat(format(packageVersion("DropletUtils")))')"
fi

dest="${SCAGENT_REALDATA:-/var/cache/scagent-realdata}"
# package -> the file the tests read from it (its path inside the package)
declare -A wanted=(
  [r-cran-seurat]="usr/lib/R/site-library/Seurat/extdata/pbmc_raw.txt"
)

missing=()
for pkg in "${!wanted[@]}"; do
  [ -s "$dest/$pkg/${wanted[$pkg]}" ] || missing+=("$pkg")
done
if [ "${#missing[@]}" -eq 0 ]; then
  echo "real data already in $dest"
  exit 0
fi

mkdir -p "$dest"
tmp="$(mktemp -d)"
chmod 755 "$tmp"  # apt-get download writes as the _apt user
trap 'rm -rf "$tmp"' EXIT
if [ "$(id -u)" -eq 0 ]; then
  apt-get update -q >/dev/null
fi
for pkg in "${missing[@]}"; do
  (cd "$tmp" && apt-get download -q "$pkg")
  rm -rf "$dest/$pkg"
  dpkg-deb -x "$tmp/${pkg}"_*.deb "$dest/$pkg.partial"
  mv "$dest/$pkg.partial" "$dest/$pkg"  # whole or absent: the check above trusts what is there
  echo "$pkg: $dest/$pkg/${wanted[$pkg]}"
done
