"""Doublet detection with scanpy's Scrublet, and removal of the predicted doublets."""

from __future__ import annotations

from typing import Annotated, Any

import numpy as np
import scanpy as sc
from pydantic import Field

from agent.registry import ToolError, tool
from agent.tools.common import obs_column, quantiles
from agent.tools.session import Session

# Below this Scrublet's kNN has about 5 neighbours and a handful of expected doublets: no call.
MIN_CELLS = 100
# Scrublet's cost grows with cells x neighbours (k ~ sqrt(cells)) on three times as many points
# (two simulated doublets per cell): above this, cells are called in random batches of about
# this size, each with its own simulated doublets, which keeps exact kNN and a linear cost.
BATCH_CELLS = 10000


def _scrublet_genes(adata: Any) -> int:
    """The genes Scrublet embeds: expressed in 3+ cells, then highly variable (its defaults)."""
    expressed = np.asarray((adata.X > 0).sum(axis=0)).ravel() >= 3
    if expressed.sum() < 3:
        return int(expressed.sum())
    sub = adata[:, expressed].copy()
    sc.pp.normalize_total(sub)
    sc.pp.log1p(sub)
    return int(sc.pp.highly_variable_genes(sub, inplace=False)["highly_variable"].sum())


def _batches(n_cells: int, seed: int) -> list[np.ndarray]:
    """Cell indices in random batches of at most BATCH_CELLS (one batch for smaller samples)."""
    n_batches = -(-n_cells // BATCH_CELLS)
    order = np.random.default_rng(seed).permutation(n_cells)
    return [np.sort(part) for part in np.array_split(order, n_batches)]


def _call_batch(
    batch: Any, rate: float, threshold: float | None, n_prin_comps: int, seed: int
) -> tuple[np.ndarray, np.ndarray, float | None, int]:
    """Scrublet on one batch: scores, calls, threshold (None: not found) and the PCs it used."""
    comps = min(n_prin_comps, batch.n_obs - 1, _scrublet_genes(batch) - 1)
    if comps < 2:
        raise ToolError(
            f"detect_doublets: Scrublet keeps too few variable genes ({comps + 1}) in "
            f"{batch.n_obs} cells to embed them; skip doublet detection for this sample"
        )
    sc.pp.scrublet(
        batch,
        expected_doublet_rate=rate,
        threshold=threshold,
        n_prin_comps=comps,
        random_state=seed,
        use_approx_neighbors=False,  # batches are small enough for exact, reproducible kNN
        verbose=False,
    )
    found = batch.uns["scrublet"].get("threshold")
    return (
        batch.obs["doublet_score"].to_numpy(),
        batch.obs["predicted_doublet"].astype(bool).to_numpy(),
        None if found is None else float(found),
        comps,
    )


@tool("doublets", expensive=True)
def detect_doublets(
    session: Session,
    expected_doublet_rate: Annotated[float, Field(gt=0, le=0.5)] = 0.05,
    threshold: Annotated[float, Field(gt=0, lt=1)] | None = None,
    n_prin_comps: Annotated[int, Field(ge=2, le=100)] = 30,
) -> dict[str, Any]:
    """Score every cell for being a doublet with Scrublet (simulated doublets, kNN in PCA space).

    Runs on raw counts, so call it before normalize; needs at least 100 cells. Samples above
    10,000 cells are scored in random batches of about 10,000 cells, each with its own simulated
    doublets and threshold. The threshold on the doublet score is found automatically unless
    given. Does not remove cells: call remove_doublets for that.

    Args:
        expected_doublet_rate: Expected fraction of doublets (10x: about 0.008 per 1,000 cells
            loaded).
        threshold: Doublet score above which a cell is called a doublet; leave out to set it
            automatically from the bimodal score distribution.
        n_prin_comps: Principal components Scrublet uses (fewer where the cells or Scrublet's
            variable genes are too few for them).
    """
    if "normalize" in session.done:
        raise ToolError("detect_doublets needs raw counts: call it before normalize")
    adata = session.adata
    if adata.n_obs < MIN_CELLS:
        raise ToolError(
            f"detect_doublets needs at least {MIN_CELLS} cells to call doublets, the data have "
            f"{adata.n_obs}: skip doublet detection for this sample"
        )
    seed = session.seed
    batches = _batches(adata.n_obs, seed)
    scores = np.zeros(adata.n_obs)
    called = np.zeros(adata.n_obs, bool)
    thresholds, comps = [], []
    for cells in batches:
        batch = adata if len(batches) == 1 else adata[cells].copy()  # scrublet copies it
        s, c, t, k = _call_batch(batch, expected_doublet_rate, threshold, n_prin_comps, seed)
        scores[cells], called[cells] = s, c
        thresholds.append(t)
        comps.append(k)
    if None in thresholds:
        raise ToolError(
            "Scrublet could not find a threshold automatically (the simulated doublet scores are "
            "not bimodal); call detect_doublets again with threshold=... (e.g. 0.25)"
        )
    adata.obs["doublet_score"] = scores
    adata.obs["predicted_doublet"] = called
    adata.uns["scrublet"] = {
        "threshold": thresholds[0] if len(batches) == 1 else thresholds,
        "parameters": {
            "expected_doublet_rate": expected_doublet_rate,
            "threshold_automatic": threshold is None,
            "n_prin_comps": comps,
            "batches": len(batches),
            "random_state": seed,
        },
    }
    return {
        "n_cells": adata.n_obs,
        "n_predicted_doublets": int(called.sum()),
        "detected_doublet_rate": round(float(called.mean()), 4),
        "threshold": round(thresholds[0], 4)
        if len(set(thresholds)) == 1
        else [round(t, 4) for t in thresholds],
        "threshold_automatic": threshold is None,
        "expected_doublet_rate": expected_doublet_rate,
        "n_prin_comps": comps[0] if len(set(comps)) == 1 else comps,
        "batches": len(batches),
        "cells_per_batch": max(len(b) for b in batches),
        "doublet_score": quantiles(scores, 3),
    }


@tool("doublets", needs=("detect_doublets",))
def remove_doublets(session: Session) -> dict[str, Any]:
    """Remove the cells detect_doublets predicted to be doublets."""
    adata = session.adata
    predicted = obs_column(
        adata, "predicted_doublet", "remove_doublets", "call detect_doublets first"
    )
    predicted = predicted.astype(bool).to_numpy()
    if predicted.all():
        raise ToolError(
            "remove_doublets: every cell is predicted a doublet; check detect_doublets' threshold"
        )
    session.adata = adata[~predicted].copy()
    return {
        "cells_before": adata.n_obs,
        "cells_after": int((~predicted).sum()),
        "removed": int(predicted.sum()),
        "removed_fraction": round(float(np.mean(predicted)), 4),
    }
