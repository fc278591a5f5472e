"""Leiden clustering, and a sweep over resolutions that picks the finest well-separated, stable one.

Silhouette in PCA space favours the coarsest split (a few big lineages score best), so the sweep
chooses by two criteria that do not: marker separation (every cluster differs from its nearest
cluster in several genes) and stability (subsamples of the graph give the same clusters). The
silhouette is still reported, and a low best silhouette is flagged as weak structure.
"""

from __future__ import annotations

from typing import Annotated, Any

import anndata as ad
import numpy as np
import pandas as pd
import scanpy as sc
from pydantic import Field
from scipy import sparse
from sklearn.metrics import adjusted_rand_score, silhouette_score

from agent.registry import tool
from agent.tools.common import Key, all_genes, scanpy_params, sizes
from agent.tools.session import Session

Resolution = Annotated[float, Field(gt=0, le=5)]
SILHOUETTE_SAMPLE = 4000  # silhouette is quadratic in cells; a fixed-seed sample bounds its cost

# Marker separation: a gene separates two clusters when their means differ by at least
# EFFECT_SIZE pooled standard deviations (Cohen's d: independent of depth, cluster size and
# per-gene scaling); a cluster is separated when MIN_SEPARATING_GENES genes do so against its
# nearest cluster (closest centre in the PCA space of the neighbour graph).
EFFECT_SIZE = 1.0
MIN_SEPARATING_GENES = 5
# Stability: mean ARI between the full clustering and Leiden on the graph of SUBSAMPLES
# fixed-seed subsamples of SUBSAMPLE_SHARE of the cells.
SUBSAMPLES = 2
SUBSAMPLE_SHARE = 0.8
MIN_STABILITY = 0.7
WEAK_SILHOUETTE = 0.05  # below this at every resolution, clusters cut a continuum
# the igraph implementation: fast, and deterministic for a given seed
LEIDEN_ARGS = {"flavor": "igraph", "n_iterations": 2, "directed": False}
CRITERION = (
    f"finest resolution at which every cluster has >= {MIN_SEPARATING_GENES} genes with "
    f"|Cohen's d| >= {EFFECT_SIZE} against its nearest cluster and the subsample stability "
    f"(mean ARI over {SUBSAMPLES} subsamples of {SUBSAMPLE_SHARE:.0%}) is >= {MIN_STABILITY}"
)


def _leiden_labels(adjacency: Any, resolution: float, seed: int) -> np.ndarray:
    """Leiden on a graph, as the leiden tool runs it, without touching the session's data."""
    holder = ad.AnnData(obs=pd.DataFrame(index=np.arange(adjacency.shape[0]).astype(str)))
    sc.tl.leiden(
        holder, resolution=resolution, adjacency=adjacency, random_state=seed, **LEIDEN_ARGS
    )
    return holder.obs["leiden"].to_numpy()


def _leiden(session: Session, resolution: float, key: str) -> None:
    sc.tl.leiden(
        session.adata, resolution=resolution, key_added=key, random_state=session.seed,
        **LEIDEN_ARGS,
    )  # fmt: skip


def _pca_used(adata: Any) -> np.ndarray:
    """The PCA coordinates the neighbour graph was built from."""
    n_pcs = scanpy_params(adata, "neighbors").get("n_pcs")
    return adata.obsm["X_pca"][:, :n_pcs] if n_pcs else adata.obsm["X_pca"]


def _expression(adata: Any) -> tuple[Any, Any]:
    """Log-normalised values of all genes and their squares (computed once per sweep): .raw
    where highly_variable_genes subset X, else X (a scaled X would give the same effect sizes:
    Cohen's d does not change under per-gene scaling)."""
    values = sparse.csr_matrix(all_genes(adata).X)
    return values, values.power(2)


def _silhouette(coords: np.ndarray, labels: np.ndarray, seed: int) -> float | None:
    if len(np.unique(labels)) < 2:
        return None
    size = min(len(labels), SILHOUETTE_SAMPLE)
    return round(float(silhouette_score(coords, labels, sample_size=size, random_state=seed)), 4)


def separating_genes(
    expression: tuple[Any, Any], coords: np.ndarray, labels: np.ndarray
) -> np.ndarray:
    """Per cluster (in sorted label order), the genes separating it from its nearest cluster."""
    values, squares = expression
    codes, _ = pd.factorize(labels, sort=True)
    member = sparse.csr_matrix(
        (np.ones(len(codes), values.dtype), (codes, np.arange(len(codes)))), dtype=values.dtype
    )
    n = np.asarray(member.sum(axis=1), dtype=np.float64)
    means = (member @ values).toarray() / n
    variances = np.maximum((member @ squares).toarray() / n - means**2, 0)
    centres = (member @ coords) / n
    counts = np.zeros(len(n), int)
    if len(n) < 2:
        return counts
    for i in range(len(n)):
        distance = np.linalg.norm(centres - centres[i], axis=1)
        distance[i] = np.inf
        j = int(np.argmin(distance))
        # the floor keeps genes silent in both clusters from dividing by zero
        pooled = np.sqrt((variances[i] + variances[j]) / 2 + 1e-2)
        counts[i] = int((np.abs(means[i] - means[j]) / pooled >= EFFECT_SIZE).sum())
    return counts


def _stability(adjacency: Any, labels: np.ndarray, resolution: float, seed: int) -> float:
    """Mean ARI between the full clustering and Leiden on induced subgraphs of subsamples."""
    n = len(labels)
    scores = []
    for b in range(SUBSAMPLES):
        keep = np.sort(
            np.random.default_rng(seed + b).choice(n, int(SUBSAMPLE_SHARE * n), replace=False)
        )
        sub = _leiden_labels(adjacency[keep][:, keep], resolution, seed)
        scores.append(adjusted_rand_score(labels[keep], sub))
    return round(float(np.mean(scores)), 4)


def _score(
    session: Session, resolution: float, expression: tuple[Any, Any], coords: np.ndarray
) -> dict:
    adjacency = session.adata.obsp["connectivities"]
    labels = _leiden_labels(adjacency, resolution, session.seed)
    counts = pd.Series(labels).value_counts()
    separating = separating_genes(expression, coords, labels)
    separated = separating >= MIN_SEPARATING_GENES
    stability = _stability(adjacency, labels, resolution, session.seed)
    return {
        "resolution": resolution,
        "n_clusters": len(counts),
        "smallest_cluster": int(counts.min()),
        "silhouette": _silhouette(coords, labels, session.seed),
        "min_separating_genes": int(separating.min()),
        "share_separated": round(float(separated.mean()), 4),
        "stability": stability,
        # one cluster has nothing to separate
        "qualified": bool(separated.all() or len(counts) == 1) and stability >= MIN_STABILITY,
    }


def _choose(table: list[dict]) -> tuple[dict, list[str]]:
    """The finest qualified resolution; else the best separated and most stable (coarser on ties)."""
    warnings = []
    qualified = [row for row in table if row["qualified"]]
    if qualified:
        chosen = max(qualified, key=lambda row: row["resolution"])
    else:
        chosen = max(table, key=lambda r: (r["share_separated"], r["stability"], -r["resolution"]))
        warnings.append(
            f"no resolution met the criterion; chose {chosen['resolution']}, where "
            f"{chosen['share_separated']:.0%} of clusters are separated (stability "
            f"{chosen['stability']}): treat its clusters with caution"
        )
    scored = [row["silhouette"] for row in table if row["silhouette"] is not None]
    if scored and max(scored) < WEAK_SILHOUETTE:
        warnings.append(
            f"weak structure: the best silhouette is {max(scored)} (< {WEAK_SILHOUETTE}); the "
            "clusters may cut a continuum rather than separate cell populations"
        )
    return chosen, warnings


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
    """Run Leiden at several resolutions and choose the finest one whose clusters are distinct.

    Per resolution: the number of clusters, the smallest, the silhouette in PCA space, marker
    separation (genes differing by at least one pooled standard deviation between each cluster
    and its nearest cluster; min_separating_genes, share_separated) and stability (mean ARI of
    Leiden on 80% subsamples against the full clustering). best_resolution is the finest
    resolution where every cluster has 5 or more such genes and stability is 0.7 or more (the
    criterion is named in the result); warnings say when none qualifies or the structure is weak
    (best silhouette below 0.05). Keeps no labels: call leiden with the chosen resolution.

    Args:
        resolutions: Leiden resolutions to try (2 to 12 values in (0, 5]).
    """
    adata = session.adata
    coords = _pca_used(adata)
    expression = _expression(adata)
    table = [_score(session, r, expression, coords) for r in sorted(set(resolutions))]
    chosen, warnings = _choose(table)
    adata.uns["cluster_sweep"] = {
        "table": pd.DataFrame(table).astype({"silhouette": float}),
        "criterion": CRITERION,
        "best_resolution": chosen["resolution"],
        "seed": session.seed,
        **({"warnings": warnings} if warnings else {}),
    }
    return {
        "criterion": CRITERION,
        "table": table,
        "best_resolution": chosen["resolution"],
        "best_n_clusters": chosen["n_clusters"],
        "warnings": warnings,
    }
