"""EmptyDrops and barcodeRanks as DropletUtils computes them (Lun et al. 2019, Genome Biology
20:63, doi:10.1186/s13059-019-1662-y), in Python; the tool that uses them is agent/tools/cells.py.

Each piece follows DropletUtils 1.18 (R/emptyDrops.R, R/ambientProfileEmpty.R,
R/barcodeRanks.R, src/montecarlo_pval.cpp) and the code it calls:

- the ambient profile: the summed counts of the barcodes with at most ``lower`` UMIs, made
  proportions by edgeR's ``goodTuringProportions`` (Gale and Sampson's simple Good-Turing, as
  edgeR's good_turing.c computes it), a pseudo-count where that leaves zeros;
- alpha, the Dirichlet-multinomial scale: the maximum-likelihood value on those barcodes within
  DropletUtils' interval (0.01, 10,000), found by Brent's method as R's ``optimize`` does;
- p-values: (1 + simulations scoring at or below the barcode) / (iterations + 1), each
  simulation a Dirichlet-multinomial draw from the ambient profile scored by the same likelihood;
  DropletUtils draws a Gamma profile per iteration and then the UMIs, here the same distribution
  comes from Polya's urn (a UMI is new from the profile with probability alpha / (alpha + n),
  else a copy of an earlier one), which needs no Gamma draw per gene; compiled by numba (which
  scanpy depends on), as DropletUtils' loop is C++;
- Benjamini-Hochberg over the barcodes above ``lower``, those at or above ``retain`` counted as p=0;
- the knee and inflection of the ranked curve as ``barcodeRanks`` finds them, the knee from R's
  ``smooth.spline(df=20)`` (its knots, penalty and degrees of freedom) between the plateau and
  the inflection.

Where DropletUtils leaves the iterations to the user ("if any barcodes have Limited=TRUE but do
not reject the null, niters should be increased"), ``empty_drops`` raises them tenfold itself,
the last step to ``max_iterations`` itself, until none is left or ``max_iterations`` are done,
and says how many it used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numba
import numpy as np
from scipy import sparse
from scipy.interpolate import BSpline
from scipy.linalg import cho_factor, cho_solve
from scipy.optimize import minimize_scalar
from scipy.special import gammaln
from scipy.stats import false_discovery_control

from agent.tools.common import per_row

LOWER = 100  # DropletUtils' default: barcodes with at most this many UMIs are empty
EXCLUDE_FROM = 50  # barcodeRanks: the first ranks (a few huge barcodes) bend no edge
SPLINE_DF = 20  # barcodeRanks' smooth.spline degrees of freedom
ALPHA_INTERVAL = (0.01, 10_000.0)  # DropletUtils' .estimate_alpha search interval
R_OPTIMIZE_TOL = np.finfo(float).eps ** 0.25  # R's optimize() default tolerance
GOOD_TURING_CONF = 1.96  # edgeR goodTuring's confidence factor
ESCALATION = 10  # iterations grow tenfold while limited barcodes miss the FDR


# --- the ranked curve (barcodeRanks) -------------------------------------------------------------


def barcode_ranks(totals: np.ndarray, lower: int = LOWER) -> dict[str, float | None]:
    """Knee and inflection of the log-log ranked-total curve over the barcodes above ``lower``
    (unique totals at their mid ranks), as DropletUtils' barcodeRanks: the inflection is the
    total where the numerical slope is steepest past the first ``EXCLUDE_FROM`` ranks; the knee
    is where the signed curvature of a smoothing spline (df 20) is lowest, fitted between the
    flattest step before the inflection and the inflection. None where fewer than 3 unique
    totals lie above ``lower`` (DropletUtils stops there)."""
    values, counts = np.unique(totals, return_counts=True)
    values, counts = values[::-1], counts[::-1]  # decreasing totals, as R's rle of sorted totals
    mid_rank = np.cumsum(counts) - (counts - 1) / 2
    keep = values > lower
    if keep.sum() < 3:
        return {"knee": None, "inflection": None}
    y, x = np.log10(values[keep].astype(float)), np.log10(mid_rank[keep])
    slope = np.diff(y) / np.diff(x)
    skip = min(len(slope) - 1, int((x <= np.log10(EXCLUDE_FROM)).sum()))
    right = skip + int(np.argmin(slope[skip:]))
    left = skip + int(np.argmax(slope[skip : right + 1]))
    inflection = float(10 ** y[right])
    if right - left + 1 < 4:  # DropletUtils' fallback: too few points to fit
        return {"knee": float(10 ** y[left]), "inflection": inflection}
    span = slice(left, right + 1)
    d1, d2 = smooth_spline_derivatives(x[span], y[span], SPLINE_DF)
    knee = float(10 ** y[span][np.argmin(d2 / (1 + d1**2) ** 1.5)])
    return {"knee": knee, "inflection": inflection}


def _r_knot_count(n: int) -> int:
    """R's .nknots.smspl: inner knots of smooth.spline for n unique x."""
    if n < 50:
        return n
    a1, a2, a3, a4 = np.log2([50, 100, 140, 200])
    if n < 200:
        return int(2 ** (a1 + (a2 - a1) * (n - 50) / 150))
    if n < 800:
        return int(2 ** (a2 + (a3 - a2) * (n - 200) / 600))
    if n < 3200:
        return int(2 ** (a3 + (a4 - a3) * (n - 800) / 2400))
    return int(200 + (n - 3200) ** 0.2)


def _r_seq(start: float, end: float, length: int) -> np.ndarray:
    """R's seq.int(start, end, length.out=length), bit for bit: the knots' indices are these
    values truncated, so a value a rounding below an integer must be the one R computes."""
    i = np.arange(length, dtype=float)
    by = (end - start) / (length - 1)
    out = np.where(i < length // 2, start + i * by, end - (length - 1 - i) * by)
    out[0], out[-1] = start, end
    return out


def smooth_spline_derivatives(x: np.ndarray, y: np.ndarray, df: float) -> tuple[np.ndarray, ...]:
    """First and second derivatives at ``x`` (increasing, unique) of R's ``smooth.spline(x, y,
    df=df)``: a cubic B-spline on R's knots with the penalty on the integrated squared second
    derivative, whose weight (R's spar) makes the smoother's trace ``df`` (derivatives within
    0.2% of R's from 30 to 1,000 points). Where ``df`` exceeds the points R falls back to
    generalised cross-validation, as here; that criterion is flat and noisy near interpolation,
    where R's search and this one may stop at different minima."""
    n, width = len(x), x[-1] - x[0]
    scaled = (x - x[0]) / width
    inner = scaled[np.trunc(_r_seq(1, n, _r_knot_count(n))).astype(int) - 1]
    knots = np.r_[[0.0] * 3, inner, [1.0] * 3]
    n_basis = len(inner) + 2
    identity = np.eye(n_basis)
    design = BSpline(knots, identity, 3)(scaled)
    gram, xty = design.T @ design, design.T @ y
    penalty = _penalty(knots, identity)
    inside = slice(2, n_basis - 3)  # R's trace ratio leaves out the three outer basis functions
    ratio = np.trace(gram[inside, inside]) / np.trace(penalty[inside, inside])

    def fit(spar: float) -> tuple[np.ndarray, float, float]:
        factor = cho_factor(gram + ratio * 256.0 ** (3 * spar - 1) * penalty)
        coef = cho_solve(factor, xty)
        trace = float((design * cho_solve(factor, design.T).T).sum())
        return coef, trace, float(((y - design @ coef) ** 2).sum())

    def criterion(spar: float) -> float:
        _, trace, rss = fit(spar)
        if 1 < df <= n:
            return 3 + (df - trace) ** 2
        return rss / n / (1 - trace / n) ** 2

    # R's sbart searches spar on [-1.5, 1.5] by Brent's method to tolerance 1e-4
    best = minimize_scalar(criterion, bounds=(-1.5, 1.5), method="bounded",
                           options={"xatol": 1e-4})  # fmt: skip
    spline = BSpline(knots, fit(best.x)[0], 3)
    return spline.derivative(1)(scaled) / width, spline.derivative(2)(scaled) / width**2


def _penalty(knots: np.ndarray, identity: np.ndarray) -> np.ndarray:
    """The integrals of products of the basis' second derivatives (R's sgram): those are linear
    on each knot interval, so two Gauss-Legendre points per interval are exact."""
    edges = np.unique(knots)
    nodes, weights = np.polynomial.legendre.leggauss(2)
    half = np.diff(edges) / 2
    points = ((edges[:-1] + edges[1:]) / 2)[:, None] + half[:, None] * nodes
    second = BSpline(knots, identity, 3).derivative(2)(points.ravel())
    w = (half[:, None] * weights).ravel()
    return second.T @ (second * w[:, None])


# --- the ambient profile and its dispersion ------------------------------------------------------


def good_turing_proportions(profile: np.ndarray) -> np.ndarray:
    """edgeR's goodTuringProportions of one count vector (simple Good-Turing, Gale and Sampson
    1995): seen genes get their smoothed frequency's share, unseen genes share the estimated
    unseen mass; DropletUtils' .safe_good_turing gives the unseen genes 1/total where that mass
    is zero (no gene seen once)."""
    counts = np.rint(profile).astype(np.int64)
    seen = counts > 0
    observed, frequency = np.unique(counts[seen], return_counts=True)
    if len(observed) < 2:  # the log-log regression needs two counts (edgeR's would give NaN)
        raise ValueError(
            f"the ambient profile ({counts.sum()} UMIs over {int(seen.sum())} genes) is too "
            "small to estimate: every gene seen in it was seen equally often"
        )
    p_unseen, per_count = _simple_good_turing(observed, frequency)
    prop = np.zeros(len(counts))
    prop[seen] = per_count[np.searchsorted(observed, counts[seen])]
    if (~seen).any():
        prop[~seen] = p_unseen / int((~seen).sum())
    zero = prop <= 0
    if zero.any():
        pseudo = 1 / counts.sum()
        prop[zero] = pseudo / int(zero.sum())
        prop[~zero] *= 1 - pseudo
    return prop


def _simple_good_turing(r: np.ndarray, n: np.ndarray) -> tuple[float, np.ndarray]:
    """edgeR's good_turing.c: the unseen mass and the proportion of one item seen r times, for
    the sorted counts ``r`` seen ``n`` times each. Turing's estimate (r+1) n_{r+1} / n_r is used
    while it differs from the log-log regression's by more than its confidence bound; from the
    first count where it does not (or r+1 is not seen), the regression's."""
    r_f, n_f = r.astype(float), n.astype(float)
    previous = np.r_[0.0, r_f[:-1]]
    spacing = np.r_[r_f[1:], 0.0] - previous
    spacing[-1] = 2 * (r_f[-1] - previous[-1])
    log_r, log_z = np.log(r_f), np.log(2 * n_f) - np.log(spacing)
    k = len(r)
    mean_x, mean_y = log_r.mean(), log_z.mean()
    slope = (np.dot(log_r, log_z) - mean_x * mean_y * k) / (np.dot(log_r, log_r) - mean_x**2 * k)
    p0 = float(n[0] / np.dot(r_f, n_f)) if r[0] == 1 else 0.0
    smoothed = (r_f + 1) * np.exp(slope * (np.log(r_f + 1) - log_r))
    adjacent = np.r_[r[1:] == r[:-1] + 1, False]
    next_n = np.r_[n_f[1:], 1.0]
    turing = (r_f + 1) * next_n / n_f
    bound = GOOD_TURING_CONF * turing * np.sqrt(1 / next_n + 1 / n_f)
    use_turing = adjacent & (np.abs(turing - smoothed) > bound)
    switch = int(np.argmin(use_turing)) if not use_turing.all() else k  # first not Turing
    estimate = np.where(np.arange(k) < switch, turing, smoothed)
    return p0, estimate * (1 - p0) / np.dot(estimate, n_f)


def dm_loglik(matrix: sparse.csr_matrix, prop: np.ndarray, alpha: float) -> np.ndarray:
    """The part of each row's Dirichlet-multinomial log-probability (barcodes x genes counts,
    ambient proportions scaled by alpha) that depends on more than its total: DropletUtils'
    obs.P, which its simulations are scored by; the rest is the same for a total's draws."""
    ap = alpha * prop[matrix.indices]
    terms = gammaln(matrix.data + ap) - gammaln(ap) - gammaln(matrix.data + 1.0)
    rows = np.repeat(np.arange(matrix.shape[0]), np.diff(matrix.indptr))
    return np.bincount(rows, weights=terms, minlength=matrix.shape[0])


def estimate_alpha(pool: sparse.csr_matrix, prop: np.ndarray) -> float:
    """DropletUtils' .estimate_alpha: the Dirichlet scale maximising the ambient barcodes'
    likelihood within (0.01, 10,000), by R optimize's algorithm and tolerance. Only the terms
    that depend on alpha are summed, each distinct (gene, count) pair once."""
    genes = pool.indices.astype(np.int64)
    pairs, weight = np.unique(genes * (int(pool.data.max()) + 1) + pool.data.astype(np.int64),
                              return_counts=True)  # fmt: skip
    gene, count = np.divmod(pairs, int(pool.data.max()) + 1)
    totals, n_totals = np.unique(per_row(pool, "sum"), return_counts=True)

    def minus_loglik(alpha: float) -> float:
        ap = alpha * prop[gene]
        per_pair = gammaln(count + ap) - gammaln(ap)
        per_total = gammaln(totals + alpha) - gammaln(alpha)
        return float(np.dot(n_totals, per_total) - np.dot(weight, per_pair))

    fit = minimize_scalar(minus_loglik, bounds=ALPHA_INTERVAL, method="bounded",
                          options={"xatol": R_OPTIMIZE_TOL})  # fmt: skip
    return float(fit.x)


# --- the Monte-Carlo p-values ----------------------------------------------------------------------


def count_at_or_below(
    totals: np.ndarray,
    observed: np.ndarray,
    prop: np.ndarray,
    alpha: float,
    iterations: int,
    rng: np.random.Generator,
) -> np.ndarray:
    """For each barcode (its total UMIs and ``dm_loglik``), how many of ``iterations``
    Dirichlet-multinomial draws from the ambient profile, of the same total, score at or below
    it (DropletUtils' n.above). One draw of the largest total serves every total: its prefixes
    are draws of every smaller one."""
    order = np.lexsort((observed, totals))  # by total, then score, as DropletUtils orders them
    run_totals, run_lengths = np.unique(totals[order], return_counts=True)
    accept, alias = _alias_table(prop)
    counted = _monte_carlo(
        run_totals.astype(np.int64), run_lengths.astype(np.int64), observed[order].astype(float),
        alpha * prop, alpha, accept, alias, iterations, int(rng.integers(2**31)),
    )  # fmt: skip
    below = np.empty(len(totals), dtype=np.int64)
    below[order] = counted
    return below


def _alias_table(prop: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Walker's alias table of ``prop`` (Vose's construction): a gene is drawn in O(1) as column
    i = floor(u * G), kept when the fraction of u * G is below accept[i], else alias[i]."""
    n = len(prop)
    scaled = prop / prop.sum() * n
    accept, alias = np.ones(n), np.arange(n)
    small, large = list(np.flatnonzero(scaled < 1)), list(np.flatnonzero(scaled >= 1))
    while small and large:
        s, g = small.pop(), large[-1]
        accept[s], alias[s] = scaled[s], g
        scaled[g] -= 1 - scaled[s]
        if scaled[g] < 1:
            small.append(large.pop())
    return accept, alias


@numba.njit(cache=True)
def _monte_carlo(run_totals, run_lengths, observed, scale, alpha, accept, alias, iterations, seed):
    """montecarlo_pval.cpp's loop: per iteration, UMIs drawn one at a time up to the largest
    total, the score updated UMI by UMI, and at each total the barcodes of that total (sorted by
    score) scoring at or above the draw counted. DropletUtils draws a Gamma profile per iteration
    first; Polya's urn gives the same Dirichlet-multinomial draws without one Gamma per gene: UMI
    n+1 is new from the profile with probability alpha / (alpha + n), else a copy of one of the
    n before it."""
    np.random.seed(seed)
    n_genes, longest = len(scale), run_totals[-1]
    counts = np.zeros(n_genes, dtype=np.int64)
    drawn = np.empty(longest, dtype=np.int64)
    log_k = np.log(np.arange(1, longest + 1).astype(np.float64))
    log_scale = np.log(scale)
    starts = np.zeros(len(run_totals) + 1, dtype=np.int64)
    starts[1:] = np.cumsum(run_lengths)
    hits = np.zeros(len(observed), dtype=np.int64)
    for _ in range(iterations):
        score, run = 0.0, 0
        for n in range(longest):
            if np.random.random() * (alpha + n) < alpha:
                u = np.random.random() * n_genes
                column = int(u)
                gene = column if u - column < accept[column] else alias[column]
            else:
                gene = drawn[int(np.random.random() * n)]
            drawn[n] = gene
            k = counts[gene]
            counts[gene] = k + 1
            # the gene's (k+1)-th UMI: log((alpha p + k) / (k + 1)); the first from a table
            score += (log_scale[gene] if k == 0 else np.log(scale[gene] + k)) - log_k[k]
            if n + 1 == run_totals[run]:
                first, last = starts[run], starts[run + 1]
                higher = first + np.searchsorted(observed[first:last], score)
                if higher < last:
                    hits[higher] += 1
                run += 1
        for n in range(longest):
            counts[drawn[n]] = 0
    # a draw counted at the first barcode scoring at or above it counts for all above that
    for run in range(len(run_totals)):
        for i in range(starts[run] + 1, starts[run + 1]):
            hits[i] += hits[i - 1]
    return hits


# --- emptyDrops ------------------------------------------------------------------------------------


@dataclass
class EmptyDrops:
    """emptyDrops' output over all barcodes (NaN where not tested) and its metadata."""

    pvalue: np.ndarray
    fdr: np.ndarray
    limited: np.ndarray  # tested, below the knee, no simulation at or below it
    alpha: float
    prop: np.ndarray  # ambient proportions of the genes seen anywhere
    genes: np.ndarray  # which genes those are (boolean over the matrix's columns)
    profile: np.ndarray  # the ambient barcodes' summed counts of those genes
    iterations: int

    def called(self, fdr: float) -> np.ndarray:
        return np.nan_to_num(self.fdr, nan=1.0) <= fdr

    def stuck(self, fdr: float) -> int:
        """Barcodes at the Monte-Carlo floor that miss the FDR: more iterations could call them."""
        return int((self.limited & ~self.called(fdr)).sum())


def empty_drops(
    matrix: sparse.csr_matrix,
    totals: np.ndarray,
    lower: int,
    retain: float,
    fdr: float,
    iterations: int,
    max_iterations: int,
    rng: np.random.Generator,
) -> EmptyDrops:
    """DropletUtils' emptyDrops(m, lower, retain, niters) on integer counts (barcodes x
    genes), with ``niters`` raised tenfold from ``iterations`` while barcodes at the floor miss
    ``fdr``, the last step to ``max_iterations`` itself. The barcodes at or above ``retain`` enter
    the correction with p=0 and get no simulation (their p-values are reported NaN)."""
    if iterations > max_iterations:
        raise ValueError(f"iterations={iterations:,} exceed max_iterations={max_iterations:,}")
    genes = per_row(matrix.T.tocsr(), "sum") > 0  # DropletUtils drops genes never seen
    matrix = matrix[:, genes]
    ambient = totals <= lower
    pool = matrix[ambient & (totals > 0)]
    profile = per_row(pool.T.tocsr(), "sum")
    if profile.sum() == 0:
        raise ValueError(f"no barcode with 1-{lower} UMIs to estimate the ambient profile from")
    prop = good_turing_proportions(profile)
    alpha = estimate_alpha(pool, prop)
    tested = totals > lower
    simulate = tested & (totals < retain)
    observed = dm_loglik(matrix[simulate], prop, alpha)
    below = np.zeros(int(simulate.sum()), dtype=np.int64)
    done, target = 0, iterations
    while True:
        if simulate.any():
            below += count_at_or_below(totals[simulate], observed, prop, alpha, target - done, rng)
        done = target
        pvalue = np.full(len(totals), np.nan)
        pvalue[simulate] = (below + 1) / (done + 1)
        for_correction = np.where(tested & ~simulate, 0.0, pvalue)
        adjusted = np.full(len(totals), np.nan)
        adjusted[tested] = false_discovery_control(for_correction[tested], method="bh")
        limited = np.zeros(len(totals), bool)
        limited[simulate] = below == 0
        result = EmptyDrops(pvalue, adjusted, limited, alpha, prop, genes, profile, done)
        if result.stuck(fdr) == 0 or done >= max_iterations:
            return result
        target = min(target * ESCALATION, max_iterations)


def ambient_summary(result: EmptyDrops, names: Any, top: int) -> dict[str, Any]:
    """The ambient profile's size and its ``top`` genes with their proportions."""
    order = np.argsort(result.prop)[::-1][:top]
    kept = np.asarray(names)[result.genes]
    return {
        "umis": int(result.profile.sum()),
        "top_genes": {str(kept[g]): round(float(result.prop[g]), 5) for g in order},
    }
