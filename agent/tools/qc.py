"""Quality control: per-cell metrics with data-driven threshold suggestions, and the filters."""

from __future__ import annotations

import math
from typing import Annotated, Any

import numpy as np
import pandas as pd
import scanpy as sc
from pydantic import Field
from scipy.stats import median_abs_deviation

from agent.registry import ToolError, tool
from agent.tools.common import Count, counts_matrix, obs_column, quantiles
from agent.tools.session import Session

Nmads = Annotated[float, Field(ge=1, le=10)]
Percent = Annotated[float, Field(ge=0, le=100)]


def gene_masks(
    names: Any,
    mt_prefix: str = "MT-",
    ribo_prefixes: tuple[str, ...] = ("RPS", "RPL"),
    hb_pattern: str = r"^HB[^(P)]",
) -> dict[str, np.ndarray]:
    """Mitochondrial, ribosomal and haemoglobin genes by symbol (the scanpy tutorial's rules)."""
    names = pd.Index(names).astype(str)
    return {
        "mt": np.asarray(names.str.startswith(mt_prefix)),
        "ribo": np.asarray(names.str.startswith(tuple(ribo_prefixes))),
        "hb": np.asarray(names.str.contains(hb_pattern, regex=True)),
    }


def _mad_bounds(values: np.ndarray, nmads: float) -> tuple[float, float]:
    """median -/+ nmads * MAD (unscaled, as in the single-cell best-practices book)."""
    median = float(np.median(values))
    mad = float(median_abs_deviation(values))
    return median - nmads * mad, median + nmads * mad


@tool("qc")
def qc_metrics(
    session: Session,
    mt_prefix: str = "MT-",
    ribo_prefixes: tuple[str, ...] = ("RPS", "RPL"),
    hb_pattern: str = r"^HB[^(P)]",
    nmads: Nmads = 5.0,
    nmads_mt: Nmads = 3.0,
) -> dict[str, Any]:
    """Compute per-cell QC metrics and suggest filter thresholds from their distributions.

    Runs scanpy's calculate_qc_metrics with mitochondrial, ribosomal and haemoglobin gene sets and
    returns quantiles of genes per cell, counts per cell and percent mitochondrial counts, and
    outlier thresholds at median +/- nmads MADs (log scale for genes and counts; percent
    mitochondrial above median + nmads_mt MADs) with how many cells each would remove.

    Args:
        mt_prefix: Prefix of mitochondrial gene symbols ('mt-' for mouse).
        ribo_prefixes: Prefixes of ribosomal protein genes.
        hb_pattern: Regular expression for haemoglobin genes.
        nmads: MADs from the median (log scale) beyond which genes/counts per cell are outliers.
        nmads_mt: MADs above the median beyond which percent mitochondrial counts is an outlier.
    """
    adata = session.adata
    masks = gene_masks(adata.var_names, mt_prefix, ribo_prefixes, hb_pattern)
    for name, mask in masks.items():
        adata.var[name] = mask
    layer = "counts" if "counts" in adata.layers else None
    sc.pp.calculate_qc_metrics(
        adata, qc_vars=["mt", "ribo", "hb"], percent_top=None, log1p=True, inplace=True, layer=layer
    )
    obs = adata.obs
    low_genes, high_genes = _mad_bounds(obs["log1p_n_genes_by_counts"].to_numpy(), nmads)
    low_counts, high_counts = _mad_bounds(obs["log1p_total_counts"].to_numpy(), nmads)
    _, high_mt = _mad_bounds(obs["pct_counts_mt"].to_numpy(), nmads_mt)
    suggested = {
        "min_genes": max(0, math.floor(math.expm1(low_genes))),
        "max_genes": math.ceil(math.expm1(high_genes)),
        "min_counts": max(0, math.floor(math.expm1(low_counts))),
        "max_counts": math.ceil(math.expm1(high_counts)),
        "max_pct_mt": round(min(100.0, high_mt), 2),
    }
    genes, counts, mt = obs["n_genes_by_counts"], obs["total_counts"], obs["pct_counts_mt"]
    flagged = {
        "min_genes": genes < suggested["min_genes"],
        "max_genes": genes > suggested["max_genes"],
        "min_counts": counts < suggested["min_counts"],
        "max_counts": counts > suggested["max_counts"],
        "max_pct_mt": mt > suggested["max_pct_mt"],
    }
    return {
        "n_cells": adata.n_obs,
        "gene_sets": {name: int(mask.sum()) for name, mask in masks.items()},
        "genes_per_cell": quantiles(genes, 0),
        "counts_per_cell": quantiles(counts, 0),
        "pct_counts_mt": quantiles(mt),
        "median_pct_counts_ribo": round(float(obs["pct_counts_ribo"].median()), 2),
        "median_pct_counts_hb": round(float(obs["pct_counts_hb"].median()), 3),
        "suggested_thresholds": suggested,
        "cells_outside_each": {k: int(v.sum()) for k, v in flagged.items()},
        "cells_outside_any": int(np.logical_or.reduce(list(flagged.values())).sum()),
        "method": f"median +/- {nmads} MAD of log1p genes and counts; pct_counts_mt > median + {nmads_mt} MAD",
    }


def _check_range(tool: str, low: float | None, high: float | None, what: str) -> None:
    if low is not None and high is not None and low > high:
        raise ToolError(f"{tool}: min_{what}={low} is above max_{what}={high}")


def _apply_cell_mask(
    session: Session, tool: str, keep: np.ndarray, removed_by: dict[str, int]
) -> dict[str, Any]:
    adata = session.adata
    if not keep.any():
        raise ToolError(
            f"{tool}: these thresholds would remove all {adata.n_obs} cells "
            f"(removed by each: {removed_by}); nothing was changed"
        )
    before = adata.n_obs
    session.adata = adata[keep].copy()
    return {
        "cells_before": before,
        "cells_after": int(keep.sum()),
        "removed": before - int(keep.sum()),
        "removed_by": removed_by,
    }


@tool("cell_filter")
def filter_cells(
    session: Session,
    min_genes: Count | None = None,
    max_genes: Count | None = None,
    min_counts: Count | None = None,
    max_counts: Count | None = None,
) -> dict[str, Any]:
    """Remove cells (barcodes) with too few or too many detected genes or counts.

    Uses scanpy's filter_cells on the raw counts; give at least one threshold. Typical first
    step: min_genes=200 removes empty droplets.

    Args:
        min_genes: Keep cells with at least this many detected genes.
        max_genes: Keep cells with at most this many detected genes.
        min_counts: Keep cells with at least this many counts.
        max_counts: Keep cells with at most this many counts.
    """
    given = {
        "min_genes": min_genes,
        "max_genes": max_genes,
        "min_counts": min_counts,
        "max_counts": max_counts,
    }
    given = {k: v for k, v in given.items() if v is not None}
    if not given:
        raise ToolError(
            "filter_cells: give at least one of min_genes, max_genes, min_counts, max_counts"
        )
    _check_range("filter_cells", min_genes, max_genes, "genes")
    _check_range("filter_cells", min_counts, max_counts, "counts")
    adata = session.adata
    counts = sc.AnnData(counts_matrix(adata))  # scanpy's filter logic on the raw counts
    keep = np.ones(adata.n_obs, bool)
    removed_by = {}
    for name, value in given.items():
        mask, _ = sc.pp.filter_cells(counts, **{name: value}, inplace=False)
        removed_by[name] = int((~mask).sum())
        keep &= mask
    return _apply_cell_mask(session, "filter_cells", keep, removed_by) | {"thresholds": given}


@tool("gene_filter")
def filter_genes(
    session: Session,
    min_cells: Count | None = 3,
    max_cells: Count | None = None,
    min_counts: Count | None = None,
) -> dict[str, Any]:
    """Remove genes detected in too few (or too many) cells, or with too few counts.

    Args:
        min_cells: Keep genes detected in at least this many cells.
        max_cells: Keep genes detected in at most this many cells.
        min_counts: Keep genes with at least this many counts in total.
    """
    given = {"min_cells": min_cells, "max_cells": max_cells, "min_counts": min_counts}
    given = {k: v for k, v in given.items() if v is not None}
    if not given:
        raise ToolError("filter_genes: give at least one of min_cells, max_cells, min_counts")
    _check_range("filter_genes", min_cells, max_cells, "cells")
    adata = session.adata
    counts = sc.AnnData(counts_matrix(adata))
    keep = np.ones(adata.n_vars, bool)
    removed_by = {}
    for name, value in given.items():
        mask, _ = sc.pp.filter_genes(counts, **{name: value}, inplace=False)
        removed_by[name] = int((~mask).sum())
        keep &= mask
    if not keep.any():
        raise ToolError(
            f"filter_genes: these thresholds would remove all {adata.n_vars} genes (removed by each: {removed_by}); nothing was changed"
        )
    before = adata.n_vars
    session.adata = adata[:, keep].copy()
    return {
        "genes_before": before,
        "genes_after": int(keep.sum()),
        "removed": before - int(keep.sum()),
        "removed_by": removed_by,
        "thresholds": given,
    }


@tool("cell_filter", needs=("qc_metrics",))
def filter_by_qc(
    session: Session,
    min_genes: Count | None = None,
    max_genes: Count | None = None,
    min_counts: Count | None = None,
    max_counts: Count | None = None,
    max_pct_mt: Percent | None = None,
) -> dict[str, Any]:
    """Remove low-quality cells by the QC metrics: genes, counts and percent mitochondrial.

    Needs qc_metrics first; its suggested_thresholds are a data-driven starting point.

    Args:
        min_genes: Keep cells with at least this many detected genes.
        max_genes: Keep cells with at most this many detected genes (high: likely doublets).
        min_counts: Keep cells with at least this many counts.
        max_counts: Keep cells with at most this many counts.
        max_pct_mt: Keep cells with at most this percent of counts from mitochondrial genes
            (high: damaged cells).
    """
    given = {"min_genes": min_genes, "max_genes": max_genes, "min_counts": min_counts,
             "max_counts": max_counts, "max_pct_mt": max_pct_mt}  # fmt: skip
    given = {k: v for k, v in given.items() if v is not None}
    if not given:
        raise ToolError("filter_by_qc: give at least one threshold")
    _check_range("filter_by_qc", min_genes, max_genes, "genes")
    _check_range("filter_by_qc", min_counts, max_counts, "counts")
    adata = session.adata
    hint = "call qc_metrics first"
    genes = obs_column(adata, "n_genes_by_counts", "filter_by_qc", hint).to_numpy()
    counts = obs_column(adata, "total_counts", "filter_by_qc", hint).to_numpy()
    mt = obs_column(adata, "pct_counts_mt", "filter_by_qc", hint).to_numpy()
    tests = {
        "min_genes": lambda v: genes >= v, "max_genes": lambda v: genes <= v,
        "min_counts": lambda v: counts >= v, "max_counts": lambda v: counts <= v,
        "max_pct_mt": lambda v: mt <= v,
    }  # fmt: skip
    keep = np.ones(adata.n_obs, bool)
    removed_by = {}
    for name, value in given.items():
        mask = tests[name](value)
        removed_by[name] = int((~mask).sum())
        keep &= mask
    return _apply_cell_mask(session, "filter_by_qc", keep, removed_by) | {"thresholds": given}
