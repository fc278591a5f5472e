"""Embeddings: PCA (with a suggested number of components), the kNN graph, UMAP."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import anndata as ad
import numpy as np
import scanpy as sc
from pydantic import Field

from agent.registry import ToolError, tool
from agent.tools.common import scanpy_params
from agent.tools.preprocess import scale_settings, scaled_copy
from agent.tools.session import Session


def _cache_umap_kernels() -> None:
    """Let numba keep umap-learn's compiled kernels on disk.

    umap-learn compiles its kNN-graph and layout kernels anew in every process (its numba
    functions are not cached), 5-15 s of each agent run's neighbors and umap steps; with the
    on-disk cache that cost is paid once per installation.
    """
    from umap import layouts, umap_

    for module in (umap_, layouts):
        for value in vars(module).values():
            if hasattr(value, "enable_caching"):
                value.enable_caching()


_cache_umap_kernels()


def elbow(variance_ratio: np.ndarray) -> int:
    """Components before the elbow of the variance-ratio curve (largest gap below the chord).

    The chord runs from the first to the last component on log variance, where noise components
    lie on a near-straight line; the point furthest below it ends the signal.
    """
    y = np.log(np.asarray(variance_ratio, dtype=float))
    x = np.arange(len(y), dtype=float)
    chord = y[0] + (y[-1] - y[0]) * x / x[-1]
    return int(np.argmax(chord - y)) + 1


def _pca_of_scaled_copy(adata: Any, genes: np.ndarray, n_comps: int, seed: int) -> int:
    """PCA of a scaled copy of X's ``genes``, stored in adata as sc.pp.pca with mask_var does
    (obsm X_pca, varm PCs zero outside the genes, uns pca); returns the values clipped."""
    x, clipped = scaled_copy("pca", adata, genes)
    sub = ad.AnnData(x)
    sc.pp.pca(sub, n_comps=n_comps, svd_solver="arpack", random_state=seed)
    adata.obsm["X_pca"] = sub.obsm["X_pca"]
    loadings = np.zeros((adata.n_vars, n_comps), dtype=sub.varm["PCs"].dtype)
    loadings[genes] = sub.varm["PCs"]
    adata.varm["PCs"] = loadings
    adata.uns["pca"] = sub.uns["pca"]
    return clipped


@tool("embed", needs=("normalize",), expensive=True, stage="pca", resets="neighbours")
def pca(
    session: Session,
    n_comps: Annotated[int, Field(ge=2, le=200)] = 50,
    use_highly_variable: bool = True,
) -> dict[str, Any]:
    """Principal component analysis of the log-normalised data, scaled as scale set it.

    After scale, the genes used are scaled in a copy; X keeps its log-normalised values. Returns
    the variance ratio of each component and a suggested number of components for neighbors (the
    elbow of the variance-ratio curve).

    Args:
        n_comps: Number of components to compute.
        use_highly_variable: Use only highly variable genes when they are marked and X holds more.
    """
    adata = session.adata
    mask = "highly_variable" if use_highly_variable and "highly_variable" in adata.var else None
    genes = adata.var[mask].to_numpy(dtype=bool) if mask else np.ones(adata.n_vars, dtype=bool)
    limit = min(adata.n_obs, int(genes.sum())) - 1
    if n_comps > limit:
        raise ToolError(
            f"n_comps={n_comps} is too many for {adata.n_obs} cells x {int(genes.sum())} genes "
            f"(at most {limit})"
        )
    clipped, scaling = None, scale_settings(adata)
    if scaling is not None:
        clipped = _pca_of_scaled_copy(adata, genes, n_comps, session.seed)
    else:
        sc.pp.pca(
            adata, n_comps=n_comps, mask_var=mask, svd_solver="arpack", random_state=session.seed
        )
    # as sc.pp.pca records it with mask_var, also where the masked genes were scaled in a copy
    adata.uns["pca"]["params"].update(mask_var=mask, use_highly_variable=mask is not None)
    ratio = adata.uns["pca"]["variance_ratio"]
    cumulative = np.cumsum(ratio)
    suggested = elbow(ratio) if n_comps >= 5 else n_comps
    return {
        "n_comps": n_comps,
        "genes_used": int(genes.sum()),
        "scaled": scaling,
        "values_clipped": clipped,
        "variance_ratio": [round(float(v), 5) for v in ratio],
        "cumulative_variance": {
            str(k): round(float(cumulative[k - 1]), 4) for k in (5, 10, 20, 30, 50) if k <= n_comps
        },
        "suggested_n_pcs": suggested,
        "suggested_by": "elbow of log variance ratio (furthest below the first-to-last chord)",
        "scanpy_params": scanpy_params(adata, "pca"),
    }


@tool("embed", needs=("pca",), expensive=True, stage="neighbours", resets="clusters")
def neighbors(
    session: Session,
    n_neighbors: Annotated[int, Field(ge=2, le=200)] = 15,
    n_pcs: Annotated[int, Field(ge=2)] | None = None,
    metric: Literal["euclidean", "cosine"] = "euclidean",
) -> dict[str, Any]:
    """Build the k-nearest-neighbour graph of the cells in PCA space (for UMAP and Leiden).

    Args:
        n_neighbors: Neighbours per cell.
        n_pcs: Principal components to use; leave out for all that pca computed.
        metric: Distance in PCA space.
    """
    adata = session.adata
    available = adata.obsm["X_pca"].shape[1]
    if n_pcs is not None and n_pcs > available:
        raise ToolError(f"n_pcs={n_pcs} is more than the {available} components pca computed")
    if n_neighbors >= adata.n_obs:
        raise ToolError(
            f"n_neighbors={n_neighbors} must be below the number of cells ({adata.n_obs})"
        )
    sc.pp.neighbors(
        adata, n_neighbors=n_neighbors, n_pcs=n_pcs, metric=metric, random_state=session.seed
    )
    return {
        "n_neighbors": n_neighbors,
        "n_pcs": n_pcs if n_pcs is not None else available,
        "metric": metric,
        "n_edges": int(adata.obsp["connectivities"].nnz),
        "scanpy_params": scanpy_params(adata, "neighbors"),
    }


@tool("embed", needs=("neighbors",), expensive=True)
def umap(
    session: Session,
    min_dist: Annotated[float, Field(ge=0, le=1)] = 0.5,
    spread: Annotated[float, Field(gt=0, le=5)] = 1.0,
) -> dict[str, Any]:
    """Compute a 2-D UMAP embedding from the neighbour graph (for plots).

    Args:
        min_dist: Minimum distance between embedded points (smaller: tighter clumps).
        spread: Scale of the embedded points.
    """
    adata = session.adata
    if min_dist > spread:
        raise ToolError(f"min_dist={min_dist} must not exceed spread={spread}")
    sc.tl.umap(adata, min_dist=min_dist, spread=spread, random_state=session.seed)
    coords = adata.obsm["X_umap"]
    return {
        "n_cells": adata.n_obs,
        "min_dist": min_dist,
        "spread": spread,
        "extent": [
            [round(float(coords[:, i].min()), 2), round(float(coords[:, i].max()), 2)]
            for i in (0, 1)
        ],
        "scanpy_params": scanpy_params(adata, "umap"),
    }
