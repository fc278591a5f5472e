"""Unfiltered droplet matrices made from real cells, and DropletUtils run on them as the oracle.

For the cell-calling tests and the DropletUtils agreement benchmark
(bench/call_cells_dropletutils.py): a raw 10x matrix cannot be shipped, so one is built from the
real cells a package ships. The cells keep their own counts (binomially thinned for a shallower
sample); empty droplets hold ambient RNA only, drawn from the pooled counts of those same cells
(the RNA that lysed cells leave in the solution), as many UMIs per droplet as ``empty_umis``
allows: multinomial draws, or with ``empty_alpha`` Dirichlet-multinomial ones (each droplet its
own profile around the pooled one, the overdispersion EmptyDrops estimates; under a multinomial
its estimate sits at DropletUtils' bound of 10,000); a ``soup`` share of ambient UMIs added to
each cell models its contamination. Barcodes are named ``CELL<original barcode>`` and
``EMPTY<i>``, so a caller can score what was kept.

``dropletutils`` runs Bioconductor's DropletUtils (``barcodeRanks``, ``emptyDrops``) through
Rscript on such a matrix with a fixed seed, raising ``niters`` tenfold (the last step to
``max_niters``) while barcodes at the Monte-Carlo floor are not significant, as its documentation
advises. R is a test dependency only (tests/realdata/install.sh installs Debian's
r-bioc-dropletutils).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anndata as ad
import numpy as np
import pandas as pd
from scipy import io, sparse

CELL, EMPTY = "CELL", "EMPTY"


@dataclass(frozen=True)
class Droplets:
    """How an unfiltered matrix is made from real cells."""

    n_empty: int = 20_000
    empty_umis: tuple[int, int] = (1, 100)  # each empty droplet's UMIs, uniform in this range
    depth: float = 1.0  # share of each cell's UMIs kept (binomial thinning)
    soup: float = 0.0  # ambient UMIs added to each cell, as a share of its own
    seed: int = 0
    empty_alpha: float | None = None  # the empties' Dirichlet scale; None: multinomial empties


def draw_umis(
    rng: np.random.Generator, totals: np.ndarray, weights: np.ndarray
) -> sparse.csr_matrix:
    """Rows of ``totals`` UMIs, each UMI a column drawn from ``weights``, as a sparse matrix (a
    dense one of 50,000 barcodes x 30,000 genes would not fit in memory)."""
    cumulative = np.cumsum(weights) / np.sum(weights)
    genes = np.searchsorted(cumulative, rng.random(int(totals.sum())), side="right")
    return _rows(genes, totals, len(weights))


def draw_overdispersed_umis(
    rng: np.random.Generator, totals: np.ndarray, weights: np.ndarray, alpha: float
) -> sparse.csr_matrix:
    """Rows of ``totals`` UMIs, each row's UMIs drawn from its own profile ~ Dirichlet(alpha *
    weights / sum): by Polya's urn, UMI k+1 of a row is new from ``weights`` with probability
    alpha / (alpha + k), else a copy of one of the row's k before it. Vectorised over rows, one
    step per UMI position, so rows of a few hundred UMIs cost no Gamma draw per gene."""
    cumulative = np.cumsum(weights) / np.sum(weights)
    n, longest = len(totals), int(totals.max())
    genes = np.zeros((n, longest), np.int64)
    for k in range(longest):
        new = np.searchsorted(cumulative, rng.random(n), side="right")
        earlier = genes[np.arange(n), (rng.random(n) * k).astype(np.int64)]
        genes[:, k] = np.where(rng.random(n) * (alpha + k) < alpha, new, earlier)
    return _rows(genes[np.arange(longest) < totals[:, None]], totals, len(weights))


def _rows(genes: np.ndarray, totals: np.ndarray, n_genes: int) -> sparse.csr_matrix:
    """The UMIs' ``genes``, row after row (``totals`` each), as a barcodes x genes count matrix."""
    rows = np.repeat(np.arange(len(totals)), totals)
    columns = np.minimum(genes, n_genes - 1)  # a draw of exactly 1.0 past the last cumulative
    drawn = sparse.csr_matrix((np.ones(len(genes), np.float32), (rows, columns)),
                              shape=(len(totals), n_genes))  # fmt: skip
    drawn.sum_duplicates()
    return drawn


def unfiltered(cells: ad.AnnData, how: Droplets = Droplets()) -> ad.AnnData:
    """``cells`` (integer counts, barcodes x genes) among empty droplets of their own ambient
    RNA, made as ``how`` says; cells first, then the empties."""
    rng = np.random.default_rng(how.seed)
    counts = sparse.csr_matrix(cells.X, dtype=np.float32, copy=True)
    if how.depth < 1:
        counts.data = rng.binomial(counts.data.astype(np.int64), how.depth).astype(np.float32)
        counts.eliminate_zeros()
    ambient = np.asarray(counts.sum(axis=0)).ravel()
    if how.soup > 0:
        depths = np.asarray(counts.sum(axis=1)).ravel()
        counts = counts + draw_umis(rng, rng.poisson(how.soup * depths), ambient)
    low, high = how.empty_umis
    sizes = rng.integers(low, high + 1, how.n_empty)
    empties = (
        draw_umis(rng, sizes, ambient)
        if how.empty_alpha is None
        else draw_overdispersed_umis(rng, sizes, ambient, how.empty_alpha)
    )
    adata = ad.AnnData(sparse.vstack([counts, empties]).tocsr())
    adata.var_names = cells.var_names
    adata.obs_names = [CELL + str(n) for n in cells.obs_names] + [
        f"{EMPTY}{i}" for i in range(how.n_empty)
    ]
    return adata


def panel(cells: ad.AnnData, genes: int) -> ad.AnnData:
    """The cells' ``genes`` most-counted genes only, as a targeted panel measures."""
    top = np.argsort(-np.asarray(cells.X.sum(axis=0)).ravel(), kind="stable")[:genes]
    return cells[:, np.sort(top)].copy()


@dataclass(frozen=True)
class Case:
    """One oracle matrix: which shipped real set's cells, how many of its genes, which droplets."""

    real_set: str  # a name in agent/data/real.py REAL_SETS
    droplets: Droplets
    genes: int | None = None  # a targeted panel of the most-counted genes; None: all

    def build(self, cells: ad.AnnData) -> ad.AnnData:
        return unfiltered(cells if self.genes is None else panel(cells, self.genes), self.droplets)


# The matrices the tests compare with DropletUtils (tests/test_cells_dropletutils.py): every
# shipped set, full and thinned depth, a 2,000-gene panel, 3,000-40,000 empties. In five of the
# six some empties hold more than the ambient bound of 100 UMIs (over 1,000 of them in four), so
# EmptyDrops tests them and the 1% bound on empties kept can fail; in four they are overdispersed (Dirichlet scale 200-2,000),
# so alpha's fit is compared off its bound. Only the heavy load (5-300 UMIs, issue 37's kind,
# on a panel at half depth) puts so many empties above the bound that the iterations must grow
# to 100,000: about a minute of DropletUtils on two cores, the others a quarter of that.
ORACLE_CASES = {
    "pbmc68k": Case("pbmc68k_reduced", Droplets(20_000, (1, 120))),
    "pbmc68k_thinned": Case("pbmc68k_reduced", Droplets(40_000, (1, 110), depth=0.6, soup=0.05,
                                                        seed=2, empty_alpha=2_000)),
    "pbmc_small": Case("pbmc_small", Droplets(3_000, (1, 30), seed=4, empty_alpha=200)),
    "celltypist_panel": Case("celltypist_sample", Droplets(10_000, (1, 120), depth=0.5, seed=6,
                                                           empty_alpha=1_000), genes=2_000),
    "celltypist_shallow": Case("celltypist_sample",
                               Droplets(10_000, (1, 100), depth=0.25, seed=7, empty_alpha=500)),
    "celltypist_panel_heavy_ambient": Case("celltypist_sample",
                                           Droplets(20_000, (5, 300), depth=0.5, seed=6),
                                           genes=2_000),
}  # fmt: skip
# Issue 37's matrix: CellTypist's 559 cells among 20,000 empties of 5-300 UMIs. DropletUtils needs
# 110,000 iterations on all 32,786 genes, about three minutes: the benchmark runs it.
HEAVY_CASES = {
    "celltypist_heavy_ambient": Case("celltypist_sample", Droplets(20_000, (5, 300))),
}


def is_cell(names: Any) -> np.ndarray:
    """Whether each barcode name is one of the real cells ``unfiltered`` planted."""
    return pd.Index(names).str.startswith(CELL)


# The oracle: DropletUtils' own calls, on each folder's matrix.mtx (MatrixMarket, genes x
# barcodes), in one R process (loading DropletUtils takes seconds).
ORACLE_R = r"""
suppressPackageStartupMessages({library(Matrix); library(DropletUtils); library(BiocParallel)})
args <- commandArgs(trailingOnly=TRUE)
seed <- as.integer(args[1]); fdr <- as.numeric(args[2])
start.niters <- as.integer(args[3]); max.niters <- as.integer(args[4])
workers <- as.integer(args[5])
bp <- if (workers > 1) MulticoreParam(workers) else SerialParam()
for (folder in args[-(1:5)]) {
    m <- as(readMM(file.path(folder, "matrix.mtx")), "CsparseMatrix")
    started <- Sys.time()
    ranks <- barcodeRanks(m)
    niters <- start.niters
    repeat {
        set.seed(seed)
        out <- emptyDrops(m, niters=niters, BPPARAM=bp)
        stuck <- sum(out$Limited & out$FDR > fdr, na.rm=TRUE)
        if (stuck == 0 || niters >= max.niters) break
        niters <- min(niters * 10, max.niters)
    }
    seconds <- as.numeric(difftime(Sys.time(), started, units="secs"))
    write.csv(data.frame(total=out$Total, pvalue=out$PValue, fdr=out$FDR, limited=out$Limited),
              file.path(folder, "calls.csv"), row.names=FALSE)
    write.csv(data.frame(ambient=ambientProfileEmpty(m)), file.path(folder, "ambient.csv"),
              row.names=FALSE)
    meta <- metadata(out)
    cat(sprintf('{"knee": %.17g, "inflection": %.17g, "alpha": %.17g, "niters": %d,
        "retain": %.17g, "limited_not_significant": %d, "seconds": %.3f, "version": "%s"}',
        metadata(ranks)$knee, metadata(ranks)$inflection, meta$alpha, meta$niters, meta$retain,
        stuck, seconds, as.character(packageVersion("DropletUtils"))),
        file=file.path(folder, "meta.json"))
}
"""


def rscript() -> str | None:
    """Rscript's path where R and DropletUtils are installed, else None."""
    found = shutil.which("Rscript")
    if found is None:
        return None
    probe = subprocess.run([found, "-e", "library(DropletUtils)"], capture_output=True)
    return found if probe.returncode == 0 else None


def dropletutils(
    matrices: dict[str, ad.AnnData],
    seed: int = 0,
    fdr: float = 0.001,
    niters: int = 10_000,
    max_niters: int = 1_000_000,
    workers: int = 1,
) -> dict[str, dict[str, Any]]:
    """DropletUtils' barcodeRanks and emptyDrops (defaults: lower 100, retain at the knee) on
    each matrix's counts: its knee, inflection, alpha, the iterations it needed, its seconds
    (all rounds), the ambient profile (ambientProfileEmpty, per gene), and per barcode the
    p-value, FDR and whether it was called (FDR <= ``fdr``). ``workers`` > 1 splits the
    iterations over that many forked processes (BiocParallel's MulticoreParam): the same
    method, another random stream."""
    with tempfile.TemporaryDirectory() as tmp:
        folders = {name: Path(tmp) / str(i) for i, name in enumerate(matrices)}
        for name, folder in folders.items():
            folder.mkdir()
            counts = sparse.csr_matrix(matrices[name].X).T.astype(np.int64)
            io.mmwrite(folder / "matrix.mtx", counts)
        script = Path(tmp) / "oracle.R"
        script.write_text(ORACLE_R)
        command = [rscript() or "Rscript", str(script), str(seed), repr(fdr), str(niters),
                   str(max_niters), str(workers), *map(str, folders.values())]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"DropletUtils failed ({done.returncode}): {done.stderr[-2000:]}")
        found = {}
        for name, folder in folders.items():
            calls = pd.read_csv(folder / "calls.csv")
            calls.index = matrices[name].obs_names
            calls["cell"] = calls["fdr"].fillna(1.0) <= fdr
            ambient = pd.read_csv(folder / "ambient.csv")["ambient"].to_numpy()
            meta = json.loads((folder / "meta.json").read_text())
            found[name] = meta | {"calls": calls, "ambient": ambient}
    return found
