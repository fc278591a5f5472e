"""The cell and gene filters, each decision held against the data it removes.

A filter removing over half of the cells (or genes) warns; over 90% it is refused unless the call
gives an ``override_reason`` (agent/checks.py, rule ``removed_share``). A QC threshold far from the
bound qc_metrics derived from the data warns (``qc_bound``). A filter applied again composes with
the earlier ones: ``uns`` keeps every application and the thresholds in force, the strictest.
"""

from __future__ import annotations

from typing import Annotated, Any

import numpy as np
import scanpy as sc
from pydantic import Field

from agent.checks import MIN_AFFECTED, QC_FACTOR, check, removed_share, strictest
from agent.registry import Refusal, ToolError, tool
from agent.tools.common import Count, counts_matrix, obs_column
from agent.tools.qc import no_mt
from agent.tools.session import Session

Percent = Annotated[float, Field(ge=0, le=100)]
Override = Annotated[str, Field(min_length=1, max_length=500)]

# The obs column of qc_metrics each QC threshold acts on.
QC_COLUMNS = {
    "min_genes": "n_genes_by_counts",
    "max_genes": "n_genes_by_counts",
    "min_counts": "total_counts",
    "max_counts": "total_counts",
    "max_pct_mt": "pct_counts_mt",
}


def _check_range(tool: str, low: float | None, high: float | None, what: str) -> None:
    if low is not None and high is not None and low > high:
        raise ToolError(f"{tool}: min_{what}={low} is above max_{what}={high}")


def qc_bound(
    adata: Any, tool: str, given: dict[str, float], keep: np.ndarray
) -> dict[str, Any] | None:
    """The qc_bound check of ``given`` thresholds, which keep the cells of ``keep``, against the
    bounds qc_metrics derived (uns['qc_thresholds']['suggested']); None before qc_metrics. A
    threshold over QC_FACTOR times stricter or looser than its bound warns when it decides the
    fate of at least MIN_AFFECTED of the cells otherwise than the bound would; so does keeping
    MIN_AFFECTED or more of the cells outside the derived genes or mitochondrial bounds (a
    filter that removes nothing of what QC found)."""
    derived = (adata.uns.get("qc_thresholds") or {}).get("suggested") or {}
    if not derived or any(c not in adata.obs.columns for c in set(QC_COLUMNS.values())):
        return None
    compared, off = {}, []
    for key, value in given.items():
        bound = derived.get(key)
        if bound is None:
            continue
        values = adata.obs[QC_COLUMNS[key]].to_numpy()
        low, high = sorted((float(value), float(bound)))
        # cells one of the two keeps and the other removes
        if key.startswith("max_"):
            affected = int(((values > low) & (values <= high)).sum())
        else:
            affected = int(((values >= low) & (values < high)).sum())
        ratio = float(value) / float(bound) if bound else float("inf")
        stricter = ratio > 1 if key.startswith("min_") else ratio < 1
        factor = max(ratio, 1 / ratio) if 0 < ratio < float("inf") else float("inf")
        compared[key] = {
            "given": value,
            "derived": bound,
            "factor": round(factor, 3) if factor != float("inf") else None,
            "direction": "stricter" if stricter else "looser",
            "cells_affected": affected,
        }
        if factor > QC_FACTOR and affected >= MIN_AFFECTED * len(values):
            off.append(
                f"{key}={value:g} is {compared[key]['direction']} than the derived bound "
                f"{bound:g} ({'x' + format(factor, '.1f') if factor != float('inf') else 'from 0'}"
                f"), deciding {affected:,} cells otherwise"
            )
    outliers = _outliers_kept(adata.obs, derived, keep)
    if sum(outliers.values()) >= MIN_AFFECTED * int(keep.sum()):
        off.append(
            "keeps cells outside qc_metrics' derived bounds ("
            + ", ".join(f"{k} {derived[k]:g}: {n:,}" for k, n in outliers.items() if n)
            + ")"
        )
    evidence = {"thresholds": compared, "outliers_kept": outliers}
    if off:
        return check("qc_bound", "warn", f"{tool}: " + "; ".join(off), **evidence)
    return check(
        "qc_bound", "pass", f"{tool}: thresholds within {QC_FACTOR:g}x of the derived bounds, or "
        "deciding few cells otherwise; few cells kept outside them", **evidence,
    )  # fmt: skip


# The derived bounds a QC filter is expected to enforce (counts follow genes; the reference
# recipe applies these three).
ENFORCED = ("min_genes", "max_genes", "max_pct_mt")


def _outliers_kept(obs: Any, derived: dict[str, Any], keep: np.ndarray) -> dict[str, int]:
    """Per derived bound of ENFORCED, the kept cells outside it."""
    out = {}
    for key in ENFORCED:
        bound = derived.get(key)
        if bound is None:
            continue
        values = obs[QC_COLUMNS[key]].to_numpy()
        outside = values < bound if key.startswith("min_") else values > bound
        out[key] = int((outside & keep).sum())
    return out


def _first(adata: Any, key: str, count: int) -> int:
    """How many cells (or detected genes) the data had when first filtered: kept in
    uns['filtering_baseline'] at the first filter, so a cut split over calls counts whole."""
    baseline = adata.uns.setdefault("filtering_baseline", {})
    baseline.setdefault(key, int(count))
    return int(baseline[key])


def _decided(
    tool: str, what: str, before: int, after: int, first: int, override: str | None
) -> dict[str, Any]:
    """The removed_share check; raises Refusal (nothing changed) when it refuses."""
    found = removed_share(tool, what, before, after, first, override)
    if found["verdict"] == "refused":
        raise Refusal(found)
    return found


def _apply_cell_mask(
    session: Session, tool: str, keep: np.ndarray, removed_by: dict[str, int], override: str | None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Keep the cells of ``keep``: the counts before and after, and the removed_share check."""
    adata = session.adata
    if not keep.any():
        raise ToolError(
            f"{tool}: these thresholds would remove all {adata.n_obs} cells "
            f"(removed by each: {removed_by}); nothing was changed"
        )
    before, after = adata.n_obs, int(keep.sum())
    first = _first(adata, "cells", before)
    found = _decided(tool, "cells", before, after, first, override)
    session.adata = adata[keep].copy()
    counts = {"cells_before": before, "cells_after": after, "removed": before - after}
    return {**counts, "removed_by": removed_by}, found


def _compose(uns: dict[str, Any], key: str, thresholds: dict[str, Any], settings: dict) -> dict:
    """Record one more application of a filter in ``uns[key]``: every application kept (under
    'applications', by order) and the thresholds in force, the strictest of them, at the top.
    Returns the thresholds in force."""
    earlier = (uns.get(key) or {}).get("applications") or {}
    applications = {**earlier, str(len(earlier) + 1): settings}
    effective = strictest(a["thresholds"] for a in applications.values())
    uns[key] = {**effective, **settings["counts"], "applications": applications}
    return effective


def _effective(result: dict[str, Any], uns_entry: dict[str, Any], effective: dict) -> dict:
    """A filter's result with the thresholds in force after it, where it was not the first."""
    n = len(uns_entry["applications"])
    return result | ({"application": n, "effective_thresholds": effective} if n > 1 else {})


def _settings(thresholds: dict[str, Any], counts: dict[str, Any]) -> dict[str, Any]:
    return {"thresholds": dict(thresholds), "counts": dict(counts)}


@tool("cell_filter", stage="cell_filter", resets="hvg")
def filter_cells(
    session: Session,
    min_genes: Count | None = None,
    max_genes: Count | None = None,
    min_counts: Count | None = None,
    max_counts: Count | None = None,
    override_reason: Override | None = None,
) -> dict[str, Any]:
    """Remove cells (barcodes) with too few or too many detected genes or counts.

    Uses scanpy's filter_cells on the raw counts; give at least one threshold. Typical first
    step: min_genes=200 removes empty droplets. Applied again, the strictest thresholds hold
    (uns['filter_cells']).

    Args:
        min_genes: Keep cells with at least this many detected genes.
        max_genes: Keep cells with at most this many detected genes.
        min_counts: Keep cells with at least this many counts.
        max_counts: Keep cells with at most this many counts.
        override_reason: Why removing over 90% of the cells is right here.
    """
    given = {
        "min_genes": min_genes,
        "max_genes": max_genes,
        "min_counts": min_counts,
        "max_counts": max_counts,
    }
    given = {k: v for k, v in given.items() if v is not None}
    if not given:
        raise ToolError(
            "filter_cells: give at least one of min_genes, max_genes, min_counts, max_counts"
        )
    _check_range("filter_cells", min_genes, max_genes, "genes")
    _check_range("filter_cells", min_counts, max_counts, "counts")
    adata = session.adata
    counts = sc.AnnData(counts_matrix(adata))  # scanpy's filter logic on the raw counts
    keep = np.ones(adata.n_obs, bool)
    removed_by = {}
    for name, value in given.items():
        mask, _ = sc.pp.filter_cells(counts, **{name: value}, inplace=False)
        removed_by[name] = int((~mask).sum())
        keep &= mask
    bound = qc_bound(adata, "filter_cells", given, keep)
    result, share = _apply_cell_mask(session, "filter_cells", keep, removed_by, override_reason)
    uns = session.adata.uns
    effective = _compose(uns, "filter_cells", given, _settings(given, result))
    result = _effective(result | {"thresholds": given}, uns["filter_cells"], effective)
    return result | {"checks": [share, *([bound] if bound else [])]}


@tool("gene_filter", resets="hvg")
def filter_genes(
    session: Session,
    min_cells: Count | None = 3,
    max_cells: Count | None = None,
    min_counts: Count | None = None,
    override_reason: Override | None = None,
) -> dict[str, Any]:
    """Remove genes detected in too few (or too many) cells, or with too few counts.

    Applied again, the strictest thresholds hold (uns['filter_genes']).

    Args:
        min_cells: Keep genes detected in at least this many cells.
        max_cells: Keep genes detected in at most this many cells.
        min_counts: Keep genes with at least this many counts in total.
        override_reason: Why removing over 90% of the genes is right here.
    """
    given = {"min_cells": min_cells, "max_cells": max_cells, "min_counts": min_counts}
    given = {k: v for k, v in given.items() if v is not None}
    if not given:
        raise ToolError("filter_genes: give at least one of min_cells, max_cells, min_counts")
    _check_range("filter_genes", min_cells, max_cells, "cells")
    adata = session.adata
    counts = sc.AnnData(counts_matrix(adata))
    keep = np.ones(adata.n_vars, bool)
    undetected = np.zeros(adata.n_vars, bool)  # removed as detected too little, not too much
    removed_by = {}
    for name, value in given.items():
        mask, _ = sc.pp.filter_genes(counts, **{name: value}, inplace=False)
        removed_by[name] = int((~mask).sum())
        keep &= mask
        if name != "max_cells":
            undetected |= ~mask
    if not keep.any():
        raise ToolError(
            f"filter_genes: these thresholds would remove all {adata.n_vars} genes (removed by each: {removed_by}); nothing was changed"
        )
    before, after = adata.n_vars, int(keep.sum())
    # the share is of the genes detected at all: dropping never-seen genes of a 10x list costs nothing
    detected = np.asarray((counts.X > 0).sum(axis=0)).ravel() > 0
    seen, kept_seen = int(detected.sum()), int((detected & keep).sum())
    first = _first(adata, "genes_detected", seen)
    share = _decided("filter_genes", "detected genes", seen, kept_seen, first, override_reason)
    session.adata = adata[:, keep].copy()
    result = {
        "genes_before": before,
        "genes_after": after,
        "removed": before - after,
        "removed_by": removed_by,
    }
    uns = session.adata.uns
    earlier = list((uns.get("filter_genes") or {}).get("undetected_genes", []))
    effective = _compose(uns, "filter_genes", given, _settings(given, result))
    # measured but absent, unlike a gene never measured (a panel): annotate_clusters' gates
    uns["filter_genes"]["undetected_genes"] = [*earlier, *adata.var_names[undetected]]
    result = _effective(result | {"thresholds": given}, uns["filter_genes"], effective)
    return result | {"checks": [share]}


@tool("cell_filter", needs=("qc_metrics",), stage="cell_filter", resets="hvg")
def filter_by_qc(
    session: Session,
    min_genes: Count | None = None,
    max_genes: Count | None = None,
    min_counts: Count | None = None,
    max_counts: Count | None = None,
    max_pct_mt: Percent | None = None,
    override_reason: Override | None = None,
) -> dict[str, Any]:
    """Remove low-quality cells by the QC metrics: genes, counts and percent mitochondrial.

    Needs qc_metrics first; its suggested_thresholds are a data-driven starting point (over 2x
    from them warns). Applied again, the strictest thresholds hold
    (uns['qc_thresholds']['applied']).

    Args:
        min_genes: Keep cells with at least this many detected genes.
        max_genes: Keep cells with at most this many detected genes (high: likely doublets).
        min_counts: Keep cells with at least this many counts.
        max_counts: Keep cells with at most this many counts.
        max_pct_mt: Keep cells with at most this percent of counts from mitochondrial genes
            (high: damaged cells).
        override_reason: Why removing over 90% of the cells is right here.
    """
    given = {"min_genes": min_genes, "max_genes": max_genes, "min_counts": min_counts,
             "max_counts": max_counts, "max_pct_mt": max_pct_mt}  # fmt: skip
    given = {k: v for k, v in given.items() if v is not None}
    if not given:
        raise ToolError("filter_by_qc: give at least one threshold")
    _check_range("filter_by_qc", min_genes, max_genes, "genes")
    _check_range("filter_by_qc", min_counts, max_counts, "counts")
    adata = session.adata
    not_applied = {}
    if "max_pct_mt" in given and "mt" in adata.var and not adata.var["mt"].any():
        given.pop("max_pct_mt")  # a cut-off on a percent that is 0 everywhere cannot act
        not_applied["max_pct_mt"] = no_mt("var['mt'] of qc_metrics")
        if not given:
            raise ToolError(f"filter_by_qc: {not_applied['max_pct_mt']}; give genes or counts")
    hint = "call qc_metrics first"
    values = {
        column: obs_column(adata, column, "filter_by_qc", hint).to_numpy()
        for column in dict.fromkeys(QC_COLUMNS.values())
    }
    keep = np.ones(adata.n_obs, bool)
    removed_by = {}
    for name, value in given.items():
        column = values[QC_COLUMNS[name]]
        mask = column >= value if name.startswith("min_") else column <= value
        removed_by[name] = int((~mask).sum())
        keep &= mask
    bound = qc_bound(adata, "filter_by_qc", given, keep)
    result, share = _apply_cell_mask(session, "filter_by_qc", keep, removed_by, override_reason)
    # the QC plots drawn after this show the thresholds in force, not those suggested
    stored = session.adata.uns.setdefault("qc_thresholds", {})
    earlier = stored.get("applications") or {}
    applications = {**earlier, str(len(earlier) + 1): {**given, **result}}
    stored["applications"] = applications
    stored["applied"] = strictest(
        {k: v for k, v in a.items() if k in QC_COLUMNS} for a in applications.values()
    )
    if not_applied:
        stored["not_applied"] = dict(not_applied)
    result |= {"thresholds": given, "not_applied": not_applied}
    if len(applications) > 1:
        result |= {"application": len(applications), "effective_thresholds": stored["applied"]}
    return result | {"checks": [share, *([bound] if bound else [])]}
