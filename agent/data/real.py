"""Real single-cell count matrices that installed packages ship, as run inputs.

Nothing is downloaded and no data live in the repository: each set is read from the package that
ships it (scanpy and CellTypist from PyPI; Seurat's from Debian's r-cran-seurat, which
tests/realdata/install.sh unpacks), converted to an .h5ad of raw counts (barcodes and genes only,
so an analysis cannot see the labels), with a truth.tsv of the published labels beside it where
the set has them. The tests (tests/fixtures_realdata.py) and `agent eval` read them here.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd
from scipy import sparse

from agent.data.synthetic import truth_path

# where tests/realdata/install.sh unpacks Debian packages (one folder each)
REALDATA_DIR = Path(os.environ.get("SCAGENT_REALDATA", "/var/cache/scagent-realdata"))


@dataclass(frozen=True)
class RealSet:
    """One shipped set: where it lies and how it becomes cells x genes of raw counts."""

    name: str
    species: str
    package: str  # PyPI module or Debian package that ships it
    file: str  # the file's path inside that package
    read: Callable[[Path], tuple[ad.AnnData, pd.Series | None]]  # counts, published labels


def _counts_from_lognorm(path: Path) -> tuple[ad.AnnData, pd.Series]:
    """scanpy's pbmc68k_reduced: its .raw is log1p of depth-normalised counts of 765 genes.

    Within a cell every count is a multiple of the normalised value of a single count, taken as
    the cell's smallest non-zero value; rounding then recovers integer counts. The residual is
    checked, so a changed file fails here instead of feeding the analysis made-up counts.
    """
    shipped = ad.read_h5ad(path)
    values = np.expm1(np.asarray(shipped.raw.X.todense(), dtype=np.float64))
    one_count = np.where(values > 0, values, np.inf).min(axis=1, keepdims=True)
    scaled = values / one_count
    counts = np.rint(scaled)
    residual = float(np.abs(scaled - counts).max())
    if residual >= 0.25:
        raise ValueError(f"{path}: .raw is not a scaled count matrix (residual {residual:.3f})")
    adata = ad.AnnData(sparse.csr_matrix(counts, dtype=np.float32))
    adata.obs_names, adata.var_names = shipped.obs_names, shipped.raw.var_names
    return adata, shipped.obs["bulk_labels"].astype(str)


def _counts_from_table(sep: str, genes_in_rows: bool) -> Callable[[Path], tuple[ad.AnnData, None]]:
    def read(path: Path) -> tuple[ad.AnnData, None]:
        table = pd.read_csv(path, sep=sep, index_col=0)
        table = table.T if genes_in_rows else table
        adata = ad.AnnData(sparse.csr_matrix(table.to_numpy(dtype=np.float32)))
        adata.obs_names, adata.var_names = table.index.astype(str), table.columns.astype(str)
        return adata, None

    return read


REAL_SETS = {
    s.name: s
    for s in (
        # Zheng et al. 2017 PBMCs, 700 cells, labels from sorted bulk profiles (scanpy's wheel)
        RealSet("pbmc68k_reduced", "human", "scanpy", "datasets/10x_pbmc68k_reduced.h5ad",
                _counts_from_lognorm),
        # Seurat's pbmc_small: 80 shallow PBMCs x 230 genes, UMI counts (Debian r-cran-seurat)
        RealSet("pbmc_small", "human", "r-cran-seurat",
                "usr/lib/R/site-library/Seurat/extdata/pbmc_raw.txt",
                _counts_from_table("\t", genes_in_rows=True)),
        # CellTypist's sample: 559 cells x 32,786 genes (the whole 10x gene list), UMI counts
        RealSet("celltypist_sample", "human", "celltypist", "data/samples/sample_cell_by_gene.csv",
                _counts_from_table(",", genes_in_rows=False)),
    )
}  # fmt: skip

# pbmc68k_reduced's published (FACS-sorted bulk) labels -> the labels of ours that agree
PUBLISHED_TYPES = {
    "CD14+ Monocyte": {"CD14 Mono", "FCGR3A Mono"},  # the CD14+ sort holds CD16+ monocytes too
    "CD19+ B": {"B", "Plasma"},  # and the CD19+ sort plasmablasts
    "CD34+": {"HSPC"},
    "CD56+ NK": {"NK"},
    "Dendritic": {"DC", "pDC", "Mature DC"},
    "CD4+/CD25 T Reg": {"Treg"},
    "CD4+/CD45RA+/CD25- Naive T": {"CD4 naive T"},
    "CD4+/CD45RO+ Memory": {"CD4 memory T"},
    "CD8+ Cytotoxic T": {"CD8 effector-memory T"},
    "CD8+/CD45RA+ Naive Cytotoxic": {"CD8 naive T"},
}


def shipped_file(real: RealSet) -> Path | None:
    """The set's file in its installed package (a Python module, else a Debian package installed
    or unpacked by tests/realdata/install.sh), or None where it is not installed."""
    spec = importlib.util.find_spec(real.package) if real.package.isidentifier() else None
    if spec is not None and spec.submodule_search_locations:
        candidates = [Path(loc) / real.file for loc in spec.submodule_search_locations]
    else:
        candidates = [Path("/") / real.file, REALDATA_DIR / real.package / real.file]
    return next((p for p in candidates if p.is_file()), None)


def write_truth(labels: pd.Series, path: Path) -> None:
    """truth.tsv (agent/record/truth.py's columns): published labels; no planted defects."""
    truth = pd.DataFrame({"barcode": labels.index, "cell_type": labels.to_numpy()})
    for flag in ("is_doublet", "is_damaged", "is_empty"):
        truth[flag] = False
    truth.to_csv(path, sep="\t", index=False)


def write_real(real: RealSet, folder: Path) -> Path | None:
    """The set as ``folder/NAME.h5ad`` of raw counts (truth.tsv beside it where it has published
    labels); None where its package is not installed."""
    source = shipped_file(real)
    if source is None:
        return None
    adata, labels = real.read(source)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{real.name}.h5ad"
    adata.write_h5ad(path)
    if labels is not None:
        write_truth(labels, truth_path(path))
    return path


def per_type_agreement(labels: pd.Series, published: pd.Series) -> dict[str, float]:
    """Per published type, the share of its cells whose label agrees (PUBLISHED_TYPES)."""
    labels, published = labels.astype(str), published.loc[labels.index].astype(str)
    return {
        kind: round(float(labels[published == kind].isin(PUBLISHED_TYPES[kind]).mean()), 3)
        for kind in sorted(set(published) & set(PUBLISHED_TYPES))
    }
