"""Leiden clustering, and a sweep over resolutions scored by silhouette in PCA space."""

from __future__ import annotations

from typing import Annotated, Any

import numpy as np
import pandas as pd
import scanpy as sc
from pydantic import Field
from sklearn.metrics import silhouette_score

from agent.registry import tool
from agent.tools.common import Key, scanpy_params, sizes
from agent.tools.session import Session

Resolution = Annotated[float, Field(gt=0, le=5)]
SILHOUETTE_SAMPLE = 4000  # silhouette is quadratic in cells; a fixed-seed sample bounds its cost
SWEEP_KEY = "_cluster_sweep"


def _leiden(session: Session, resolution: float, key: str) -> None:
    # the igraph implementation: fast, and deterministic for a given seed
    sc.tl.leiden(
        session.adata, resolution=resolution, key_added=key, flavor="igraph", n_iterations=2,
        directed=False, random_state=session.seed,
    )  # fmt: skip


def _pca_used(adata: Any) -> np.ndarray:
    """The PCA coordinates the neighbour graph was built from."""
    n_pcs = scanpy_params(adata, "neighbors").get("n_pcs")
    return adata.obsm["X_pca"][:, :n_pcs] if n_pcs else adata.obsm["X_pca"]


def _silhouette(coords: np.ndarray, labels: np.ndarray, seed: int) -> float | None:
    if len(np.unique(labels)) < 2:
        return None
    size = min(len(labels), SILHOUETTE_SAMPLE)
    return round(float(silhouette_score(coords, labels, sample_size=size, random_state=seed)), 4)


@tool("cluster", needs=("neighbors",), expensive=True)
def leiden(
    session: Session,
    resolution: Resolution = 1.0,
    key_added: Key = "leiden",
) -> dict[str, Any]:
    """Cluster the cells with Leiden community detection on the neighbour graph.

    Higher resolution gives more, smaller clusters. cluster_sweep helps choose one.

    Args:
        resolution: Leiden resolution (0 < resolution <= 5).
        key_added: Cell annotation (obs column) to store the cluster labels in.
    """
    _leiden(session, resolution, key_added)
    adata = session.adata
    labels = adata.obs[key_added]
    return {
        "resolution": resolution,
        "key_added": key_added,
        "n_clusters": len(labels.cat.categories),
        "cluster_sizes": sizes(labels),
        "silhouette": _silhouette(_pca_used(adata), labels.to_numpy(), session.seed),
        "scanpy_params": scanpy_params(adata, key_added),
    }


@tool("cluster", needs=("neighbors",), expensive=True)
def cluster_sweep(
    session: Session,
    resolutions: Annotated[tuple[Resolution, ...], Field(min_length=2, max_length=12)] = (
        0.1,
        0.2,
        0.3,
        0.5,
        0.7,
        1.0,
        1.4,
    ),
) -> dict[str, Any]:
    """Run Leiden at several resolutions and score each clustering by silhouette in PCA space.

    Keeps no labels (call leiden with the chosen resolution); returns per resolution the number
    of clusters, the smallest cluster and the silhouette, and the resolution that scored best.

    Args:
        resolutions: Leiden resolutions to try (2 to 12 values in (0, 5]).
    """
    adata = session.adata
    coords = _pca_used(adata)
    table = []
    try:
        for resolution in sorted(set(resolutions)):
            _leiden(session, resolution, SWEEP_KEY)
            labels = adata.obs[SWEEP_KEY]
            counts = labels.value_counts()
            table.append({
                "resolution": resolution,
                "n_clusters": len(counts),
                "smallest_cluster": int(counts.min()),
                "silhouette": _silhouette(coords, labels.to_numpy(), session.seed),
            })  # fmt: skip
    finally:
        adata.obs.drop(columns=SWEEP_KEY, inplace=True, errors="ignore")
        adata.uns.pop(SWEEP_KEY, None)
    scored = [row for row in table if row["silhouette"] is not None]
    best = max(scored, key=lambda row: row["silhouette"]) if scored else None
    adata.uns["cluster_sweep"] = {
        "table": pd.DataFrame(table),
        "score": "silhouette",
        "seed": session.seed,
    }
    return {
        "score": "silhouette (PCA space used by neighbors)",
        "table": table,
        "best_resolution": best["resolution"] if best else None,
        "best_n_clusters": best["n_clusters"] if best else None,
    }
