"""Doublet detection with scanpy's Scrublet, and removal of the predicted doublets."""

from __future__ import annotations

from typing import Annotated, Any

import numpy as np
import scanpy as sc
from pydantic import Field

from agent.registry import ToolError, tool
from agent.tools.common import obs_column, quantiles, scanpy_params
from agent.tools.session import Session

# Exact kNN below this: faster than pynndescent at this size (no JIT warm-up) and reproducible.
EXACT_KNN_MAX_CELLS = 20000


@tool("doublets", expensive=True)
def detect_doublets(
    session: Session,
    expected_doublet_rate: Annotated[float, Field(gt=0, le=0.5)] = 0.05,
    threshold: Annotated[float, Field(gt=0, lt=1)] | None = None,
    n_prin_comps: Annotated[int, Field(ge=2, le=100)] = 30,
) -> dict[str, Any]:
    """Score every cell for being a doublet with Scrublet (simulated doublets, kNN in PCA space).

    Runs on raw counts, so call it before normalize. The threshold on the doublet score is found
    automatically unless given. Does not remove cells: call remove_doublets for that.

    Args:
        expected_doublet_rate: Expected fraction of doublets (10x: about 0.008 per 1,000 cells
            loaded).
        threshold: Doublet score above which a cell is called a doublet; leave out to set it
            automatically from the bimodal score distribution.
        n_prin_comps: Principal components Scrublet uses.
    """
    if "normalize" in session.done:
        raise ToolError("detect_doublets needs raw counts: call it before normalize")
    adata = session.adata
    if adata.n_obs < 100:
        raise ToolError(f"detect_doublets needs at least 100 cells, the data have {adata.n_obs}")
    if n_prin_comps >= min(adata.n_obs, adata.n_vars):
        raise ToolError(
            f"n_prin_comps={n_prin_comps} must be below min(cells, genes)={min(adata.shape)}"
        )
    sc.pp.scrublet(
        adata,
        expected_doublet_rate=expected_doublet_rate,
        threshold=threshold,
        n_prin_comps=n_prin_comps,
        random_state=session.seed,
        use_approx_neighbors=adata.n_obs > EXACT_KNN_MAX_CELLS,
        verbose=False,
    )
    info = adata.uns["scrublet"]
    predicted = adata.obs["predicted_doublet"]
    if predicted.isna().any() or info.get("threshold") is None:
        raise ToolError(
            "Scrublet could not find a threshold automatically (the simulated doublet scores are "
            "not bimodal); call detect_doublets again with threshold=... (e.g. 0.25)"
        )
    predicted = predicted.astype(bool).to_numpy()
    return {
        "n_cells": adata.n_obs,
        "n_predicted_doublets": int(predicted.sum()),
        "detected_doublet_rate": round(float(predicted.mean()), 4),
        "threshold": round(float(info["threshold"]), 4),
        "threshold_automatic": threshold is None,
        "expected_doublet_rate": expected_doublet_rate,
        "doublet_score": quantiles(adata.obs["doublet_score"], 3),
        "scanpy_params": scanpy_params(adata, "scrublet") or info.get("parameters", {}),
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
