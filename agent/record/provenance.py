"""What a record says about where it came from: package versions, input checksums, timestamps."""

from __future__ import annotations

import hashlib
import platform
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path

PACKAGES = (
    "scagent",
    "scanpy",
    "anndata",
    "numpy",
    "scipy",
    "pandas",
    "scikit-learn",
    "umap-learn",
    "igraph",
    "leidenalg",
    "openai",
    "orjson",
    "pydantic",
)


def versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


# The files of a 10x mtx folder by role, each the first of its names present, in the order their
# checksums are combined: Cell Ranger v3+ writes them gzipped with features.tsv.gz, v2 plain with
# genes.tsv; GEO often serves v2 gzipped, and unpacked v3 folders are plain.
MTX_FILES = {
    "matrix": ("matrix.mtx.gz", "matrix.mtx"),
    "features": ("features.tsv.gz", "features.tsv", "genes.tsv.gz", "genes.tsv"),
    "barcodes": ("barcodes.tsv.gz", "barcodes.tsv"),
}


def mtx_files(folder: Path) -> dict[str, Path]:
    """A 10x folder's matrix, features and barcodes files, by role (those present)."""
    found = {}
    for role, names in MTX_FILES.items():
        file = next((folder / n for n in names if (folder / n).is_file()), None)
        if file is not None:
            found[role] = file
    return found


def input_files(path: Path) -> list[Path]:
    """The files the reader uses for an input: the file itself, or a 10x folder's matrix, features
    and barcodes (those present; other files in the folder are not the input)."""
    return list(mtx_files(path).values()) if path.is_dir() else [path]


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def input_checksums(path: Path) -> dict[str, str]:
    """sha256 of each file the reader uses, by its name (content, not location: the same bytes in
    a moved folder have the same checksums)."""
    return {f.name: file_sha256(f) for f in input_files(path)}


def checksum(path: Path, sums: dict[str, str] | None = None) -> str:
    """One sha256 for an input: of the file's bytes, or of a 10x folder's used files (each name
    and its sha256, in order). ``sums``: its input_checksums, when already computed."""
    sums = input_checksums(path) if sums is None else sums
    if not path.is_dir():
        return sums[path.name]
    return hashlib.sha256("".join(f"{n}\0{h}\n" for n, h in sums.items()).encode()).hexdigest()


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")
