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


def checksum(path: Path) -> str:
    """sha256 of a file, or of a folder's files (relative names and contents, in sorted order)."""
    h = hashlib.sha256()
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for f in files:
        if path.is_dir():
            h.update(str(f.relative_to(path)).encode() + b"\0")
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")
