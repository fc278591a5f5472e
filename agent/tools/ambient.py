"""Ambient RNA: each sample's contamination estimated and its counts corrected.

Where the empty droplets are at hand (an unfiltered input, whose soup call_cells keeps in
``var['ambient_counts']``, or the run's unfiltered matrix beside a filtered input), SoupX
(agent/tools/soupx.py): the soup profile from the droplets, one contamination fraction for the
sample from marker genes in clusters that cannot express them, counts corrected per cluster.
Otherwise DecontX, which needs no droplets (agent/tools/decontx.py): a Bayesian mixture of each
cell's cluster profile and the other clusters', a fraction per cell. Corrected counts are
rounded down, then up with the fraction's probability (seeded), so count models can read them.
Both read the analysis' own clusters, so the step comes after leiden. As nf-core/scdownstream
does by default (``ambient_corrected_integration`` false), the corrected counts are kept beside
the raw ones, in ``layers['decontaminated']``: the sample's markers and labels stay on the counts as measured, and the cohort steps may take either.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import numpy as np
import pandas as pd
from pydantic import Field
from scipy import sparse

from agent.checks import check
from agent.registry import Refusal, ToolError, tool
from agent.tools import decontx as dx
from agent.tools import soupx
from agent.tools.common import Key, counts_matrix, obs_column, quantiles
from agent.tools.io import read_matrix
from agent.tools.session import Session

LAYER = "decontaminated"
SOUP_COLUMN = "ambient_counts"  # var: per gene, the counts of the input's soup droplets
TOP_GENES = 10
# The genes most affected: the largest shares of their counts removed, among genes holding at
# least this share of the sample's counts (a gene of a few counts can lose them all by chance).
AFFECTED_MIN_SHARE = 1e-4


# The unfiltered matrix must name this share of the analysis' genes, in its gene names or one of
# its gene annotation columns (judged by content: whichever names the most).
MIN_GENES_MATCHED = 0.9


def _soup(session: Session, adata: Any) -> tuple[np.ndarray, str] | None:
    """The soup's counts per gene of the current genes, and where they come from: the input's
    droplets (call_cells kept them), else those of the run's unfiltered matrix (--raw-input);
    None where no empty droplets are at hand."""
    low, high = soupx.SOUP_RANGE
    said = f"droplets of {low + 1}-{high - 1} UMIs"
    if SOUP_COLUMN in adata.var:
        return adata.var[SOUP_COLUMN].to_numpy(dtype=float), f"the input's {said} (call_cells)"
    if session.raw_input is None:
        return None
    return _raw_soup(session.raw_input, adata.var_names), f"the {said} of {session.raw_input}"


def _raw_soup(path: Any, genes: Any) -> np.ndarray:
    """Per gene of ``genes``, the soup counts of the unfiltered matrix at ``path`` (genes sharing
    a name summed, as load_data merges them)."""
    try:
        raw, _ = read_matrix(path)
    except ToolError as e:
        raise ToolError(f"remove_ambient: the unfiltered matrix: {e}") from None
    matrix = sparse.csr_matrix(raw.X)
    totals = np.asarray(matrix.sum(axis=1)).ravel()
    counts = soupx.soup_counts(matrix, totals)
    if counts.sum() <= 0:
        raise ToolError(
            f"remove_ambient: {path} has no droplet of {soupx.SOUP_RANGE[0] + 1}-"
            f"{soupx.SOUP_RANGE[1] - 1} UMIs: it is not an unfiltered droplet matrix"
        )
    namings = [raw.var_names.astype(str)] + [
        raw.var[c].astype(str) for c in raw.var.columns if raw.var[c].dtype == object
    ]
    wanted = pd.Index(genes.astype(str))
    best = max(namings, key=lambda names: wanted.isin(names).sum())
    matched = float(wanted.isin(best).mean())
    if matched < MIN_GENES_MATCHED:
        raise ToolError(
            f"remove_ambient: {path} names {matched:.0%} of the analysis' genes (at least "
            f"{MIN_GENES_MATCHED:.0%} needed): is it this sample's unfiltered matrix?"
        )
    summed = pd.Series(counts).groupby(np.asarray(best)).sum()
    return summed.reindex(wanted).fillna(0.0).to_numpy(dtype=float)


def _affected(counts: Any, corrected: Any, names: Any) -> dict[str, dict[str, float]]:
    """The genes that lost the largest shares of their counts (AFFECTED_MIN_SHARE), with the
    counts and share removed."""
    before = np.asarray(counts.sum(axis=0)).ravel()
    removed = before - np.asarray(corrected.sum(axis=0)).ravel()
    enough = before >= AFFECTED_MIN_SHARE * before.sum()
    share = np.where(enough, removed / np.maximum(before, 1), -1.0)
    return {
        str(names[g]): {"removed": round(float(removed[g]), 1), "share": round(float(share[g]), 4)}
        for g in np.argsort(-share, kind="stable")[:TOP_GENES]
        if share[g] > 0
    }


def _soupx(
    matrix: Any, codes: np.ndarray, soup_counts: np.ndarray, names: Any
) -> tuple[Any, dict[str, Any], list[dict[str, Any]]]:
    if soup_counts.sum() <= 0:
        raise ToolError("remove_ambient: the soup droplets hold no counts of the genes kept")
    soup = soup_counts / soup_counts.sum()
    estimate = soupx.estimate_rho(matrix, codes, soup)
    evidence = soupx.describe(estimate, names, soup)
    if estimate.rho is None or estimate.rho > soupx.RHO_MAX:
        why = (
            f"no cluster x marker pair to estimate rho from ({estimate.n_markers_tfidf} genes "
            f"passed the tf-idf cut, {len(estimate.markers)} of them abundant in the soup)"
            if estimate.rho is None
            else f"rho {estimate.rho:g} is over {soupx.RHO_MAX:g}, which SoupX takes for a failed "
            "estimate"
        )
        raise Refusal(check(
            "ambient_estimate", "refused",
            f"remove_ambient: SoupX cannot estimate the contamination: {why}; call it with "
            "method='decontx'", method="soupx", rho=estimate.rho, **evidence,
        ))  # fmt: skip
    corrected = soupx.subtract(matrix, codes, soup, estimate.rho)
    weak = []
    if estimate.estimates < soupx.MIN_ESTIMATES:
        weak.append(f"only {estimate.estimates} cluster x marker estimates (SoupX wants "
                    f"{soupx.MIN_ESTIMATES})")  # fmt: skip
    if estimate.rho > soupx.RHO_WARN:
        weak.append(f"rho {estimate.rho:g} is over {soupx.RHO_WARN:g}")
    said = f"SoupX rho {estimate.rho:g} (half-maximum {estimate.fwhm[0]:g}-{estimate.fwhm[1]:g})"
    found = check(
        "ambient_estimate", "warn" if weak else "pass",
        f"remove_ambient: {said}" + (f": {'; '.join(weak)}" if weak else ""),
        method="soupx", rho=estimate.rho, **evidence,
    )  # fmt: skip
    record = {
        "contamination": estimate.rho,
        "method_detail": "SoupX (Young & Behjati 2020): autoEstCont, adjustCounts subtraction",
        **evidence,
    }
    return corrected, record, [found]


def _decontx(
    matrix: Any, codes: np.ndarray, seed: int, max_iterations: int
) -> tuple[Any, dict[str, Any], list[dict[str, Any]], np.ndarray]:
    fit = dx.decontx(matrix, codes, np.random.default_rng(seed), max_iterations)
    corrected = fit.native
    totals = np.asarray(matrix.sum(axis=1)).ravel()
    sample = float((fit.contamination * totals).sum() / totals.sum())
    evidence = {
        "iterations": fit.iterations, "converged": fit.converged,
        "delta": [round(d, 3) for d in fit.delta], "log_likelihood": round(fit.log_likelihood, 1),
        "cell_contamination": quantiles(fit.contamination, 4),
    }  # fmt: skip
    said = f"decontX: {sample:.1%} of the counts contaminating, {fit.iterations} EM steps"
    weak = [] if fit.converged else [f"not converged after {fit.iterations} steps"]
    if sample > soupx.RHO_WARN:
        weak.append(f"contamination {sample:.2f} is over {soupx.RHO_WARN:g}")
    found = check(
        "ambient_estimate", "warn" if weak else "pass",
        f"remove_ambient: {said}" + (f": {'; '.join(weak)}" if weak else ""),
        method="decontx", contamination=round(sample, 4), **evidence,
    )  # fmt: skip
    record = {
        "contamination": round(sample, 4),
        "method_detail": "DecontX (Yang et al. 2020): variational EM, the Leiden clusters as populations",
        **evidence,
    }
    return corrected, record, [found], fit.contamination


@tool("ambient", needs=("load_data",), expensive=True)
def remove_ambient(
    session: Session,
    method: Literal["auto", "soupx", "decontx"] = "auto",
    groupby: Key = "leiden",
    round_to_int: bool = True,
    max_iterations: Annotated[int, Field(ge=10, le=5000)] = dx.MAX_ITERATIONS,
) -> dict[str, Any]:
    """Estimate the ambient RNA contamination and write the counts less it to a layer; the raw
    counts stay. Call it after leiden.

    SoupX where empty droplets were read (an unfiltered input, or the run's raw matrix beside
    a filtered one): one fraction for the sample. DecontX otherwise: a fraction per cell. If
    SoupX refuses (nothing to estimate from), call it again with method='decontx'.

    Writes `layers['decontaminated']`, `uns['ambient']` (method, fraction, evidence, genes
    affected) and, with DecontX, `obs['ambient_contamination']`.

    Args:
        method: 'auto': SoupX where the empty droplets were read, else DecontX.
        groupby: Cell annotation (obs column) with the clusters.
        round_to_int: Round the corrected counts to integers (seeded), as count models need.
        max_iterations: DecontX's EM steps at most.
    """
    adata = session.adata
    clusters = obs_column(
        adata, groupby, "remove_ambient", "call leiden first (or give another groupby)"
    ).astype(str)
    codes, groups = clusters.factorize(sort=True)
    if len(groups) < 2:
        raise ToolError(
            f"remove_ambient: {groupby!r} has one cluster; both methods need several cell "
            "populations (the contamination of one is the profile of the others)"
        )
    counts = counts_matrix(adata)
    matrix = sparse.csr_matrix(counts, dtype=np.float64)
    found = _soup(session, adata)
    chosen = method if method != "auto" else ("soupx" if found else "decontx")
    per_cell = None
    if chosen == "soupx":
        if found is None:
            raise ToolError(
                "remove_ambient: SoupX needs the empty droplets, and none were read (the input "
                "holds called cells only, and the run names no unfiltered matrix: --raw-input); "
                "use method='decontx'"
            )
        corrected, record, checks = _soupx(matrix, codes, found[0], adata.var_names)
        record["soup_source"] = found[1]
    else:
        corrected, record, checks, per_cell = _decontx(matrix, codes, session.seed, max_iterations)
    if round_to_int:  # seeded: a replay gets the same integers
        corrected = soupx.round_to_int(corrected, np.random.default_rng(session.seed))
    total = float(matrix.sum())
    record.update(
        method=chosen,
        groupby=groupby,
        n_clusters=len(groups),
        round_to_int=round_to_int,
        seed=session.seed,
        removed_fraction=round(1 - float(corrected.sum()) / total, 4) if total else 0.0,
        genes_most_affected=_affected(matrix, corrected, adata.var_names),
        layer=LAYER,
    )
    adata.layers[LAYER] = sparse.csr_matrix(corrected, dtype=np.float32)
    if per_cell is not None:
        adata.obs["ambient_contamination"] = per_cell.astype(np.float32)
    adata.uns["ambient"] = {k: v for k, v in record.items() if v is not None}
    return {**record, "checks": checks}
