"""Doublet detection with scanpy's Scrublet, and removal of the predicted doublets."""

from __future__ import annotations

from typing import Annotated, Any

import numpy as np
import scanpy as sc
from pydantic import Field

from agent.registry import ToolError, tool
from agent.tools.common import obs_column, quantiles
from agent.tools.session import Session
from agent.tools.spots import are_spots

# Below this Scrublet's kNN has about 5 neighbours and a handful of expected doublets: no call.
MIN_CELLS = 100
# Scrublet's cost grows with cells x neighbours (k ~ sqrt(cells)) on three times as many points
# (two simulated doublets per cell): above this, cells are called in random batches of about
# this size, each with its own simulated doublets, which keeps exact kNN and a linear cost; one
# threshold, from all batches' simulated doublets, calls every cell.
BATCH_CELLS = 10000
# 10x Genomics' figure for Chromium 3' chips: about 0.8% of cells are doublets per 1,000 cells
# recovered; the expected rate where none is given, for the cells at the call (QC may have
# removed some: a slight underestimate). An automatic call above BOUND_FACTOR times the expected
# rate is bounded to it. Scrublet detects only part of the doublets (those of two distinct
# types): in its five validation sets it called 0.36-0.72 of the experimentally expected rate
# (Wolock, Lopez & Klein 2019, Cell Systems, Table 2), so twice the expected rate is about three
# times the most it called there. On small samples of one cell type its histogram minimum
# called 14.5% and 27% where about 6% were expected (issue 37): singlets that look alike.
RATE_PER_1000_CELLS = 0.008
BOUND_FACTOR = 2.0


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


def expected_rate(n_cells: int, given: float | None) -> tuple[float, str]:
    """The expected doublet rate and where it comes from: ``given``, else 10x's for ``n_cells``."""
    if given is not None:
        return given, "given"
    rate = RATE_PER_1000_CELLS * n_cells / 1000
    return rate, f"10x: {RATE_PER_1000_CELLS:.1%} per 1,000 cells, {n_cells} cells here"


def _bounded(
    scores: np.ndarray, threshold: float, expected: float, source: str
) -> tuple[float, dict[str, Any] | None]:
    """The automatic threshold, raised where it calls more than BOUND_FACTOR times the
    ``expected`` doublet rate so that only the cells scoring highest up to that bound are
    called; with the evidence (None: not bounded)."""
    scored = np.sort(scores[~np.isnan(scores)])[::-1]
    called = int((scored > threshold).sum())
    most = int(BOUND_FACTOR * expected * len(scored))
    if called <= most:
        return threshold, None
    bounded = float(scored[most])  # cells scoring above it: at most ``most``
    bound = {
        "automatic_threshold": round(threshold, 4), "automatic_called": called,
        "automatic_rate": round(called / len(scored), 4), "expected_rate": round(expected, 4),
        "expected_rate_from": source, "max_rate": round(most / len(scored), 4),
        "threshold": round(bounded, 4), "called": int((scored > bounded).sum()),
    }  # fmt: skip
    bound["warning"] = (
        f"the automatic threshold {threshold:.3f} called {called} of {len(scored)} cells "
        f"({bound['automatic_rate']:.1%}), more than {BOUND_FACTOR:g} times the expected "
        f"{expected:.1%} ({source}); bounded to the {bound['called']} highest-scoring cells "
        f"(threshold {bounded:.3f})"
    )
    return bounded, bound


def _one(values: list[Any]) -> Any:
    return values[0] if len(set(values)) == 1 else values


def not_applicable(adata: Any) -> str | None:
    """Why doublets cannot be called in these data (None: they can): too few cells for
    Scrublet's simulation, or spatial spots, which hold several cells by design."""
    if adata.n_obs < MIN_CELLS:
        return (
            f"doublets not called: Scrublet needs at least {MIN_CELLS} cells, the data have "
            f"{adata.n_obs}"
        )
    if are_spots(adata):
        return "doublets not called: spatial spots hold several cells by design"
    return None


@tool("doublets", expensive=True, stage="doublets")
def detect_doublets(
    session: Session,
    expected_doublet_rate: Annotated[float, Field(gt=0, le=0.5)] | None = None,
    threshold: Annotated[float, Field(gt=0, lt=1)] | None = None,
    n_prin_comps: Annotated[int, Field(ge=2, le=100)] = 30,
) -> dict[str, Any]:
    """Score every cell for being a doublet with Scrublet and call those above a threshold.

    Runs on raw counts, so call it before normalize. Under 100 cells or on spatial spots it
    calls none and says why (skipped). Automatic calls above 2x the expected rate are capped;
    the result says bounded. Writes obs['doublet_score'], obs['predicted_doublet'] and
    uns['scrublet']; remove_doublets removes the calls.

    Args:
        expected_doublet_rate: Expected fraction of doublets; leave out for 10x's 0.8% per
            1,000 cells.
        threshold: Doublet score above which a cell is called; leave out to set it
            automatically.
        n_prin_comps: Principal components Scrublet uses.
    """
    # Samples above BATCH_CELLS are scored in random batches, each with its own simulated
    # doublets; one threshold, from the simulated scores of all batches, calls every cell.
    # uns['scrublet'] keeps scanpy's layout (plot kind 'doublet_scores' draws it) and, for a
    # bounded call, the automatic one ('bound'). While doublets stay (a run that flags them),
    # markers and labels leave them out.
    if "normalize" in session.done:
        raise ToolError("detect_doublets needs raw counts: call it before normalize")
    adata = session.adata
    skipped = not_applicable(adata)
    if skipped:  # the doublet stage is reached: the tool itself says why none are called
        return {"n_cells": adata.n_obs, "skipped": skipped, "n_predicted_doublets": 0}
    seed = session.seed
    rate, rate_from = expected_rate(adata.n_obs, expected_doublet_rate)
    batches = _batches(adata.n_obs, seed)
    scores = np.full(adata.n_obs, np.nan)
    runs = []
    for cells in batches:
        run = _score_batch(adata[cells].copy(), rate, n_prin_comps, seed)
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
    bound = None
    if automatic:
        threshold, bound = _bounded(scores, threshold, rate, rate_from)
    called = scores > threshold  # cells Scrublet could not score (NaN) are not called
    detectable = float((sim > threshold).mean())  # Scrublet's detectable doublet fraction
    parameters = {
        "expected_doublet_rate": round(rate, 4),
        "expected_rate_from": rate_from,
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
    if bound is not None:  # the automatic call and the expected rate beside the bounded one
        adata.uns["scrublet"]["bound"] = bound
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
        "bounded": bound is not None,
    }
    if bound is not None:
        result["bound"] = {k: v for k, v in bound.items() if k != "warning"}
        result["warnings"] = [bound["warning"]]
    if len(batches) > 1 and automatic:
        # what each batch alone would have chosen: the spread the pooled threshold replaces
        result["batch_thresholds"] = [
            None if t is None else round(t, 4)
            for t in (_automatic_threshold(run["sim"]) for run in runs)
        ]
    return result


def flagged(adata: Any) -> np.ndarray:
    """Which cells are predicted doublets still in the data (a run that flags doublets keeps
    them): markers and labels' evidence leave them out. None before detect_doublets, and none
    after remove_doublets."""
    if "predicted_doublet" not in adata.obs:
        return np.zeros(adata.n_obs, bool)
    return adata.obs["predicted_doublet"].fillna(False).astype(bool).to_numpy()


@tool("doublets", needs=("detect_doublets",), resets="hvg")
def remove_doublets(session: Session) -> dict[str, Any]:
    """Remove the cells detect_doublets called doublets."""
    if session.doublets == "flag":
        raise ToolError(
            "remove_doublets: this run flags doublets (its doublets setting is 'flag'): the "
            "predicted doublets stay, marked in obs['predicted_doublet'], and markers and labels "
            "leave them out; go on without removing them"
        )
    adata = session.adata
    if "predicted_doublet" not in adata.obs and (skipped := not_applicable(adata)):
        # detect_doublets succeeded without calling any: nothing to remove, and why
        return {"cells_before": adata.n_obs, "cells_after": adata.n_obs, "removed": 0,
                "skipped": skipped}  # fmt: skip
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
