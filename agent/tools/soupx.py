"""SoupX (Young & Behjati 2020, GigaScience) as its R package (1.6) computes it.

- the soup: the summed counts of the droplets with 0 < UMIs < 100 (``estimateSoup``'s default
  ``soupRange``), as proportions (``est``);
- markers: ``quickMarkers``' tf-idf of each gene in each cluster (cells with a count above 0.9),
  hypergeometric BH q-values per cluster, every gene with q < 0.01; the most specific entry of
  each gene, tf-idf above 1, among the genes above the soup's 90% quantile, the best 100;
- where each marker is surely not expressed (``estimateNonExpressingCells``): clusters none of
  whose cells holds more of it than 80% contamination explains (Poisson, BH q >= 0.2);
- rho (``autoEstCont``): per usable cluster and marker, the posterior of rho under SoupX's gamma
  prior (mode 0.05, sd 0.1) given the cluster's counts and the soup's expectation; their mean
  over a grid of 0.001, its mode within (0.01, 0.8) and its full width at half maximum;
- the correction (``adjustCounts``, method 'subtraction', with clusters): each cluster loses
  nUMIs x rho counts spread over its genes by the soup profile, capped by what it holds
  (``alloc``), then each gene's removed counts are spread over the cluster's cells that hold it,
  weighted by nUMIs x rho and capped likewise (``expandClusters``); integers by ``roundToInt``'s
  stochastic rounding.

The PyPI ports were read and not used: ``pysoupx`` 0.1.0 (a month-old single release) follows the
R code closely but expands clusters in a Python loop over every gene of every cluster, writing
into scipy LIL matrices; ``soupx-python`` 0.3.0 likewise loops per gene in Python. ``alloc`` here is one vectorised pass
over all buckets of all genes at once, the same water-filling as R's closed form.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy import sparse, stats
from scipy.stats import false_discovery_control

SOUP_RANGE = (0, 100)  # a droplet with more than 0 and fewer than 100 UMIs holds soup only
EXPRESS_CUT = 0.9  # quickMarkers: a cell expresses a gene with a count above this
MARKER_FDR = 0.01
TFIDF_MIN = 1.0
SOUP_QUANTILE = 0.9
MAX_MARKERS = 100
CONTAMINATION_RANGE = (0.01, 0.8)
RHO_MAX_FDR = 0.2
PRIOR_RHO, PRIOR_RHO_SD = 0.05, 0.10
MIN_ESTIMATES = 10  # autoEstCont warns below this many cluster x marker estimates
RHO_WARN, RHO_MAX = 0.3, 0.5  # setContaminationFraction: warns above, refuses above


def soup_counts(matrix: sparse.csr_matrix, totals: np.ndarray) -> np.ndarray:
    """Per gene, the summed counts of the droplets SoupX takes for soup (``SOUP_RANGE``)."""
    low, high = SOUP_RANGE
    empty = (totals > low) & (totals < high)
    return np.asarray(matrix[empty].sum(axis=0)).ravel().astype(float)


def alloc(
    target: np.ndarray, limits: np.ndarray, weights: np.ndarray, bucket_set: np.ndarray
) -> np.ndarray:
    """SoupX's ``alloc`` for many sets of buckets at once: each set ``s`` (``bucket_set``, an
    index per bucket) spreads ``target[s]`` over its buckets in proportion to their weights,
    none above its limit, the excess of full buckets spread again over the others."""
    n_sets = len(target)
    total = np.bincount(bucket_set, weights, minlength=n_sets)
    with np.errstate(divide="ignore", invalid="ignore"):
        w = np.where(total[bucket_set] > 0, weights / total[bucket_set], 0.0)
        ratio = np.where(w > 0, limits / w, np.inf)
    order = np.lexsort((ratio, bucket_set))  # per set, in the order buckets fill up
    s, y, w = bucket_set[order], limits[order], w[order]
    first = np.r_[True, s[1:] != s[:-1]]
    start = np.maximum.accumulate(np.where(first, np.arange(len(s)), 0))

    def before(values: np.ndarray) -> np.ndarray:  # sum over the set's earlier buckets
        running = np.cumsum(values) - values
        return running - running[start]

    with np.errstate(divide="ignore", invalid="ignore"):
        filled_at = np.where(w > 0, y / w * (1 - before(w)) + before(y), np.inf)
    full = filled_at <= target[s]
    rest = target - np.bincount(s, y * full, minlength=n_sets)
    left = 1 - np.bincount(s, w * full, minlength=n_sets)
    with np.errstate(divide="ignore", invalid="ignore"):
        share = np.where(left[s] > 0, rest[s] * w / left[s], 0.0)
    out = np.empty_like(y, dtype=float)
    out[order] = np.where(full, y, share)
    return out


def _cluster_sums(matrix: sparse.csr_matrix, codes: np.ndarray, k: int) -> np.ndarray:
    """clusters x genes summed counts."""
    indicator = sparse.csr_matrix(
        (np.ones(len(codes)), (codes, np.arange(len(codes)))), shape=(k, len(codes))
    )
    return np.asarray((indicator @ matrix).todense())


def quick_markers(matrix: sparse.csr_matrix, codes: np.ndarray, k: int) -> list[tuple]:
    """quickMarkers(N=Inf): (tfidf, gene, cluster) of every gene whose share of expressing cells
    in a cluster is significant (hypergeometric, BH per cluster, q < MARKER_FDR)."""
    expressed = matrix.copy()
    expressed.data = (expressed.data > EXPRESS_CUT).astype(float)
    observed = _cluster_sums(expressed, codes, k)  # clusters x genes: expressing cells
    sizes = np.bincount(codes, minlength=k).astype(float)
    n = len(codes)
    total = observed.sum(axis=0)
    with np.errstate(divide="ignore", invalid="ignore"):
        idf = np.log(n / total)
        score = observed / sizes[:, None] * idf
    found = []
    for c in range(k):
        p = stats.hypergeom.sf(observed[c] - 1, n, total, sizes[c])
        q = false_discovery_control(np.nan_to_num(p, nan=1.0))
        for g in np.flatnonzero((q < MARKER_FDR) & np.isfinite(score[c])):
            found.append((float(score[c, g]), int(g), c))
    return found


@dataclass
class Estimate:
    """autoEstCont's outcome: rho (None: no usable estimate) and its evidence."""

    rho: float | None
    fwhm: tuple[float, float] | None
    markers: list[int]  # gene indices, best first
    estimates: int  # cluster x marker pairs used
    per_marker: dict[int, float]  # gene -> its pooled rho over the clusters where it is usable
    n_markers_tfidf: int  # markers past the tf-idf cut (before the soup filter)


def _markers(matrix: sparse.csr_matrix, codes: np.ndarray, k: int, soup: np.ndarray) -> tuple:
    found = quick_markers(matrix, codes, k)
    best: dict[int, float] = {}
    for score, gene, _ in found:  # the most specific entry of each gene
        best[gene] = max(score, best.get(gene, -np.inf))
    ranked = sorted((g for g, s in best.items() if s > TFIDF_MIN), key=lambda g: -best[g])
    in_soup = soup > np.quantile(soup, SOUP_QUANTILE)
    return [g for g in ranked if in_soup[g]][:MAX_MARKERS], len(ranked)


def estimate_rho(matrix: sparse.csr_matrix, codes: np.ndarray, soup: np.ndarray) -> Estimate:
    """autoEstCont on cells x genes counts, cluster codes 0..k-1 and the soup proportions."""
    k = int(codes.max()) + 1
    markers, n_tfidf = _markers(matrix, codes, k, soup)
    if not markers:
        return Estimate(None, None, [], 0, {}, n_tfidf)
    n_umis = np.asarray(matrix.sum(axis=1)).ravel()
    counts = matrix[:, markers].toarray()  # cells x markers
    high = max(CONTAMINATION_RANGE)
    expected = np.outer(n_umis * high, soup[markers])
    q = np.apply_along_axis(false_discovery_control, 0, stats.poisson.sf(counts - 1, expected))
    lowest = np.full((k, len(markers)), np.inf)  # per cluster, the lowest q of its cells
    np.minimum.at(lowest, codes, q)
    usable = lowest >= RHO_MAX_FDR  # clusters x markers: surely not expressed there
    clustered = _cluster_sums(matrix[:, markers], codes, k)
    cluster_umis = np.bincount(codes, n_umis, minlength=k)
    expected_cluster = np.outer(cluster_umis, soup[markers])
    obs, exp = clustered[usable], expected_cluster[usable]
    per_marker = {
        markers[j]: float(
            clustered[usable[:, j], j].sum() / expected_cluster[usable[:, j], j].sum()
        )
        for j in range(len(markers))
        if usable[:, j].any()
    }
    if not len(obs):
        return Estimate(None, None, markers, 0, per_marker, n_tfidf)
    v2 = (PRIOR_RHO_SD / PRIOR_RHO) ** 2
    shape = 1 + v2**-2 / 2 * (1 + np.sqrt(1 + 4 * v2))  # SoupX's own expression, kept as it is
    theta = PRIOR_RHO / (shape - 1)
    probes = np.round(np.arange(0, 1001) / 1000, 3)
    posterior = stats.gamma.pdf(
        probes[:, None], shape + obs[None, :], scale=(theta / (1 + theta * exp))[None, :]
    ).mean(axis=1)
    low, high = CONTAMINATION_RANGE
    inside = (probes >= low) & (probes <= high)
    grid, density = probes[inside], posterior[inside]
    rho = float(grid[np.argmax(density)])
    half = grid[density >= density.max() / 2]
    return Estimate(rho, (float(half.min()), float(half.max())), markers, len(obs),
                    per_marker, n_tfidf)  # fmt: skip


def round_to_int(matrix: sparse.csr_matrix, rng: np.random.Generator) -> sparse.csr_matrix:
    """adjustCounts' roundToInt: each value down to its integer, then up by one with the
    probability of its fraction (seeded), so that totals are kept on average."""
    floor = np.floor(matrix.data)
    out = matrix.copy()
    out.data = floor + (rng.random(len(floor)) < matrix.data - floor)
    out.eliminate_zeros()
    return out


def subtract(
    matrix: sparse.csr_matrix, codes: np.ndarray, soup: np.ndarray, rho: float
) -> sparse.csr_matrix:
    """adjustCounts(method='subtraction', clusters) with one rho for every cell: the counts
    less the soup, cells x genes."""
    k = int(codes.max()) + 1
    n_umis = np.asarray(matrix.sum(axis=1)).ravel()
    clustered = sparse.csr_matrix(_cluster_sums(matrix, codes, k))
    cluster_umis = np.bincount(codes, n_umis, minlength=k)
    # cluster level: nUMIs x rho soup counts over the genes it holds, by the soup profile
    rows = np.repeat(np.arange(k), np.diff(clustered.indptr))
    removed = alloc(cluster_umis * rho, clustered.data, soup[clustered.indices], rows)
    soup_of = sparse.csr_matrix(
        (removed, clustered.indices, clustered.indptr), shape=clustered.shape
    )
    # cell level: each (cluster, gene)'s soup over the cluster's cells holding the gene
    coo = matrix.tocoo()
    pair = codes[coo.row].astype(np.int64) * matrix.shape[1] + coo.col
    ids, bucket_set = np.unique(pair, return_inverse=True)
    target = np.asarray(soup_of[ids // matrix.shape[1], ids % matrix.shape[1]]).ravel()
    weights = (n_umis * rho)[coo.row]
    cell_soup = alloc(target, coo.data.astype(float), weights, bucket_set)
    corrected = np.maximum(coo.data - cell_soup, 0.0)
    out = sparse.csr_matrix((corrected, (coo.row, coo.col)), shape=matrix.shape)
    out.eliminate_zeros()
    return out


def describe(estimate: Estimate, names: Any, soup: np.ndarray, top: int = 10) -> dict[str, Any]:
    """The estimate's evidence for a result: markers with their rho, the posterior's width."""
    return {
        "markers_tfidf": estimate.n_markers_tfidf,
        "markers_used": len(estimate.markers),
        "estimates": estimate.estimates,
        "rho_fwhm": list(estimate.fwhm) if estimate.fwhm else None,
        "marker_rho": {
            str(names[g]): round(r, 4) for g, r in list(estimate.per_marker.items())[:top]
        },
        "soup_top_genes": {
            str(names[g]): round(float(soup[g]), 5) for g in np.argsort(-soup)[:top]
        },
    }
