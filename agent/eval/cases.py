"""The samples an evaluation asks about: built at run time from data that packages ship.

Synthetic samples with planted truth (a PBMC-like sample, a tiny one of 80 cells, the same kind in
mouse gene symbols), real PBMCs with published labels (scanpy's pbmc68k_reduced), CellTypist's
sample, Seurat's pbmc_small (where Debian's package is unpacked), and an unfiltered droplet matrix
made from pbmc68k_reduced's real cells among empty droplets of their own ambient RNA. A case
whose package is missing is left out, and the evaluation says so.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import anndata as ad

from agent.data.real import REAL_SETS, write_real
from agent.data.synthetic import SampleSpec, truth_path, write_sample


@dataclass(frozen=True)
class Case:
    name: str
    description: str
    build: Callable[[Path], Path | None]  # folder -> the input (None: its package is missing)
    labels: str | None  # "planted", "published" or None: what truth.tsv beside the input holds


def _synthetic(spec: SampleSpec) -> Callable[[Path], Path]:
    return lambda folder: write_sample(spec, folder)


def _mouse_symbol(gene: str) -> str:
    return "mt-" + gene[3:].capitalize() if gene.startswith("MT-") else gene.capitalize()


def _mouse(spec: SampleSpec) -> Callable[[Path], Path]:
    """The synthetic sample in mouse gene symbols (Cd3e, mt-Co1): species, QC patterns and the
    mouse marker sets follow the symbols."""

    def build(folder: Path) -> Path:
        path = write_sample(spec, folder)
        adata = ad.read_h5ad(path)
        adata.var_names = [_mouse_symbol(g) for g in adata.var_names]
        adata.write_h5ad(path)
        return path

    return build


def _real(name: str) -> Callable[[Path], Path | None]:
    return lambda folder: write_real(REAL_SETS[name], folder)


def _droplets(folder: Path) -> Path | None:
    """pbmc68k_reduced's 700 real cells among 20,000 empty droplets of their ambient RNA."""
    from agent.testing.droplets import Droplets, unfiltered

    cells = write_real(REAL_SETS["pbmc68k_reduced"], folder / "cells")
    if cells is None:
        return None
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "droplets_pbmc68k.h5ad"
    unfiltered(ad.read_h5ad(cells), Droplets(20_000, (1, 100), seed=3)).write_h5ad(path)
    return path


CASES: dict[str, Case] = {
    c.name: c
    for c in (
        Case("synthetic_pbmc", "synthetic PBMCs, 1,500 cells, damaged cells and doublets planted",
             _synthetic(SampleSpec("synthetic_pbmc", 1500, seed=11, format="h5ad",
                                   damaged_fraction=0.12)), "planted"),
        Case("synthetic_tiny", "synthetic PBMCs, 80 cells: too few for doublet calling",
             _synthetic(SampleSpec("synthetic_tiny", 80, seed=12, format="h5ad")), "planted"),
        Case("synthetic_mouse", "synthetic PBMCs in mouse gene symbols, 1,000 cells",
             _mouse(SampleSpec("synthetic_mouse", 1000, seed=13, format="h5ad")), "planted"),
        Case("pbmc68k_reduced", "scanpy's 700 real PBMCs with published sorted labels",
             _real("pbmc68k_reduced"), "published"),
        Case("celltypist_sample", "CellTypist's 559 real immune cells, 32,786 genes",
             _real("celltypist_sample"), None),
        Case("pbmc_small", "Seurat's 80 shallow real PBMCs, 230 genes",
             _real("pbmc_small"), None),
        Case("droplets_pbmc68k", "unfiltered: pbmc68k_reduced's cells among 20,000 empty droplets",
             _droplets, None),
    )
}  # fmt: skip


def build(name: str, folder: Path) -> Path | None:
    """Case ``name``'s input, built into ``folder`` (reused when already there)."""
    case = CASES[name]
    done = folder / ".built"
    if done.is_file():
        return Path(done.read_text())
    path = case.build(folder)
    if path is not None:
        done.write_text(str(path))
    return path


def truth(path: Path) -> Path | None:
    """The truth table beside a case's input, where it has one."""
    found = truth_path(path)
    return found if found.is_file() else None
