"""From counts to log-normalised values: normalise, flag variable genes, regress, set scaling.

X keeps the log-normalised values of every gene that passed filtering (what markers, annotation,
plots and whoever reuses the saved object read); the raw counts stay in the layer 'counts'. The
scaled matrix is made only inside pca, from the highly variable genes (see scale).
"""

from __future__ import annotations

import importlib.util
from typing import Annotated, Any, Literal

import numpy as np
import scanpy as sc
from pydantic import Field
from scipy import sparse

from agent.registry import ToolError, tool
from agent.tools.common import Limit, per_row
from agent.tools.session import Session

DENSE_LIMIT_BYTES = 4 * 2**30  # regress_out and pca's scaled copy are dense; refuse beyond this
SCALE_KEY = "scale"  # adata.uns: how pca scales the genes it uses, as scale set it


@tool("preprocess", stage="normalised", resets="hvg")
def normalize(
    session: Session,
    target_sum: Annotated[float, Field(gt=0)] | None = None,
) -> dict[str, Any]:
    """Normalise each cell to the same total count and log1p-transform.

    The raw counts stay in the layer 'counts'; X holds the log-normalised values of all genes.

    Args:
        target_sum: Counts per cell after normalisation; leave out for the median total count.
    """
    if "normalize" in session.done:
        raise ToolError("normalize was already applied; the data are log-normalised")
    adata = session.adata
    totals = per_row(adata.X, "sum")
    if (totals == 0).any():
        raise ToolError(
            f"normalize: {int((totals == 0).sum())} cells have no counts; call filter_cells with min_counts=1 first"
        )
    target = float(np.median(totals)) if target_sum is None else target_sum
    adata.layers["counts"] = adata.X.copy()
    sc.pp.normalize_total(adata, target_sum=target)
    sc.pp.log1p(adata)
    return {
        "target_sum": target,
        "target_sum_from": "median total counts" if target_sum is None else "given",
        "log1p": True,
        "counts_layer": "counts",
        "X": f"log-normalised, {adata.n_vars} genes",
    }


@tool("preprocess", needs=("normalize",), stage="hvg", resets="pca")
def highly_variable_genes(
    session: Session,
    flavor: Literal["seurat_v3", "seurat", "cell_ranger"] = "seurat_v3",
    n_top_genes: Annotated[int, Field(ge=10)] | None = 2000,
    subset: bool = False,
    limit: Limit = 20,
) -> dict[str, Any]:
    """Flag highly variable genes (var['highly_variable']), which pca then uses.

    flavor 'seurat_v3' ranks genes by variance of the raw counts (the 'counts' layer); 'seurat'
    and 'cell_ranger' use dispersion of the log-normalised data. Needs normalize first. All
    genes stay in X unless subset is true.

    Args:
        flavor: Method of scanpy's highly_variable_genes.
        n_top_genes: Number of genes to select (required for seurat_v3; for the other flavours,
            leave out to use scanpy's mean/dispersion cutoffs).
        subset: Keep only the selected genes in X and layers (all genes stay log-normalised
            in .raw, which markers and annotation then read); leave false to keep all genes.
        limit: How many of the top genes to list in the result.
    """
    if "scale" in session.done:
        raise ToolError(
            "highly_variable_genes must come before scale, which set how pca scales the flagged genes"
        )
    adata = session.adata
    already = adata.var["highly_variable"].all() if "highly_variable" in adata.var else False
    if "highly_variable_genes" in session.done and already:
        raise ToolError("the data were already subset to highly variable genes")
    if n_top_genes is not None and n_top_genes > adata.n_vars:
        raise ToolError(
            f"n_top_genes={n_top_genes} is more than the {adata.n_vars} genes in the data"
        )
    if flavor == "seurat_v3":
        if n_top_genes is None:
            raise ToolError("flavor 'seurat_v3' needs n_top_genes")
        if importlib.util.find_spec("skmisc") is None:
            raise ToolError(
                "flavor 'seurat_v3' needs scikit-misc, which is not installed: use flavor='seurat'"
            )
        sc.pp.highly_variable_genes(
            adata, flavor="seurat_v3", n_top_genes=n_top_genes, layer="counts"
        )
        rank_by = "variances_norm"
    else:
        sc.pp.highly_variable_genes(adata, flavor=flavor, n_top_genes=n_top_genes)
        rank_by = "dispersions_norm"
    hvg = adata.var["highly_variable"].to_numpy()
    if not hvg.any():
        raise ToolError("no gene passed the highly-variable cutoffs; give n_top_genes")
    top = adata.var.loc[hvg, rank_by].sort_values(ascending=False)
    if subset:
        adata.raw = adata
        session.adata = adata[:, hvg].copy()
    return {
        "flavor": flavor,
        "n_highly_variable": int(hvg.sum()),
        "n_genes_before": adata.n_vars,
        "subset": subset,
        "n_genes_in_X": int(hvg.sum()) if subset else adata.n_vars,
        "top_genes": list(top.index[:limit]),
        "left_out": max(0, len(top) - limit),
        "scanpy_params": dict(adata.uns.get("hvg", {})),
    }


def _check_dense_size(tool: str, n_cells: int, n_genes: int) -> None:
    size = n_cells * n_genes * 4
    if size > DENSE_LIMIT_BYTES:
        raise ToolError(
            f"{tool} would make a dense {n_cells} x {n_genes} matrix ({size / 2**30:.1f} GiB); "
            "call highly_variable_genes with subset=true first"
        )


@tool("preprocess", needs=("normalize",), expensive=True, resets="pca")
def regress_out(
    session: Session,
    keys: Annotated[tuple[str, ...], Field(min_length=1, max_length=5)] = (
        "total_counts",
        "pct_counts_mt",
    ),
) -> dict[str, Any]:
    """Regress cell-level covariates (e.g. total counts, percent mitochondrial) out of each gene.

    Optional; needs normalize first. Changes X: the saved object then holds the residuals.

    Args:
        keys: Numeric cell annotations (obs columns) to regress out.
    """
    adata = session.adata
    for key in keys:
        if key not in adata.obs.columns:
            raise ToolError(
                f"regress_out: no cell annotation {key!r} (call qc_metrics for total_counts and pct_counts_mt)"
            )
        if not np.issubdtype(adata.obs[key].dtype, np.number):
            raise ToolError(f"regress_out: {key!r} is not numeric (dtype {adata.obs[key].dtype})")
    _check_dense_size("regress_out", adata.n_obs, adata.n_vars)
    sc.pp.regress_out(adata, keys, n_jobs=1)  # one job: results must not depend on the scheduler
    return {"keys": list(keys), "n_genes": adata.n_vars, "n_cells": adata.n_obs}


def scaled_genes(adata: Any) -> np.ndarray:
    """The genes pca uses and scale scales: the highly variable ones where flagged, else all."""
    if "highly_variable" in adata.var:
        return adata.var["highly_variable"].to_numpy(dtype=bool)
    return np.ones(adata.n_vars, dtype=bool)


def scale_settings(adata: Any) -> dict[str, Any] | None:
    """How scale told pca to scale (plain values, also after a checkpoint), or None if not set."""
    settings = adata.uns.get(SCALE_KEY)
    if settings is None:
        return None
    max_value = settings.get("max_value")
    return {
        "max_value": None if max_value is None else float(max_value),
        "zero_center": bool(settings["zero_center"]),
    }


def scaled_copy(tool: str, adata: Any, genes: np.ndarray) -> tuple[Any, int]:
    """A scaled copy of X's ``genes`` as scale set it (adata.uns['scale']), and the values clipped.

    X itself is not changed: it keeps the log-normalised values of all genes.
    """
    settings = scale_settings(adata)
    max_value, zero_center = settings["max_value"], settings["zero_center"]
    x = adata.X[:, genes]
    if zero_center:
        _check_dense_size(tool, adata.n_obs, int(genes.sum()))
        x = x.toarray() if sparse.issparse(x) else np.array(x)  # centring makes it dense
    x = sc.pp.scale(x, max_value=max_value, zero_center=zero_center, copy=True)
    values = x.data if sparse.issparse(x) else x
    clipped = int(np.sum(np.abs(values) >= max_value)) if max_value is not None else 0
    return x, clipped


@tool("preprocess", needs=("normalize",), resets="pca")
def scale(
    session: Session,
    max_value: Annotated[float, Field(gt=0)] | None = 10.0,
    zero_center: bool = True,
) -> dict[str, Any]:
    """Set how pca scales genes: to unit variance (and zero mean), clipping values above max_value.

    Needs normalize first. pca then scales a copy of the genes it uses (the highly variable ones
    where flagged); X keeps the log-normalised values of all genes, which markers, annotation
    and plots read.

    Args:
        max_value: Clip scaled values above this; leave out for no clipping.
        zero_center: Centre each gene on zero (makes pca's scaled copy dense).
    """
    if "scale" in session.done:
        raise ToolError("scale was already set; pca scales as it says")
    adata = session.adata
    genes = scaled_genes(adata)
    if zero_center:
        _check_dense_size("scale", adata.n_obs, int(genes.sum()))
    adata.uns[SCALE_KEY] = {"max_value": max_value, "zero_center": zero_center}
    return {
        "n_genes": int(genes.sum()),
        "genes": "highly variable" if "highly_variable" in adata.var else "all",
        "max_value": max_value,
        "zero_center": zero_center,
        "applied": "by pca, to a copy of these genes; X stays log-normalised",
    }
