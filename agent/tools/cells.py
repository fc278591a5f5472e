"""Cell calling on unfiltered droplet matrices: whether the input is one, and its cells.

A raw (unfiltered) droplet matrix holds every barcode that caught an RNA molecule: tens of
thousands of empty droplets with a few ambient UMIs each, and the cells. Whether the input is one
is decided from its counts (how many barcodes, how many at or below the ambient bound, the ranked
curve's knee), never from its file name. Cells are then called as DropletUtils' ``emptyDrops``
calls them (agent/tools/emptydrops.py, checked against DropletUtils itself in
tests/test_cells_dropletutils.py): the barcodes at or above ``retain`` (the knee unless given)
and those unlike the ambient profile of the barcodes with at most ``lower`` UMIs at the FDR. The
result says how many Monte-Carlo iterations were needed, how many barcodes sat at the floor of
the p-values (``limited``) and what the call left behind (``not_called``): the barcodes above the
curve's inflection that were not called, beside the cells kept.

What ``call_cells`` writes, beyond keeping the cells (its docstring, sent to the model, names
the keys only): ``obs['empty_drops_fdr']`` (0 for the retained barcodes);
``var['ambient_counts']``, per gene the counts of the droplets of 1-99 UMIs (SoupX's soup, which remove_ambient reads);
``uns['cell_calling']``, the evidence, settings, ambient profile and the ranked curve for the
barcode-rank plot. A filtered input gets ``uns['cell_calling']`` with the decision only.

The PyPI ports were read and not used: ``emptydrops`` 0.0.5 (2020) is Cell Ranger 3's multinomial
variant with fixed 90,000-partition and 1,000-UMI constants, densifying chunks, importing
pkg_resources; ``cell-filter`` 0.1.2 needs Python 3.13 and takes the ambient pool from fixed rank
positions 45,000-90,000, which a matrix of fewer barcodes does not have.
"""

from __future__ import annotations

from typing import Annotated, Any

import numpy as np
from pydantic import Field
from scipy import sparse

from agent.registry import ToolError, tool
from agent.tools.common import per_row
from agent.tools.emptydrops import LOWER, EmptyDrops, ambient_summary, barcode_ranks, empty_drops
from agent.tools.io import MIN_CELLS
from agent.tools.session import Session
from agent.tools.soupx import soup_counts

# An unfiltered droplet matrix is mostly empty droplets; a filtered one (cells called upstream) is
# mostly cells. Under MIN_BARCODES barcodes a matrix is taken as called cells even when shallow
# (Seurat's pbmc_small: 80 cells, a third under 100 UMIs); no 10x raw matrix is that small.
MIN_BARCODES = 2_000
UNFILTERED_SHARE = 0.5
# Or most barcodes lie below the ranked curve's cliff (the inflection), where a heavy ambient
# load puts many empties above `lower`: 97% of the barcodes in real cells among 20,000 empties of
# 5-300 UMIs (pbmc68k_reduced, CellTypist's sample), 7-23% in the synthetic demo samples, whose
# cells were called with 8-30% empty barcodes left among them. Weak evidence: no real filtered
# matrix of MIN_BARCODES or more ships with the packages the tests use (the largest, CellTypist's
# sample, has 559 cells), so the share was never checked where it decides; the reason says so.
UNFILTERED_BELOW_INFLECTION = 0.8
BELOW_INFLECTION_UNCHECKED = (
    f"the {UNFILTERED_BELOW_INFLECTION:.0%} bound was never checked on a real filtered matrix of "
    f"{MIN_BARCODES:,} or more barcodes"
)
# A knee closer to the ambient bound than this leaves cells and empties one continuum: the
# barcodes retained at it may be empties (a warning; DropletUtils retains them all the same).
MIN_KNEE_RATIO = 2.0
MIN_CURVE_POINTS = 10  # fewer distinct totals above the bound cannot show a knee
TOP_AMBIENT_GENES = 10
CURVE_POINTS = 400  # points of the ranked curve kept in uns for the barcode-rank plot
# Barcodes above the inflection that EmptyDrops leaves uncalled: past this share of the cells
# kept, the result warns. On the oracle matrices of tests/test_cells_dropletutils.py all such
# barcodes are real cells: 0-0.14% of the cells kept where DropletUtils calls (nearly) every real
# cell (pbmc68k_reduced, pbmc_small), 31-107% where it leaves many (CellTypist's sample; 42% on
# issue 37's matrix, bench/call_cells_dropletutils.py). A tenth sits in that gap, chosen by
# looking at those matrices, not fitted; under a heavy ambient load empties can reach above the
# inflection too, so the warning does not call them cells.
LOST_WARN_SHARE = 0.1

Fdr = Annotated[float, Field(gt=0, lt=0.5)]
Iterations = Annotated[int, Field(ge=100, le=10_000_000)]


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
    low = totals <= lower
    points = len(np.unique(totals[~low]))
    ranks = barcode_ranks(totals, lower) if points >= MIN_CURVE_POINTS else {}
    knee, inflection = (
        round(v) if v else None for v in (ranks.get("knee"), ranks.get("inflection"))
    )
    return {
        "barcodes": len(totals),
        "low_count_barcodes": int(low.sum()),
        "share_low_count": round(float(low.mean()), 4),
        "lower": lower,
        "knee": knee,
        "inflection": inflection,
        "barcodes_above_knee": int((totals >= knee).sum()) if knee else 0,
        "share_below_inflection": round(float((totals < inflection).mean()), 4)
        if inflection
        else None,
        "median_counts": float(np.median(totals)),
    }


def _lost(totals: np.ndarray, cells: np.ndarray, inflection: int) -> dict[str, Any]:
    """The barcodes above the inflection (on the cells' side of the curve's cliff) not called."""
    left = (totals >= inflection) & ~cells
    return {
        "above": inflection,
        "barcodes": int(left.sum()),
        "median_umis": float(np.median(totals[left])) if left.any() else None,
        "share_of_kept": round(float(left.sum() / max(int(cells.sum()), 1)), 4),
    }


def _said(lost: dict[str, Any]) -> str:
    if not lost["barcodes"]:
        return f"every barcode above the inflection ({lost['above']} UMIs) was called"
    return (
        f"{lost['barcodes']:,} barcodes above the inflection ({lost['above']} UMIs, median "
        f"{lost['median_umis']:g}) were not called"
    )


def _warnings(
    evidence: dict[str, Any], lost: dict[str, Any], n_cells: int, called: EmptyDrops, fdr: float
) -> list[str]:
    warnings = []
    if evidence["knee"] < MIN_KNEE_RATIO * evidence["lower"]:
        warnings.append(
            f"the knee ({evidence['knee']} UMIs) lies within {MIN_KNEE_RATIO:g} x the ambient "
            f"bound ({evidence['lower']} UMIs): cells and empty droplets form one continuum, and "
            "the barcodes retained at the knee may hold no cell"
        )
    if lost["barcodes"] > LOST_WARN_SHARE * n_cells:
        warnings.append(
            f"{_said(lost)}: {lost['share_of_kept']:.0%} of the {n_cells:,} cells kept. Their "
            f"RNA is not told from the ambient profile at FDR {fdr}: they may be cells like it "
            "(often the commonest type, whose RNA dominates it) or, where the ambient load "
            "reaches the inflection, empty droplets; the counts do not say which"
        )
    if called.stuck(fdr):
        warnings.append(
            f"{called.stuck(fdr):,} barcodes at the Monte-Carlo floor (1/{called.iterations + 1:,})"
            f" miss FDR {fdr} after {called.iterations:,} iterations: a higher max_iterations "
            "could call them"
        )
    return warnings


def _storable(value: Any) -> Any:
    """``value`` without its None entries (a knee not found): h5ad cannot store None."""
    if isinstance(value, dict):
        return {k: _storable(v) for k, v in value.items() if v is not None}
    return value


RULE = (
    f"unfiltered when at least {MIN_BARCODES:,} barcodes and at least {UNFILTERED_SHARE:.0%} of "
    f"them with <= lower UMIs or {UNFILTERED_BELOW_INFLECTION:.0%} below the ranked curve's "
    "inflection; cells: total >= retain (the knee unless given), or EmptyDrops FDR "
    "<= fdr among barcodes above lower, iterations raised tenfold while barcodes at the "
    "Monte-Carlo floor miss the FDR"
)


@tool("cell_calling", needs=("load_data",), expensive=True, stage="cells")
def call_cells(
    session: Session,
    fdr: Fdr = 0.001,
    iterations: Iterations = 10_000,
    max_iterations: Iterations = 1_000_000,
    lower: Annotated[int, Field(ge=10, le=1_000)] = LOWER,
    retain: Annotated[int, Field(ge=11)] | None = None,
) -> dict[str, Any]:
    """Keep only barcodes holding cells (EmptyDrops) if the input is unfiltered droplets.

    Call it right after load_data. Warns when many barcodes above the UMI curve's inflection are
    left; refuses droplets with no cell told from empties. Writes obs['empty_drops_fdr'],
    var['ambient_counts'], uns['cell_calling'].

    Args:
        fdr: FDR at or below which a tested barcode is a cell.
        iterations: Monte-Carlo iterations to start with.
        max_iterations: Tenfold steps up to this while floor p-values miss the FDR.
        lower: Barcodes with at most this many UMIs are ambient.
        retain: Cells at or above this many UMIs; default: the knee.
    """
    if iterations > max_iterations:
        raise ToolError(
            f"call_cells: iterations={iterations:,} must not exceed max_iterations="
            f"{max_iterations:,}"
        )
    adata = session.adata
    matrix = sparse.csr_matrix(adata.X)
    # DropletUtils rounds non-integer counts (pseudo-aligners' estimates) before anything else
    counts = sparse.csr_matrix(
        (np.rint(matrix.data).astype(np.int64), matrix.indices, matrix.indptr), shape=matrix.shape
    )
    counts.eliminate_zeros()
    totals = per_row(counts, "sum").astype(np.int64)
    evidence = _evidence(totals, lower)
    record: dict[str, Any] = {"evidence": evidence, "rule": RULE}
    below_cliff = evidence["share_below_inflection"] or 0.0
    if len(totals) < MIN_BARCODES or (
        evidence["share_low_count"] < UNFILTERED_SHARE and below_cliff < UNFILTERED_BELOW_INFLECTION
    ):
        record["decision"] = "filtered"
        record["reason"] = (
            f"filtered: {len(totals):,} barcodes, {evidence['share_low_count']:.1%} with <= "
            f"{lower} UMIs, {below_cliff:.1%} below the inflection, median "
            f"{evidence['median_counts']:g} UMIs: cells called upstream; nothing removed"
        )
        adata.uns["cell_calling"] = _storable(record)
        return record | {"n_cells": adata.n_obs}
    knee = evidence["knee"]
    by_cliff = (  # the inflection's share decided it
        f", {below_cliff:.1%} below the inflection ({BELOW_INFLECTION_UNCHECKED})"
        if evidence["share_low_count"] < UNFILTERED_SHARE
        else ""
    )
    prefix = (
        f"call_cells: {len(totals):,} barcodes, {evidence['share_low_count']:.1%} with <= {lower} "
        f"UMIs{by_cliff}, as in an unfiltered droplet matrix"
    )
    if knee is None:
        raise ToolError(
            f"{prefix}, but fewer than {MIN_CURVE_POINTS} distinct totals lie above {lower} UMIs: "
            "the ranked UMI curve has no knee, cells cannot be told from empty droplets; give a "
            "matrix of called cells (Cell Ranger's filtered_feature_bc_matrix) or a deeper sample"
        )
    if retain is not None and retain <= lower:
        raise ToolError(f"call_cells: retain={retain} must exceed lower={lower}")
    threshold = knee if retain is None else retain
    rng = np.random.default_rng(session.seed)
    try:
        called = empty_drops(counts, totals, lower, threshold, fdr, iterations, max_iterations, rng)
    except ValueError as error:
        raise ToolError(f"{prefix}, but {error}: cells cannot be called") from error
    cells = called.called(fdr)
    tested, retained = totals > lower, totals >= threshold
    lost = _lost(totals, cells, evidence["inflection"])
    if cells.sum() < MIN_CELLS:
        raise ToolError(
            f"{prefix}, but only {int(cells.sum())} barcodes differ from the ambient profile "
            f"(FDR <= {fdr}; retain {threshold} UMIs; {called.iterations:,} iterations) and "
            f"{_said(lost)}: fewer than the {MIN_CELLS} cells an analysis needs; is this a sample "
            "without cells?"
        )
    n_cells = int(cells.sum())
    record.update(
        decision="unfiltered",
        method="EmptyDrops (Lun et al. 2019) as DropletUtils computes it, retain at the knee"
        if retain is None
        else "EmptyDrops (Lun et al. 2019) as DropletUtils computes it, retain given",
        fdr_threshold=fdr,
        lower=lower,
        retain=threshold,
        iterations=called.iterations,
        max_iterations=max_iterations,
        seed=session.seed,
        alpha=round(called.alpha, 4),
        ambient={"barcodes": int(((totals <= lower) & (totals > 0)).sum())}
        | ambient_summary(called, adata.var_names, TOP_AMBIENT_GENES),
        barcodes_tested=int(tested.sum()),
        barcodes_retained=int(retained.sum()),
        barcodes_called=int((cells & ~retained).sum()),
        limited=int(called.limited.sum()),
        limited_not_called=called.stuck(fdr),
        not_called=lost,
        n_cells=n_cells,
        median_genes_per_cell=float(np.median(per_row(matrix[cells], "nnz"))),
        curve=_curve(totals, cells),
        called_totals={"min": int(totals[cells].min()), "max": int(totals[cells].max())},
        warnings=_warnings(evidence, lost, n_cells, called, fdr),
    )
    record["reason"] = (
        f"unfiltered: {len(totals):,} barcodes, {evidence['share_low_count']:.1%} with <= {lower} "
        f"UMIs{by_cliff}; kept {n_cells:,} cells ({record['barcodes_retained']:,} at or above the "
        f"{'knee' if retain is None else 'retain bound'} of {threshold} UMIs, "
        f"{record['barcodes_called']:,} called by EmptyDrops at FDR <= {fdr} with "
        f"{called.iterations:,} iterations); {_said(lost)}"
    )
    kept = adata[cells].copy()
    kept.obs["empty_drops_fdr"] = called.fdr[cells]
    kept.var["ambient_counts"] = soup_counts(matrix, totals)  # the soup, for remove_ambient
    kept.uns["cell_calling"] = _storable(record)
    session.adata = kept
    return {k: v for k, v in record.items() if k != "curve"}
