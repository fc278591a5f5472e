"""Leiden clustering, and a sweep over resolutions that picks the finest well-separated, stable one.

Silhouette in PCA space favours the coarsest split (a few big lineages score best), so the sweep
chooses by two criteria that do not: marker separation (every cluster differs from its nearest
cluster in several genes, by a test that knows the clusters' sizes) and stability (each cluster is
found again in subsamples of the graph). The silhouette is still reported, and a low best
silhouette is flagged as weak structure.
"""

from __future__ import annotations

import hashlib
from typing import Annotated, Any

import anndata as ad
import numpy as np
import pandas as pd
import scanpy as sc
from pydantic import Field
from scipy import sparse, stats
from sklearn.metrics import silhouette_score

from agent.checks import UNSWEPT_SILHOUETTE, check
from agent.registry import tool
from agent.tools.common import Key, all_genes, scanpy_params, sizes
from agent.tools.session import Session

Resolution = Annotated[float, Field(gt=0, le=5)]
SILHOUETTE_SAMPLE = 4000  # silhouette is quadratic in cells; a fixed-seed sample bounds its cost

# Marker separation: a gene separates a cluster from its nearest cluster (closest centre in the
# PCA space of the neighbour graph) when Welch's t-test finds the difference (Benjamini-Hochberg
# q < FDR over all genes) and it is large (|Cohen's d| >= EFFECT_SIZE). The test makes it
# size-aware: a few cells that differ by chance in some of thousands of genes do not count, as
# they did with the effect size alone. A cluster is separated when MIN_SEPARATING_GENES genes do.
EFFECT_SIZE = 1.0
FDR = 0.05
MIN_SEPARATING_GENES = 5
# Added to each cluster's variance of a gene (log units): a gene silent in a cluster would
# otherwise divide by zero, and one or two cells of a small cluster expressing a rare gene would
# make it "differ".
VARIANCE_FLOOR = 1e-2
# Stability, per cluster: the mean over SUBSAMPLES fixed-seed subsamples of SUBSAMPLE_SHARE of the
# cells of the Jaccard index between the cluster's sampled cells and the best-matching cluster of
# Leiden on the subsample's graph. Hennig (2007, fpc::clusterboot): below 0.6 a cluster should
# not be trusted; 0.6-0.75 shows a pattern whose exact members are doubtful; 0.75+ is stable.
SUBSAMPLES = 5
SUBSAMPLE_SHARE = 0.8
MIN_STABILITY = 0.6
FIRM_STABILITY = 0.75
WEAK_SILHOUETTE = 0.05  # below this at every resolution, clusters cut a continuum
# the igraph implementation: fast, and deterministic for a given seed
LEIDEN_ARGS = {"flavor": "igraph", "n_iterations": 2, "directed": False}
CRITERION = (
    f"finest resolution at which every cluster has >= {MIN_SEPARATING_GENES} genes that differ "
    f"from its nearest cluster (Welch's t-test, Benjamini-Hochberg q < {FDR} over all genes, and "
    f"|Cohen's d| >= {EFFECT_SIZE}) and a stability >= {MIN_STABILITY} (mean Jaccard index with "
    f"its best match in Leiden on {SUBSAMPLES} subsamples of {SUBSAMPLE_SHARE:.0%} of the cells, "
    "measured only where every cluster is separated); the q-values screen genes, they are no "
    "test of the clusters: clusters found from the same cells always differ somewhat (Gao, Bien "
    "and Witten 2022), which the effect size and the stability guard against"
)


def _leiden_labels(adjacency: Any, resolution: float, seed: int) -> np.ndarray:
    """Leiden on a graph, as the leiden tool runs it, without touching the session's data; the
    clusters as integers, numbered as leiden numbers them (largest first)."""
    holder = ad.AnnData(obs=pd.DataFrame(index=np.arange(adjacency.shape[0]).astype(str)))
    sc.tl.leiden(
        holder, resolution=resolution, adjacency=adjacency, random_state=seed, **LEIDEN_ARGS
    )
    return holder.obs["leiden"].astype(int).to_numpy()


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
    where highly_variable_genes subset X, else X."""
    values = sparse.csr_matrix(all_genes(adata).X)
    return values, values.power(2)


def _silhouette(coords: np.ndarray, labels: np.ndarray, seed: int) -> float | None:
    if len(np.unique(labels)) < 2:
        return None
    size = min(len(labels), SILHOUETTE_SAMPLE)
    coords = np.asarray(coords, dtype=np.float64)  # sklearn upcasts float32 chunk by chunk: slower
    return round(float(silhouette_score(coords, labels, sample_size=size, random_state=seed)), 4)


def separating_genes(
    expression: tuple[Any, Any], coords: np.ndarray, labels: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Per cluster (in sorted label order): how many genes separate it from its nearest cluster,
    and the index of that cluster (-1 where there is no other)."""
    values, squares = expression
    codes, _ = pd.factorize(labels, sort=True)
    member = sparse.csr_matrix((np.ones(len(codes)), (codes, np.arange(len(codes)))))
    n = np.asarray(member.sum(axis=1))  # cells per cluster, as a column
    if len(n) < 2:
        return np.zeros(len(n), int), np.full(len(n), -1)
    means = (member @ values).toarray() / n
    # sample variance (ddof 1; a one-cell cluster has none but the floor)
    variances = np.maximum((member @ squares).toarray() / n - means**2, 0)
    variances = variances * n / np.maximum(n - 1, 1) + VARIANCE_FLOOR
    centres = (member @ coords) / n
    distance = np.linalg.norm(centres[:, None] - centres[None], axis=2)
    np.fill_diagonal(distance, np.inf)
    nearest = distance.argmin(axis=1)
    dof = n - 1
    pooled = (dof * variances + dof[nearest] * variances[nearest]) / (dof + dof[nearest]).clip(1)
    effect = np.abs(means - means[nearest]) / np.sqrt(pooled)
    with np.errstate(divide="ignore", invalid="ignore"):  # one-cell clusters: no degrees of freedom
        _, p = stats.ttest_ind_from_stats(
            means, np.sqrt(variances), n, means[nearest], np.sqrt(variances[nearest]), n[nearest],
            equal_var=False,
        )  # fmt: skip
    q = stats.false_discovery_control(np.nan_to_num(p, nan=1.0), axis=1)
    return ((q < FDR) & (effect >= EFFECT_SIZE)).sum(axis=1), nearest


def _stability(adjacency: Any, labels: np.ndarray, resolution: float, seed: int) -> np.ndarray:
    """Per cluster (in sorted label order): the mean Jaccard index between its cells in a
    subsample and the subsample's best-matching cluster (Leiden on the induced subgraph)."""
    codes, clusters = pd.factorize(labels, sort=True)
    n = len(codes)
    total = np.zeros(len(clusters))
    for b in range(SUBSAMPLES):
        rng = np.random.default_rng(seed + b)
        keep = np.sort(rng.choice(n, int(SUBSAMPLE_SHARE * n), replace=False))
        sub = _leiden_labels(adjacency[keep][:, keep], resolution, seed + b)
        shared = sparse.coo_matrix(
            (np.ones(len(keep)), (codes[keep], sub)), shape=(len(clusters), sub.max() + 1)
        ).toarray()  # cells in both, per (cluster, subsample cluster)
        union = shared.sum(axis=1, keepdims=True) + shared.sum(axis=0, keepdims=True) - shared
        total += (shared / np.maximum(union, 1)).max(axis=1)
    return total / SUBSAMPLES


def _score(
    adjacency: Any, expression: tuple[Any, Any], coords: np.ndarray, resolution: float, seed: int
) -> dict:
    """One resolution's row. Stability costs SUBSAMPLES Leiden runs, so it is measured only where
    every cluster is separated: elsewhere the resolution cannot qualify whatever it is."""
    labels = _leiden_labels(adjacency, resolution, seed)
    counts = np.bincount(labels)
    separating, nearest = separating_genes(expression, coords, labels)
    # one cluster has nothing to separate from
    separated = (separating >= MIN_SEPARATING_GENES) | (len(counts) == 1)
    stability = _stability(adjacency, labels, resolution, seed) if separated.all() else None
    return {
        "resolution": resolution,
        "n_clusters": len(counts),
        "smallest_cluster": int(counts.min()),
        "silhouette": _silhouette(coords, labels, seed),
        "min_separating_genes": int(separating.min()),
        "share_separated": round(float(separated.mean()), 4),
        "min_stability": None if stability is None else round(float(stability.min()), 4),
        "share_stable": (
            None if stability is None else round(float((stability >= MIN_STABILITY).mean()), 4)
        ),
        "qualified": stability is not None and bool((stability >= MIN_STABILITY).all()),
        # per cluster, in leiden's numbering (cluster 0 first)
        "cluster_sizes": counts.tolist(),
        "nearest_cluster": nearest.tolist(),
        "separating_genes": separating.tolist(),
        "stability": None if stability is None else np.round(stability, 2).tolist(),
    }


def _choose(table: list[dict]) -> tuple[dict, list[str]]:
    """The finest qualified resolution; else the best separated, then most stable (coarser on
    ties)."""
    warnings = []
    qualified = [row for row in table if row["qualified"]]
    if qualified:
        chosen = max(qualified, key=lambda row: row["resolution"])
    else:
        chosen = max(
            table,
            key=lambda r: (r["share_separated"], r["min_stability"] or 0.0, -r["resolution"]),
        )
        stable = (
            "stability not measured"
            if chosen["share_stable"] is None
            else f"{chosen['share_stable']:.0%} stable"
        )
        warnings.append(
            f"no resolution met the criterion; chose {chosen['resolution']}, where "
            f"{chosen['share_separated']:.0%} of clusters are separated ({stable}): treat its "
            "clusters with caution"
        )
    swept = [row["resolution"] for row in table]
    if chosen["resolution"] == max(swept):
        warnings.append(
            f"the chosen resolution {chosen['resolution']} is the finest swept: a finer one may "
            "also meet the criterion; sweep beyond it to know"
        )
    elif chosen["resolution"] == min(swept):
        warnings.append(
            f"the chosen resolution {chosen['resolution']} is the coarsest swept: every finer "
            "one failed the criterion"
        )
    doubtful = [
        str(c)
        for c, s in enumerate(chosen["stability"] or [])
        if MIN_STABILITY <= s < FIRM_STABILITY
    ]
    if doubtful and qualified:
        warnings.append(
            f"clusters with a stability of only {MIN_STABILITY}-{FIRM_STABILITY} at "
            f"{chosen['resolution']}: {', '.join(doubtful)} (a pattern, but which cells belong "
            "to them is doubtful)"
        )
    scored = [row["silhouette"] for row in table if row["silhouette"] is not None]
    if scored and max(scored) < WEAK_SILHOUETTE:
        warnings.append(
            f"weak structure: the best silhouette is {max(scored)} (< {WEAK_SILHOUETTE}); the "
            "clusters may cut a continuum rather than separate cell populations"
        )
    return chosen, warnings


@tool(
    "cluster", needs=("neighbors",), expensive=True, stage="clusters", resets="markers",
    clustering="key_added",
)  # fmt: skip
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
    ranked = adata.uns.get("rank_genes_groups")
    if ranked is not None and ranked["params"]["groupby"] == key_added:
        # ranked for the clusters this call replaced: new clusters may reuse their names
        del adata.uns["rank_genes_groups"]
    labels = adata.obs[key_added]
    silhouette = _silhouette(_pca_used(adata), labels.to_numpy(), session.seed)
    n_clusters = len(labels.cat.categories)
    return {
        "resolution": resolution,
        "key_added": key_added,
        "n_clusters": n_clusters,
        "cluster_sizes": sizes(labels),
        "silhouette": silhouette,
        "scanpy_params": scanpy_params(adata, key_added),
        "checks": [_unswept(session, resolution, n_clusters, silhouette)],
    }


def _unswept(
    session: Session, resolution: float, n_clusters: int, silhouette: float | None
) -> dict[str, Any]:
    """The clustering_unswept check: a resolution chosen without a cluster_sweep of the current
    neighbour graph on data whose clusters barely separate (silhouette below
    UNSWEPT_SILHOUETTE, or a single cluster), or outside the range the sweep qualified."""
    sweep = session.adata.uns.get("cluster_sweep") or {}
    swept = bool(sweep) and sweep.get("graph") == graph_digest(session.adata)
    table = sweep.get("table") if swept else None
    qualified = (
        sorted(float(r) for r in table.loc[table["qualified"].astype(bool), "resolution"])
        if table is not None and "qualified" in table
        else []
    )
    evidence = {
        "resolution": resolution, "n_clusters": n_clusters, "silhouette": silhouette,
        "swept_this_graph": swept, "sweep_qualified": qualified,
        "sweep_best_resolution": sweep.get("best_resolution") if swept else None,
        "limit": UNSWEPT_SILHOUETTE,
    }  # fmt: skip
    weak = silhouette is None or silhouette < UNSWEPT_SILHOUETTE
    shown = "one cluster" if silhouette is None else f"silhouette {silhouette}"
    if weak and not swept:
        return check(
            "clustering_unswept", "warn",
            f"leiden at resolution {resolution} gives {n_clusters} cluster(s), {shown} (< "
            f"{UNSWEPT_SILHOUETTE}), chosen without a cluster_sweep of this neighbour graph: "
            "compare resolutions first",
            **evidence,
        )  # fmt: skip
    if qualified and not qualified[0] <= resolution <= qualified[-1]:
        return check(
            "clustering_unswept", "warn",
            f"resolution {resolution} is outside {qualified[0]}-{qualified[-1]}, where "
            f"cluster_sweep found every cluster separated and stable (it chose "
            f"{sweep.get('best_resolution')}); {n_clusters} cluster(s), {shown}",
            **evidence,
        )  # fmt: skip
    said = "after cluster_sweep" if swept else f"silhouette {silhouette} >= {UNSWEPT_SILHOUETTE}"
    return check("clustering_unswept", "pass", f"resolution {resolution} chosen {said}", **evidence)


def graph_digest(adata: Any) -> str | None:
    """A digest of the neighbour graph, so a sweep is known to be of the graph in use."""
    graph = adata.obsp.get("connectivities")
    if graph is None:
        return None
    graph = sparse.csr_matrix(graph)
    h = hashlib.blake2b(digest_size=16)
    for part in (graph.data, graph.indices, graph.indptr):
        h.update(np.ascontiguousarray(part).tobytes())
    return h.hexdigest()


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

    Per resolution: the number of clusters, the smallest, the silhouette in PCA space, and per
    cluster (in leiden's numbering) its size, its nearest cluster, its separating genes (Welch's
    t-test q < 0.05 over all genes and a difference of at least one pooled standard deviation
    against the nearest cluster) and its stability (mean Jaccard index with its best match in
    Leiden on 5 subsamples of 80% of the cells; measured only where every cluster is separated,
    else null); min_separating_genes, share_separated,
    min_stability and share_stable sum them up. best_resolution is the finest resolution where
    every cluster has 5 or more such genes and a stability of 0.6 or more (the criterion is
    named in the result); warnings say when none qualifies, when the choice is the finest or
    coarsest swept, when a chosen cluster's stability is only 0.6-0.75, or when the structure is
    weak (best silhouette below 0.05). Keeps no labels: call leiden with the chosen resolution.

    Args:
        resolutions: Leiden resolutions to try (2 to 12 values in (0, 5]).
    """
    adata = session.adata
    adjacency, coords = adata.obsp["connectivities"], _pca_used(adata)
    expression = _expression(adata)
    table = [
        _score(adjacency, expression, coords, r, session.seed) for r in sorted(set(resolutions))
    ]
    chosen, warnings = _choose(table)
    per_cluster = ("cluster_sizes", "nearest_cluster", "separating_genes", "stability")
    clusters = pd.concat(
        pd.DataFrame({"resolution": row["resolution"], **{k: row[k] for k in per_cluster}})
        .astype({"stability": float})  # NaN where not measured
        .rename_axis("cluster")
        .reset_index()
        for row in table
    )  # one row per cluster and resolution: .h5ad cannot hold the table's lists
    adata.uns["cluster_sweep"] = {
        "table": pd.DataFrame(table)
        .drop(columns=list(per_cluster))
        .astype({k: float for k in ("silhouette", "min_stability", "share_stable")}),
        "clusters": clusters.reset_index(drop=True),
        "criterion": CRITERION,
        "best_resolution": chosen["resolution"],
        "seed": session.seed,
        "graph": graph_digest(adata),
        **({"warnings": warnings} if warnings else {}),
    }
    return {
        "criterion": CRITERION,
        "table": table,
        "best_resolution": chosen["resolution"],
        "best_n_clusters": chosen["n_clusters"],
        "warnings": warnings,
    }
