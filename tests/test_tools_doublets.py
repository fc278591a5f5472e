"""detect_doublets on small and large samples, and the reference recipe's doublet steps."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import orjson
import pytest
import scanpy as sc

import agent.tools.doublets as doublets
from agent.data.synthetic import SampleSpec, simulate
from agent.policies.reference import (
    RECIPE,
    ReferencePolicy,
    _doublet_threshold,
)
from agent.testing.reference_run import REGISTRY
from agent.testing.reference_run import call_tool as call
from agent.tools.session import Session


def test_too_few_cells_call_no_doublets_and_say_why(session_at):
    """The doublet stage is reached (finish accepts it) with the tool's own reason, no data
    changed."""
    session = session_at("filter_by_qc")
    session.adata = session.adata[:60].copy()
    before = session.digest()
    out = call(session, "detect_doublets")
    assert out.ok and out.result["n_predicted_doublets"] == 0
    assert "at least 100 cells" in out.result["skipped"] and "have 60" in out.result["skipped"]
    assert session.digest() == before and "doublets" in session.stages


def test_principal_components_shrink_to_a_small_sample(session_at):
    session = session_at("filter_by_qc")
    session.adata = session.adata[:150, :60].copy()  # 23 variable genes: 30 PCs fail in scanpy
    out = call(session, "detect_doublets", n_prin_comps=30)
    assert out.ok, out.error
    assert 2 <= out.result["n_prin_comps"] < 30
    assert out.result["n_prin_comps"] < doublets._scrublet_genes(session.adata)


@pytest.fixture(scope="module")
def planted() -> tuple[Any, np.ndarray]:
    """2,400 synthetic cells (empty and damaged barcodes dropped) and which are planted doublets."""
    adata, truth = simulate(SampleSpec("mid", 2400, seed=5))
    keep = ~(truth["is_empty"] | truth["is_damaged"]).to_numpy()
    adata = adata[keep].copy()
    sc.pp.filter_genes(adata, min_cells=3)
    return adata, truth["is_doublet"].to_numpy()[keep]


def _recall_and_false_calls(tmp_path: Path, adata: Any, doublet: np.ndarray) -> tuple[Any, ...]:
    session = Session(tmp_path, seed=0)
    session.adata = adata.copy()
    out = call(session, "detect_doublets", expected_doublet_rate=0.06)
    assert out.ok, out.error
    called = session.adata.obs["predicted_doublet"].to_numpy()
    assert out.result["n_predicted_doublets"] == called.sum()
    return out.result, called[doublet].mean(), called[~doublet].mean(), session


def _scanpy_layout(session: Session, result: dict[str, Any]) -> Any:
    """uns['scrublet'] as sc.pp.scrublet writes it, one threshold for every cell, and scanpy's
    own figure of it after a round trip through .h5ad; returns the object read back."""
    adata = session.adata
    stored = adata.uns["scrublet"]
    assert stored["threshold"] == pytest.approx(result["threshold"], abs=1e-4)
    scores = adata.obs["doublet_score"].to_numpy()
    assert (adata.obs["predicted_doublet"].to_numpy() == (scores > stored["threshold"])).all()
    n_sim = len(stored["doublet_scores_sim"])
    assert n_sim == 2 * adata.n_obs and stored["doublet_parents"].shape == (n_sim, 2)
    assert stored["doublet_parents"].max() < adata.n_obs  # positions of this object's cells
    assert stored["parameters"]["expected_doublet_rate"] == 0.06
    path = session.outdir / "scrublet.h5ad"
    adata.write_h5ad(path)
    back = sc.read_h5ad(path)
    fig = sc.pl.scrublet_score_distribution(back, return_fig=True, show=False)
    drawn = {line.get_xdata()[0] for ax in fig.axes for line in ax.get_lines()}
    assert drawn == {stored["threshold"]}  # the one threshold, on both histograms
    return back


def test_batches_keep_the_recall_of_one_call_under_one_threshold(planted, tmp_path, monkeypatch):
    adata, doublet = planted
    whole, recall, false, session = _recall_and_false_calls(tmp_path / "whole", adata, doublet)
    assert whole["batches"] == 1 and "batch_thresholds" not in whole
    _scanpy_layout(session, whole)
    monkeypatch.setattr(doublets, "BATCH_CELLS", 1200)  # as a large sample is called
    batched, recall_b, false_b, session = _recall_and_false_calls(
        tmp_path / "batched", adata, doublet
    )
    assert batched["batches"] == 2 and batched["cells_per_batch"] <= 1200
    assert recall > 0.7 and recall_b >= recall - 0.05
    assert false < 0.02 and false_b < 0.02
    # one threshold from both batches' simulated doublets; what each alone would pick beside it
    assert len(batched["batch_thresholds"]) == 2
    _scanpy_layout(session, batched)
    pooled = doublets._automatic_threshold(session.adata.uns["scrublet"]["doublet_scores_sim"])
    assert batched["threshold"] == round(pooled, 4)


def _calls_until_normalize(doublets: dict) -> list[str]:
    """The reference policy's calls, each succeeding, when detect_doublets answers ``doublets``."""
    results = {"qc_metrics": {"n_cells": 2000}, "detect_doublets": doublets}
    world, names = SimpleNamespace(entries=[], meta={}), []
    policy = ReferencePolicy(REGISTRY)
    while "normalize" not in names:
        sent = policy.decide([], [], world).calls[0]
        names.append(sent.name)
        world.entries.append(SimpleNamespace(
            step=len(names), tool=sent.name, params=orjson.loads(sent.arguments),
            rejected_arguments=None, status="ok", result=results.get(sent.name, {}), error=None,
        ))  # fmt: skip
    return names


def test_recipe_asks_for_doublets_and_goes_on_where_the_tool_calls_none():
    """The tool says where doublets cannot be called (too few cells, spots); the recipe then
    neither draws their scores nor removes any."""
    skipped = _calls_until_normalize({"skipped": "too few cells", "n_predicted_doublets": 0})
    assert "detect_doublets" in skipped and "remove_doublets" not in skipped
    called = _calls_until_normalize({"n_predicted_doublets": 12})
    assert {"detect_doublets", "remove_doublets"} <= set(called)


def test_threshold_fallback_keeps_the_rate():
    many = {"filter_by_qc": {"cells_after": 2000}}
    assert _doublet_threshold(lambda t: many.get(t, {})) == {
        "expected_doublet_rate": 0.06,
        "threshold": 0.25,
    }


def test_doublet_figure_and_filter_settings_in_the_final_object(session_at):
    steps = [(s.tool, s.kind) for s in RECIPE]
    drawn = steps.index(("plot", "doublet_scores"))
    assert steps.index(("detect_doublets", None)) < drawn < steps.index(("remove_doublets", None))
    out = call(session_at("detect_doublets"), "plot", kind="doublet_scores")
    assert out.ok and out.result["bytes"] > 10_000, out.error
    session = session_at("plot")  # the last step before finish
    assert call(session, "finish", conclusion="test").ok
    final = sc.read_h5ad(session.layout.final)
    fig = sc.pl.scrublet_score_distribution(final, return_fig=True, show=False)
    assert len(fig.axes) == 2
    uns = final.uns
    assert uns["filter_cells"]["min_genes"] > 0
    assert uns["filter_cells"]["cells_after"] < uns["filter_cells"]["cells_before"]
    assert uns["filter_genes"]["min_cells"] == 3 and "genes_after" in uns["filter_genes"]
    removal = uns["remove_doublets"]
    assert removal["threshold"] == round(float(uns["scrublet"]["threshold"]), 4)
    assert removal["cells_after"] == removal["cells_before"] - removal["removed"]


@pytest.fixture(scope="module")
def uniform() -> Any:
    """150 synthetic B cells of one profile, no doublets planted: Scrublet's histogram minimum
    calls about a third of them (issue 37: 27% and 14.5% on small uniform samples)."""
    adata, truth = simulate(
        SampleSpec("uniform", 150, seed=3, composition={"B": 1.0}, doublet_fraction=0,
                   damaged_fraction=0, empty_fraction=0)
    )  # fmt: skip
    assert not truth["is_doublet"].any()
    sc.pp.filter_genes(adata, min_cells=3)
    return adata


def test_an_automatic_call_far_above_the_expected_rate_is_bounded(uniform, tmp_path):
    """With a given rate the call is bounded to twice it, flagged with both numbers, and kept in
    uns; a threshold given is not bounded."""
    session = Session(tmp_path, seed=0)
    session.adata = uniform.copy()
    out = call(session, "detect_doublets", expected_doublet_rate=0.06)
    assert out.ok, out.error
    r, bound = out.result, out.result["bound"]
    assert r["bounded"] and bound["automatic_rate"] > 2 * 0.06, bound
    assert bound["expected_rate"] == 0.06 and bound["expected_rate_from"] == "given"
    assert r["n_predicted_doublets"] == bound["called"] <= 0.12 * 150
    assert r["threshold"] == bound["threshold"] > bound["automatic_threshold"]
    assert f"{bound['automatic_called']} of 150" in r["warnings"][0] and "6.0%" in r["warnings"][0]
    stored = session.adata.uns["scrublet"]
    assert stored["bound"]["automatic_called"] == bound["automatic_called"]
    assert session.adata.obs["predicted_doublet"].sum() == bound["called"]
    given = call(session, "detect_doublets", expected_doublet_rate=0.06, threshold=0.1)
    assert given.ok and not given.result["bounded"]


def test_the_default_rate_is_10x_for_the_cells_at_the_call(uniform, tmp_path):
    """No rate given: 10x's 0.8% per 1,000 cells for the 150 cells here (0.12%), so the
    automatic call is bounded to 2 x 0.12% x 150 = 0.36, no cell, where Scrublet's default 5%
    allowed 10%."""
    session = Session(tmp_path, seed=0)
    session.adata = uniform.copy()
    out = call(session, "detect_doublets")
    assert out.ok, out.error
    r = out.result
    assert r["expected_doublet_rate"] == 0.0012 and "150 cells here" in r["expected_rate_from"]
    assert r["bounded"] and r["bound"]["expected_rate"] == 0.0012
    assert r["n_predicted_doublets"] == 0


def test_remove_doublets_after_a_skipped_detection_removes_none_and_says_why(session_at):
    session = session_at("filter_by_qc")
    session.adata = session.adata[:60].copy()
    assert call(session, "detect_doublets").ok
    out = call(session, "remove_doublets")
    assert out.ok and out.result["removed"] == 0, out.error
    assert "at least 100 cells" in out.result["skipped"] and session.adata.n_obs == 60
