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
# this size, each with its own simulated doublets, which keeps exact kNN and a linear cost; one
# threshold, from all batches' simulated doublets, calls every cell.
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


def _score_batch(batch: Any, rate: float, n_prin_comps: int, seed: int) -> dict[str, Any]:
    """Scrublet's scores on one batch (its threshold is set later, over all batches): observed
    and simulated scores, the simulated doublets' parents (positions in the batch), the PCs and
    neighbours used."""
    comps = min(n_prin_comps, batch.n_obs - 1, _scrublet_genes(batch) - 1)
    if comps < 2:
        raise ToolError(
            f"detect_doublets: Scrublet keeps too few variable genes ({comps + 1}) in "
            f"{batch.n_obs} cells to embed them; skip doublet detection for this sample"
        )
    sc.pp.scrublet(
        batch,
        expected_doublet_rate=rate,
        threshold=0.0,  # no call here: one threshold is found below from all simulated scores
        n_prin_comps=comps,
        random_state=seed,
        use_approx_neighbors=False,  # batches are small enough for exact, reproducible kNN
        verbose=False,
    )
    scores = batch.obs["doublet_score"].to_numpy(dtype=float)
    # Scrublet drops cells with under 3 genes (no score): its parents index the cells it kept
    kept = np.flatnonzero(~np.isnan(scores))
    found = batch.uns["scrublet"]
    return {
        "scores": scores,
        "sim": np.asarray(found["doublet_scores_sim"]),
        "parents": kept[np.asarray(found["doublet_parents"])],
        "n_neighbors": int(found["parameters"]["n_neighbors"]),
        "comps": comps,
    }


def _automatic_threshold(sim: np.ndarray) -> float | None:
    """Scrublet's automatic threshold (its call_doublets): the minimum between the two modes of
    the simulated doublet scores' histogram; None where they are not bimodal."""
    from skimage.filters import threshold_minimum

    try:
        return float(threshold_minimum(sim))
    except RuntimeError:  # no two maxima in the smoothed histogram
        return None


def _one(values: list[Any]) -> Any:
    return values[0] if len(set(values)) == 1 else values


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
    doublets; one threshold on the doublet score holds for all cells, found automatically from
    the simulated doublets' scores of all batches together unless given. Does not remove cells:
    call remove_doublets for that. The scores, simulated scores and threshold are kept in
    uns['scrublet'] as scanpy's scrublet keeps them (plot kind 'doublet_scores' draws them).

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
    scores = np.full(adata.n_obs, np.nan)
    runs = []
    for cells in batches:
        run = _score_batch(adata[cells].copy(), expected_doublet_rate, n_prin_comps, seed)
        scores[cells] = run["scores"]
        run["parents"] = cells[run["parents"]]
        runs.append(run)
    sim = np.concatenate([run["sim"] for run in runs])
    automatic = threshold is None
    if automatic:
        threshold = _automatic_threshold(sim)
        if threshold is None:
            raise ToolError(
                "Scrublet could not find a threshold automatically (the simulated doublet scores "
                "are not bimodal); call detect_doublets again with threshold=... (e.g. 0.25)"
            )
    called = scores > threshold  # cells Scrublet could not score (NaN) are not called
    detectable = float((sim > threshold).mean())  # Scrublet's detectable doublet fraction
    parameters = {
        "expected_doublet_rate": expected_doublet_rate,
        "sim_doublet_ratio": 2.0,  # scanpy's default, which the calls above use
        "n_neighbors": _one([run["n_neighbors"] for run in runs]),
        "random_state": seed,
        "n_prin_comps": _one([run["comps"] for run in runs]),
        "batches": len(batches),
        "cells_per_batch": max(len(b) for b in batches),
        "threshold_automatic": automatic,
    }
    adata.obs["doublet_score"] = scores
    adata.obs["predicted_doublet"] = called
    # scanpy's layout (sc.pp.scrublet), so sc.pl.scrublet_score_distribution draws it; the
    # parents are positions of the cells at this call
    adata.uns["scrublet"] = {
        "doublet_scores_sim": sim,
        "doublet_parents": np.concatenate([run["parents"] for run in runs]),
        "parameters": parameters,
        "threshold": threshold,
    }
    result = {
        "n_cells": adata.n_obs,
        "n_predicted_doublets": int(called.sum()),
        "detected_doublet_rate": round(float(called.mean()), 4),
        "threshold": round(threshold, 4),
        # Scrublet's own check of the expected rate: called / share of simulated ones detectable
        "detectable_doublet_fraction": round(detectable, 4),
        "estimated_doublet_rate": round(float(called.mean()) / detectable, 4)
        if detectable
        else None,
        **parameters,
        "doublet_score": quantiles(scores[~np.isnan(scores)], 3),
    }
    if len(batches) > 1 and automatic:
        # what each batch alone would have chosen: the spread the pooled threshold replaces
        result["batch_thresholds"] = [
            None if t is None else round(t, 4)
            for t in (_automatic_threshold(run["sim"]) for run in runs)
        ]
    return result


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
    result = {
        "cells_before": adata.n_obs,
        "cells_after": int((~predicted).sum()),
        "removed": int(predicted.sum()),
        "removed_fraction": round(float(np.mean(predicted)), 4),
    }
    threshold = adata.uns.get("scrublet", {}).get("threshold")
    if threshold is not None:  # the evidence of the removal, kept beside it
        result["threshold"] = round(float(threshold), 4)
    session.adata.uns["remove_doublets"] = dict(result)
    return result
