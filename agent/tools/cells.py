"""Cell calling on unfiltered droplet matrices: the knee rule and EmptyDrops.

A raw (unfiltered) droplet matrix holds every barcode that caught an RNA molecule: tens of
thousands of empty droplets with a few ambient UMIs each, and the cells. Whether the input is one
is decided from its counts (how many barcodes, how many at or below the ambient bound, the ranked
curve's knee), never from its file name. Cells are then called as DropletUtils' ``emptyDrops``
does (Lun et al. 2019, Genome Biology 20:63, doi:10.1186/s13059-019-1662-y): barcodes at or below
``LOWER`` UMIs estimate the ambient profile (Good-Turing proportions) and its Dirichlet-multinomial
dispersion; each barcode above it is tested against that profile with a Monte-Carlo p-value;
Benjamini-Hochberg FDR over the tested barcodes; barcodes at or above the knee are kept regardless.

The PyPI ports were read and not used: ``emptydrops`` 0.0.5 (2020) is Cell Ranger 3's multinomial
variant with fixed 90,000-partition and 1,000-UMI constants, densifying chunks, importing
pkg_resources; ``cell-filter`` 0.1.2 needs Python 3.13 and numba and takes the ambient pool from
fixed rank positions 45,000-90,000, which a matrix of fewer barcodes does not have.
"""

from __future__ import annotations

from typing import Annotated, Any

import numpy as np
from pydantic import Field
from scipy import sparse
from scipy.interpolate import make_smoothing_spline
from scipy.optimize import minimize_scalar
from scipy.special import gammaln
from scipy.stats import false_discovery_control

from agent.registry import ToolError, tool
from agent.tools.common import per_row
from agent.tools.io import MIN_CELLS
from agent.tools.session import Session

# DropletUtils' default: barcodes with at most this many UMIs are taken as empty (ambient pool).
LOWER = 100
# An unfiltered droplet matrix is mostly empty droplets; a filtered one (cells called upstream) is
# mostly cells. Under MIN_BARCODES barcodes a matrix is taken as called cells even when shallow
# (Seurat's pbmc_small: 80 cells, a third under 100 UMIs); no 10x raw matrix is that small.
MIN_BARCODES = 2_000
UNFILTERED_SHARE = 0.5
# The knee must stand clear of the ambient bound, else cells and empties are one continuum.
MIN_KNEE_RATIO = 2.0
# The curve's first ranks are ignored (a few huge barcodes bend it), as DropletUtils'
# barcodeRanks(exclude.from=50) does.
EXCLUDE_FROM = 50
MIN_CURVE_POINTS = 10  # fewer distinct totals above the bound cannot show a knee
TOP_AMBIENT_GENES = 10
CURVE_POINTS = 400  # points of the ranked curve kept in uns for the barcode-rank plot
BLOCK = 64  # Monte-Carlo iterations drawn at once: bounds memory at blocks x tested barcodes

Fdr = Annotated[float, Field(gt=0, lt=0.5)]
Iterations = Annotated[int, Field(ge=100, le=100_000)]


def barcode_ranks(totals: np.ndarray, lower: int = LOWER) -> dict[str, Any]:
    """Knee and inflection of the log-log ranked UMI curve as DropletUtils' barcodeRanks finds
    them, over barcodes above ``lower`` (unique totals at their mid ranks): the inflection is the
    steepest step past the first ranks, the knee the largest curvature of a smoothing spline
    between the flattest step before it and it."""
    ranked = np.sort(totals)[::-1]
    values, first, counts = np.unique(-ranked, return_index=True, return_counts=True)
    values, mid = -values, first + (counts + 1) / 2
    keep = values > lower
    found: dict[str, Any] = {"knee": None, "inflection": None}
    if keep.sum() < MIN_CURVE_POINTS:
        return found
    x, y = np.log10(mid[keep]), np.log10(values[keep])
    slope = np.diff(y) / np.diff(x)
    skip = min(len(slope) - 1, int((x <= np.log10(EXCLUDE_FROM)).sum()))
    right = skip + int(np.argmin(slope[skip:]))
    left = skip + int(np.argmax(slope[skip : right + 1]))
    found["inflection"] = round(10 ** y[right])
    if right - left < 4:  # a spline needs points to bend: no knee apart from the cliff
        found["knee"] = round(10 ** y[left])
        return found
    span = slice(left, right + 1)
    fit = make_smoothing_spline(x[span], y[span], lam=_lam(x[span]))
    d1, d2 = fit.derivative(1)(x[span]), fit.derivative(2)(x[span])
    found["knee"] = round(10 ** y[span][np.argmin(d2 / (1 + d1**2) ** 1.5)])
    return found


def _lam(x: np.ndarray) -> float:
    # DropletUtils fits smooth.spline(df=20); a roughness penalty scaled to the log-rank span
    # gives a comparable stiffness whatever the number of points (GCV follows every step).
    return 1e-4 * float(x[-1] - x[0]) ** 3


def good_turing(profile: np.ndarray) -> np.ndarray:
    """Proportions of an ambient count profile with Good's estimate of the unseen mass (singletons
    over total) shared by the genes never seen, so no gene has probability 0 (edgeR's
    goodTuringProportions, which emptyDrops uses, also smooths the seen frequencies)."""
    total = profile.sum()
    unseen = profile == 0
    p0 = max(int((profile == 1).sum()), 1) / total if unseen.any() else 0.0
    return np.where(unseen, p0 / max(int(unseen.sum()), 1), profile / total * (1 - p0))


def dm_loglik(matrix: sparse.csr_matrix, prop: np.ndarray, alpha: float) -> np.ndarray:
    """Dirichlet-multinomial log-probability of each row's counts (barcodes x genes)."""
    totals = per_row(matrix, "sum").astype(float)
    ap = alpha * prop[matrix.indices]
    terms = gammaln(matrix.data + ap) - gammaln(ap) - gammaln(matrix.data + 1.0)
    rows = np.repeat(np.arange(matrix.shape[0]), np.diff(matrix.indptr))
    per_barcode = np.bincount(rows, weights=terms, minlength=matrix.shape[0])
    return per_barcode + gammaln(totals + 1) + gammaln(alpha) - gammaln(totals + alpha)


def estimate_alpha(ambient: sparse.csr_matrix, prop: np.ndarray) -> float:
    """The Dirichlet scale that maximises the ambient barcodes' likelihood (emptyDrops' alpha);
    the upper bound is a multinomial in all but name."""
    fit = minimize_scalar(
        lambda log_alpha: -dm_loglik(ambient, prop, 10.0**log_alpha).sum(),
        bounds=(-2.0, 7.0),
        method="bounded",
    )
    return float(10.0**fit.x)


def mc_pvalues(
    totals: np.ndarray,
    observed: np.ndarray,
    prop: np.ndarray,
    alpha: float,
    iterations: int,
    rng: np.random.Generator,
) -> np.ndarray:
    """Monte-Carlo p-values of observed log-probabilities under the Dirichlet-multinomial null:
    each iteration draws its own ambient profile (Gamma(alpha * p) per gene, as DropletUtils'
    montecarlo_pval does), then one barcode from it UMI by UMI up to the largest total, and scores
    every prefix by the same likelihood (one draw serves every total).
    p = (1 + #sim <= obs) / (iterations + 1)."""
    unique, inverse = np.unique(totals, return_inverse=True)
    longest = int(unique[-1])
    ap = alpha * prop
    n = np.arange(1, longest + 1, dtype=float)
    per_draw = np.log(n) - np.log(n - 1 + alpha)
    # numpy sorts 16-bit keys by radix: ten times faster than a comparison sort at 30k genes
    key = np.uint16 if len(prop) <= np.iinfo(np.uint16).max else np.int32
    below = np.zeros(len(totals), dtype=np.int64)
    for start in range(0, iterations, BLOCK):
        block = min(BLOCK, iterations - start)
        genes = _draw_genes(rng.standard_gamma(ap, size=(block, len(ap))), longest, rng)
        genes = genes.astype(key)
        k = _occurrence(genes)
        steps = per_draw + np.log(k - 1 + ap[genes]) - np.log(k)
        simulated = np.cumsum(steps, axis=1)[:, unique - 1]
        below += (simulated[:, inverse] <= observed).sum(axis=0)
    return (below + 1) / (iterations + 1)


def _draw_genes(weights: np.ndarray, length: int, rng: np.random.Generator) -> np.ndarray:
    """``length`` genes drawn in order from each row's weights (rows: iterations), by inverse CDF:
    the rows' CDFs laid end to end (row r shifted by r) serve one binary search for all draws."""
    rows, genes = weights.shape
    shift = np.arange(rows)[:, None]
    cumulative = np.cumsum(weights, axis=1)
    cumulative = cumulative / cumulative[:, -1:] + shift
    uniform = rng.random((rows, length)) + shift
    found = np.searchsorted(cumulative.ravel(), uniform.ravel(), "right").reshape(rows, length)
    return np.minimum(found - shift * genes, genes - 1)


def _occurrence(genes: np.ndarray) -> np.ndarray:
    """For each draw (rows: iterations), how often its gene was drawn in its row so far,
    itself included."""
    rows, length = genes.shape
    order = np.argsort(genes, axis=1, kind="stable")
    ranked = np.take_along_axis(genes, order, axis=1).ravel()
    new = np.empty(ranked.size, bool)
    new[0] = True
    np.not_equal(ranked[1:], ranked[:-1], out=new[1:])
    new[::length] = True  # each row starts its own runs
    position = np.arange(ranked.size)
    run_start = np.maximum.accumulate(np.where(new, position, 0))
    k = np.empty(ranked.size)
    k[(order + np.arange(rows)[:, None] * length).ravel()] = position - run_start + 1
    return k.reshape(rows, length)


def _curve(totals: np.ndarray, cells: np.ndarray) -> dict[str, list[Any]]:
    """The ranked curve at log-spaced ranks, small enough for uns and the barcode-rank plot, with
    whether the barcode at each rank was kept (EmptyDrops' calls are not monotone in the total)."""
    order = np.argsort(-totals, kind="stable")
    ranks = np.unique(np.geomspace(1, len(totals), CURVE_POINTS).astype(int))
    return {
        "rank": ranks.tolist(),
        "total": totals[order][ranks - 1].astype(float).tolist(),
        "cell": cells[order][ranks - 1].tolist(),
    }


def _evidence(totals: np.ndarray, lower: int) -> dict[str, Any]:
    ranks = barcode_ranks(totals, lower)
    low = totals <= lower
    return {
        "barcodes": len(totals),
        "low_count_barcodes": int(low.sum()),
        "share_low_count": round(float(low.mean()), 4),
        "lower": lower,
        "knee": ranks["knee"],
        "inflection": ranks["inflection"],
        "barcodes_above_knee": int((totals >= ranks["knee"]).sum()) if ranks["knee"] else 0,
        "median_counts": float(np.median(totals)),
    }


def _storable(value: Any) -> Any:
    """``value`` without its None entries (a knee not found): h5ad cannot store None."""
    if isinstance(value, dict):
        return {k: _storable(v) for k, v in value.items() if v is not None}
    return value


RULE = (
    f"unfiltered when at least {MIN_BARCODES:,} barcodes and at least {UNFILTERED_SHARE:.0%} of "
    f"them with <= lower UMIs; cells: total >= knee (retain), or EmptyDrops FDR <= fdr among "
    "barcodes above lower"
)


@tool("cell_calling", needs=("load_data",), expensive=True)
def call_cells(
    session: Session,
    fdr: Fdr = 0.001,
    iterations: Iterations = 10_000,
    lower: Annotated[int, Field(ge=10, le=1_000)] = LOWER,
) -> dict[str, Any]:
    """Decide from the counts whether the input is an unfiltered droplet matrix and, if so, keep
    only the barcodes that hold cells; a filtered input passes through unchanged.

    Evidence: number of barcodes, share with at most `lower` UMIs, knee and inflection of the
    ranked UMI curve. Unfiltered: cells are barcodes at or above the knee plus those EmptyDrops
    (Lun et al. 2019) finds unlike the ambient profile of the low-count barcodes at the given FDR.
    An input whose cells cannot be told from empty droplets is refused. Call it right after
    load_data.

    Args:
        fdr: Benjamini-Hochberg FDR at or below which a tested barcode is a cell (0.001, as the
            DropletUtils authors recommend).
        iterations: Monte-Carlo iterations of the EmptyDrops p-values.
        lower: Barcodes with at most this many UMIs form the ambient pool and are never cells.
    """
    adata = session.adata
    matrix = sparse.csr_matrix(adata.X)
    totals = per_row(matrix, "sum").round().astype(np.int64)
    evidence = _evidence(totals, lower)
    record: dict[str, Any] = {"evidence": evidence, "rule": RULE}
    if len(totals) < MIN_BARCODES or evidence["share_low_count"] < UNFILTERED_SHARE:
        record["decision"] = "filtered"
        record["reason"] = (
            f"filtered: {len(totals):,} barcodes, {evidence['share_low_count']:.1%} with <= "
            f"{lower} UMIs, median {evidence['median_counts']:g} UMIs: cells called upstream; "
            "nothing removed"
        )
        adata.uns["cell_calling"] = _storable(record)
        return record | {"n_cells": adata.n_obs}
    knee = evidence["knee"]
    prefix = (
        f"call_cells: {len(totals):,} barcodes, {evidence['share_low_count']:.1%} with <= {lower} "
        "UMIs, as in an unfiltered droplet matrix"
    )
    if knee is None or knee < MIN_KNEE_RATIO * lower:
        shape = (
            f"its knee lies at {knee} UMIs"
            if knee
            else f"fewer than {MIN_CURVE_POINTS} distinct totals lie above {lower} UMIs"
        )
        raise ToolError(
            f"{prefix}, but the ranked UMI curve has no knee clear of the ambient bound ({shape}; "
            f"cells need one at {MIN_KNEE_RATIO:g} x {lower} UMIs or more): cells cannot be told "
            "from empty droplets; give a matrix of called cells (Cell Ranger's "
            "filtered_feature_bc_matrix) or a deeper sample"
        )
    genes = per_row(matrix.T.tocsr(), "sum") > 0  # DropletUtils drops genes never seen
    matrix = matrix[:, genes]
    ambient = totals <= lower
    pool = matrix[ambient & (totals > 0)]
    profile = per_row(pool.T.tocsr(), "sum")
    prop = good_turing(profile)
    alpha = estimate_alpha(pool, prop)
    tested = totals > lower
    retained = totals >= knee
    to_test = tested & ~retained
    pvalues = np.zeros(len(totals))
    rng = np.random.default_rng(session.seed)
    if to_test.any():
        observed = dm_loglik(matrix[to_test], prop, alpha)
        pvalues[to_test] = mc_pvalues(totals[to_test], observed, prop, alpha, iterations, rng)
    fdrs = np.ones(len(totals))
    fdrs[tested] = false_discovery_control(pvalues[tested], method="bh")
    cells = tested & (fdrs <= fdr)
    # a p-value at its floor that misses the FDR could pass with more iterations
    limited = int((to_test & (pvalues <= 1 / (iterations + 1)) & ~cells).sum())
    if cells.sum() < MIN_CELLS:
        raise ToolError(
            f"{prefix}, but only {int(cells.sum())} barcodes differ from the ambient profile "
            f"(FDR <= {fdr}; knee {knee} UMIs): fewer than the {MIN_CELLS} cells an analysis "
            "needs; is this a sample without cells?"
        )
    names = np.asarray(adata.var_names)[genes]
    top = np.argsort(prop)[::-1][:TOP_AMBIENT_GENES]
    record.update(
        decision="unfiltered",
        method="EmptyDrops (Lun et al. 2019, DropletUtils) with the knee as retain",
        fdr_threshold=fdr,
        lower=lower,
        retain=knee,
        iterations=iterations,
        seed=session.seed,
        alpha=round(alpha, 4),
        ambient={
            "barcodes": int((ambient & (totals > 0)).sum()),
            "umis": int(profile.sum()),
            "top_genes": {str(names[g]): round(float(prop[g]), 5) for g in top},
        },
        barcodes_tested=int(tested.sum()),
        barcodes_retained=int(retained.sum()),
        barcodes_called=int((cells & ~retained).sum()),
        limited=limited,
        n_cells=int(cells.sum()),
        median_genes_per_cell=float(np.median(per_row(matrix[cells], "nnz"))),
        curve=_curve(totals, cells),
        called_totals={"min": int(totals[cells].min()), "max": int(totals[cells].max())},
    )
    record["reason"] = (
        f"unfiltered: {len(totals):,} barcodes, {evidence['share_low_count']:.1%} with <= {lower} "
        f"UMIs; kept {int(cells.sum()):,} cells ({int(retained.sum()):,} at or above the knee of "
        f"{knee} UMIs, {record['barcodes_called']:,} called by EmptyDrops at FDR <= {fdr})"
    )
    kept = adata[cells].copy()
    kept.obs["empty_drops_fdr"] = fdrs[cells]
    kept.uns["cell_calling"] = _storable(record)
    session.adata = kept
    return {k: v for k, v in record.items() if k != "curve"}
