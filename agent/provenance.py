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


# The files scanpy's 10x mtx reader opens: Cell Ranger v2 (plain, genes.tsv) or v3+ (gzipped).
MTX_V2 = ("matrix.mtx", "genes.tsv", "barcodes.tsv")
MTX_V3 = ("matrix.mtx.gz", "features.tsv.gz", "barcodes.tsv.gz")


def input_files(path: Path) -> list[Path]:
    """The files the reader uses for an input: the file itself, or a 10x folder's matrix, features
    and barcodes (those present; other files in the folder are not the input)."""
    if not path.is_dir():
        return [path]
    names = MTX_V2 if (path / "genes.tsv").is_file() else MTX_V3
    return [path / n for n in names if (path / n).is_file()]


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
