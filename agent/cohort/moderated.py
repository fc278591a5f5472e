"""limma's moderated t and F statistics (Smyth 2004), as `lmFit` + `eBayes(robust=FALSE)` compute
them, for a handful of features: the cell types of the composition test (agent/cohort/composition.py).

Each feature (column of ``y``) gets an ordinary least-squares fit of the design; its residual
variance is squeezed towards a prior fitted to all features' variances (`fitFDist`: a scaled F
distribution by the method of moments on log variances), which lends the few samples of each
feature the others' information. Written after limma 3.54's `fitFDist`, `trigammaInverse`,
`squeezeVar` and `eBayes`; tests/test_cohort_composition.py compares it with limma itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import special, stats


def trigamma_inverse(x: float) -> float:
    """y with trigamma(y) = x: limma's Newton iteration from 0.5 + 1/x."""
    if x > 1e7:
        return 1 / np.sqrt(x)
    if x < 1e-6:
        return 1 / x
    y = 0.5 + 1 / x
    for _ in range(50):
        tri = special.polygamma(1, y)
        dif = tri * (1 - tri / x) / special.polygamma(2, y)
        y += dif
        if -dif / y < 1e-8:
            break
    return float(y)


def fit_f_dist(variances: np.ndarray, df: float) -> tuple[float, float]:
    """The prior (scale s0², degrees of freedom d0) of ``variances`` with ``df`` residual degrees
    of freedom each, as limma's fitFDist without covariate; d0 is infinite where the variances
    vary no more than sampling alone would make them."""
    x = np.asarray(variances, dtype=float)
    x = x[np.isfinite(x) & (x > -1e-15)]
    if len(x) < 2:
        return (float(x[0]) if len(x) else float("nan")), 0.0
    x = np.maximum(x, 0)
    m = float(np.median(x)) or 1.0  # limma: more than half exactly zero, eBayes unreliable
    x = np.maximum(x, 1e-5 * m)
    e = np.log(x) - special.digamma(df / 2) + np.log(df / 2)
    mean = float(e.mean())
    var = float(((e - mean) ** 2).sum() / (len(e) - 1)) - float(special.polygamma(1, df / 2))
    if var > 0:
        d0 = 2 * trigamma_inverse(var)
        return float(np.exp(mean + special.digamma(d0 / 2) - np.log(d0 / 2))), d0
    return float(x.mean()), float("inf")  # limma since 2017: the pooled variance, its MLE here


@dataclass(frozen=True)
class Moderated:
    """Per feature: the tested coefficients, the moderated statistic and its p-value."""

    coefficients: np.ndarray  # features x tested coefficients
    statistic: np.ndarray  # moderated t (one coefficient) or F (several)
    p_value: np.ndarray
    df_prior: float
    var_prior: float
    df_total: np.ndarray


def moderated_test(y: np.ndarray, design: np.ndarray, tested: list[int]) -> Moderated:
    """Moderated t (one coefficient in ``tested``) or F (several: limma's classifyTestsF over
    them, the moderated ANOVA of a factor) of each column of ``y`` (samples x features) on the
    columns ``tested`` of ``design`` (samples x coefficients, full rank)."""
    y = np.asarray(y, dtype=float)
    n, p = design.shape
    df = n - p
    if df < 1:
        raise ValueError(f"{n} samples for {p} coefficients: no residual degrees of freedom")
    unscaled = np.linalg.inv(design.T @ design)
    beta = unscaled @ design.T @ y
    residual = y - design @ beta
    s2 = (residual**2).sum(axis=0) / df
    var_prior, df_prior = fit_f_dist(s2, df)
    if np.isfinite(df_prior):
        s2_post = (df * s2 + df_prior * var_prior) / (df + df_prior)
    else:
        s2_post = np.full_like(s2, var_prior)
    # limma caps the total at the pooled residual degrees of freedom
    df_total = np.minimum(np.full_like(s2, df + df_prior), df * y.shape[1])
    coef = beta[tested].T
    if len(tested) == 1:
        t = coef[:, 0] / np.sqrt(unscaled[tested[0], tested[0]] * s2_post)
        return Moderated(coef, t, 2 * stats.t.sf(np.abs(t), df_total), df_prior, var_prior,
                         df_total)  # fmt: skip
    inner = np.linalg.inv(unscaled[np.ix_(tested, tested)])
    r = len(tested)
    f = np.einsum("fi,ij,fj->f", coef, inner, coef) / (r * s2_post)
    # limma's F takes df.residual + df.prior uncapped (classifyTestsF), chi-square above 1e6
    df2 = df + df_prior
    p = stats.chi2.sf(r * f, r) if df2 > 1e6 else stats.f.sf(f, r, df2)
    return Moderated(coef, f, p, df_prior, var_prior, np.full_like(s2, df2))
