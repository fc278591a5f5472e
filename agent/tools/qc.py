"""Quality control: per-cell metrics with data-driven threshold suggestions (the filters that
apply them are in agent/tools/filters.py)."""

from __future__ import annotations

import math
import re
from typing import Annotated, Any

import numpy as np
import pandas as pd
import scanpy as sc
from pydantic import Field
from scipy.stats import median_abs_deviation

from agent.registry import ToolError, tool
from agent.tools.common import quantiles
from agent.tools.session import Session
from agent.tools.species import HUMAN, RULES, detect_species, symbol_rules

Nmads = Annotated[float, Field(ge=1, le=10)]
Percent = Annotated[float, Field(ge=0, le=100)]


# Floors under the MAD-based thresholds. Where most cells share one value (e.g. none or one
# mitochondrial count) the MAD is 0 and median + k * MAD would flag every cell above the median.
MIN_LOG_MAD = 0.1  # log1p genes/counts: one MAD is at least ~10%
MIN_PCT_MT_MAD = 0.5  # percent mitochondrial counts: one MAD is at least half a point
MIN_MAX_PCT_MT = 5.0  # no cell under 5% mitochondrial counts is called damaged (Seurat's PBMC cut)


def gene_masks(
    names: Any,
    mt_prefix: str = RULES[HUMAN].mt_prefix,
    ribo_pattern: str = RULES[HUMAN].ribo_pattern,
    hb_pattern: str = RULES[HUMAN].hb_pattern,
) -> dict[str, np.ndarray]:
    """Mitochondrial (by prefix), ribosomal protein and haemoglobin genes (by pattern) of the
    symbols, matched case-insensitively: human (MT-CO1) and mouse (mt-Co1) differ in case."""
    names = pd.Index(names).astype(str)
    return {
        "mt": np.asarray(names.str.upper().str.startswith(mt_prefix.upper())),
        "ribo": np.asarray(names.str.contains(ribo_pattern, flags=re.IGNORECASE, regex=True)),
        "hb": np.asarray(names.str.contains(hb_pattern, flags=re.IGNORECASE, regex=True)),
    }


def _check_patterns(mt_prefix: str, ribo_pattern: str, hb_pattern: str) -> None:
    if not mt_prefix:
        raise ToolError(
            f"qc_metrics: mt_prefix={mt_prefix!r} must be non-empty (it would match every gene)"
        )
    for name, pattern in (("ribo_pattern", ribo_pattern), ("hb_pattern", hb_pattern)):
        try:
            re.compile(pattern)
        except re.error as e:
            raise ToolError(
                f"qc_metrics: {name}={pattern!r} is not a regular expression ({e})"
            ) from None


def _species_patterns(
    names: Any, mt_prefix: str | None, ribo_pattern: str | None, hb_pattern: str | None
) -> dict[str, Any]:
    """The gene-set patterns: those given, the rest from the species the symbols show."""
    species = detect_species(names)
    rules = symbol_rules(species["species"])
    given = {"mt_prefix": mt_prefix, "ribo_pattern": ribo_pattern, "hb_pattern": hb_pattern}
    patterns = {k: getattr(rules, k) if v is None else v for k, v in given.items()}
    return {
        "species": species["species"],
        "species_evidence": species["evidence"],
        "patterns": patterns,
        "patterns_given": [k for k, v in given.items() if v is not None],
    }


def _mad_spread(values: np.ndarray, min_mad: float) -> dict[str, float]:
    """Median and MAD (unscaled, as in the single-cell best-practices book), the MAD floored."""
    mad = float(median_abs_deviation(values))
    return {"median": float(np.median(values)), "mad": mad, "mad_used": max(mad, min_mad)}


def _suggest(
    obs: pd.DataFrame, nmads: float, nmads_mt: float, mt: bool = True
) -> tuple[dict, dict, list[str]]:
    """Thresholds at median +/- nmads floored MADs, the spreads used, and the floors that acted;
    ``mt``: whether the data have mitochondrial genes (else no max_pct_mt: it could not act)."""
    spread = {
        "log1p_n_genes": _mad_spread(obs["log1p_n_genes_by_counts"].to_numpy(), MIN_LOG_MAD),
        "log1p_total_counts": _mad_spread(obs["log1p_total_counts"].to_numpy(), MIN_LOG_MAD),
    }
    if mt:
        spread["pct_counts_mt"] = _mad_spread(obs["pct_counts_mt"].to_numpy(), MIN_PCT_MT_MAD)
    genes, counts = spread["log1p_n_genes"], spread["log1p_total_counts"]
    suggested = {
        "min_genes": max(0, math.floor(math.expm1(genes["median"] - nmads * genes["mad_used"]))),
        "max_genes": math.ceil(math.expm1(genes["median"] + nmads * genes["mad_used"])),
        "min_counts": max(0, math.floor(math.expm1(counts["median"] - nmads * counts["mad_used"]))),
        "max_counts": math.ceil(math.expm1(counts["median"] + nmads * counts["mad_used"])),
    }
    floors = [
        f"{name} MAD {s['mad']:.3g} raised to {s['mad_used']}"
        for name, s in spread.items()
        if s["mad_used"] > s["mad"]
    ]
    if mt:
        mt_by_mad = (
            spread["pct_counts_mt"]["median"] + nmads_mt * spread["pct_counts_mt"]["mad_used"]
        )
        suggested["max_pct_mt"] = round(min(100.0, max(MIN_MAX_PCT_MT, mt_by_mad)), 2)
        if mt_by_mad < MIN_MAX_PCT_MT:
            floors.append(f"max_pct_mt {mt_by_mad:.2f} raised to the minimum {MIN_MAX_PCT_MT}")
    for s in spread.values():
        s.update({k: round(v, 4) for k, v in s.items()})
    return suggested, spread, floors


@tool("qc", stage="qc")
def qc_metrics(
    session: Session,
    mt_prefix: str | None = None,
    ribo_pattern: str | None = None,
    hb_pattern: str | None = None,
    nmads: Nmads = 5.0,
    nmads_mt: Nmads = 3.0,
) -> dict[str, Any]:
    """Compute per-cell QC metrics and suggest filter thresholds from their distributions.

    Runs scanpy's calculate_qc_metrics with mitochondrial, ribosomal and haemoglobin gene sets
    (patterns from the species the gene symbols show, human or mouse, matched ignoring case) and
    returns quantiles of genes per cell, counts per cell and percent mitochondrial counts, and
    outlier thresholds at median +/- nmads MADs (log scale for genes and counts; percent
    mitochondrial above median + nmads_mt MADs) with how many cells each would remove. Where
    most cells share one value the MAD is near 0: it is floored (0.1 on log scale, 0.5 percent
    points), and max_pct_mt is at least 5%. Without mitochondrial genes max_pct_mt is None (not
    applied: it could not act). The thresholds are kept in uns['qc_thresholds'] for the QC
    violin and scatter plots.

    Args:
        mt_prefix: Prefix of mitochondrial gene symbols; default from the detected species
            ('MT-' human, 'mt-' mouse).
        ribo_pattern: Regular expression for ribosomal protein genes; default from the detected
            species (RPL/RPS genes, RPLP0-2, RPSA; not kinases such as RPS6KA1 or pseudogenes).
        hb_pattern: Regular expression for haemoglobin genes; default from the detected species
            (HBA1 ... HBZ; not HBEGF or HBP1).
        nmads: MADs from the median (log scale) beyond which genes/counts per cell are outliers.
        nmads_mt: MADs above the median beyond which percent mitochondrial counts is an outlier.
    """
    adata = session.adata
    chosen = _species_patterns(adata.var_names, mt_prefix, ribo_pattern, hb_pattern)
    _check_patterns(**chosen["patterns"])
    masks = gene_masks(adata.var_names, **chosen["patterns"])
    for name, mask in masks.items():
        adata.var[name] = mask
    layer = "counts" if "counts" in adata.layers else None
    sc.pp.calculate_qc_metrics(
        adata, qc_vars=["mt", "ribo", "hb"], percent_top=None, log1p=True, inplace=True, layer=layer
    )
    obs = adata.obs
    has_mt = bool(masks["mt"].any())
    suggested, spread, floors = _suggest(obs, nmads, nmads_mt, mt=has_mt)
    method = (
        f"median +/- {nmads} MAD of log1p genes and counts (MAD at least {MIN_LOG_MAD}); "
        f"pct_counts_mt > max({MIN_MAX_PCT_MT}, median + {nmads_mt} MAD) "
        f"(MAD at least {MIN_PCT_MT_MAD})"
    )
    not_applied = (
        {} if has_mt else {"max_pct_mt": no_mt(f"prefix {chosen['patterns']['mt_prefix']!r}")}
    )
    adata.uns["qc_thresholds"] = {
        "suggested": dict(suggested),
        "method": method,
        "species": chosen["species"],
        **({"not_applied": dict(not_applied)} if not_applied else {}),
    }
    genes, counts, mt = obs["n_genes_by_counts"], obs["total_counts"], obs["pct_counts_mt"]
    flagged = {
        "min_genes": genes < suggested["min_genes"],
        "max_genes": genes > suggested["max_genes"],
        "min_counts": counts < suggested["min_counts"],
        "max_counts": counts > suggested["max_counts"],
    }
    if has_mt:
        flagged["max_pct_mt"] = mt > suggested["max_pct_mt"]
    return {
        "n_cells": adata.n_obs,
        **chosen,
        "gene_sets": {name: int(mask.sum()) for name, mask in masks.items()},
        "genes_per_cell": quantiles(genes, 0),
        "counts_per_cell": quantiles(counts, 0),
        "pct_counts_mt": quantiles(mt),
        "median_pct_counts_ribo": round(float(obs["pct_counts_ribo"].median()), 2),
        "median_pct_counts_hb": round(float(obs["pct_counts_hb"].median()), 3),
        "suggested_thresholds": {**suggested, **dict.fromkeys(not_applied)},  # None: not applied
        "not_applied": not_applied,
        "cells_outside_each": {k: int(v.sum()) for k, v in flagged.items()},
        "cells_outside_any": int(np.logical_or.reduce(list(flagged.values())).sum()),
        "method": method,
        "spread": spread,
        "floors_applied": floors,
        "warnings": list(not_applied.values()),
    }


def no_mt(found_by: str) -> str:
    return (
        f"no mitochondrial genes ({found_by}): percent mitochondrial is 0 in every cell, so no "
        "max_pct_mt filter was applied"
    )
