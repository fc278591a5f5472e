"""QC metrics, the cell and gene filters, and doublet detection on a real-shaped sample."""

from __future__ import annotations

import numpy as np
import pytest

from agent.data.synthetic import load_truth
from tests.fixtures_data import call_tool as call


def test_qc_metrics_quantiles_and_mad_suggestions(session_at, small_input):
    session = session_at("filter_genes")
    out = call(session, "qc_metrics")
    assert out.ok, out.error
    r = out.result
    assert r["gene_sets"] == {"mt": 13, "ribo": 77, "hb": 10}
    for key in ("genes_per_cell", "counts_per_cell", "pct_counts_mt"):
        values = list(r[key].values())
        assert list(r[key]) == ["p1", "p5", "p25", "p50", "p75", "p95", "p99"]
        assert values == sorted(values)
    s = r["suggested_thresholds"]
    assert s["min_genes"] < r["genes_per_cell"]["p50"] < s["max_genes"]
    assert r["pct_counts_mt"]["p50"] < s["max_pct_mt"] < 20  # damaged cells sit at 15-60%
    # the suggestion flags the planted damaged cells and few healthy ones
    truth = load_truth(small_input).loc[session.adata.obs_names]
    flagged = session.adata.obs["pct_counts_mt"] > s["max_pct_mt"]
    assert flagged[truth["is_damaged"].to_numpy()].mean() > 0.9
    assert flagged[~truth["is_damaged"].to_numpy()].mean() < 0.15
    assert r["cells_outside_each"]["max_pct_mt"] == flagged.sum()


@pytest.mark.parametrize(
    ("args", "message"), [({"nmads": 0}, "nmads"), ({"nmads_mt": 11}, "nmads_mt")]
)
def test_qc_metrics_bad_values(session_at, args, message):
    out = call(session_at("filter_genes"), "qc_metrics", **args)
    assert not out.ok and message in out.error


def test_qc_metrics_without_mitochondrial_genes(session_at):
    out = call(
        session_at("filter_genes"), "qc_metrics", mt_prefix="mt-"
    )  # mouse prefix, human data
    assert out.ok and out.result["gene_sets"]["mt"] == 0 and out.result["pct_counts_mt"]["p99"] == 0


def test_filter_cells_happy_path_and_errors(session_at):
    session = session_at("load_data")
    n = session.adata.n_obs
    out = call(session, "filter_cells", min_genes=200)
    assert out.ok
    assert out.result["cells_before"] == n and out.result["cells_after"] == session.adata.n_obs < n
    assert np.diff(session.adata.X.indptr).min() >= 200
    for args, message in [
        ({}, "give at least one"),
        ({"min_genes": 500, "max_genes": 100}, "min_genes=500 is above max_genes=100"),
        ({"min_genes": 10**6}, "would remove all"),
        ({"min_genes": -1}, "greater than or equal to 0"),
        ({"min_genes": "many"}, "min_genes='many'"),
    ]:
        before = session.adata.shape
        out = call(session, "filter_cells", **args)
        assert not out.ok and message in out.error, out.error
        assert session.adata.shape == before  # a refused filter changes nothing


def test_filter_genes(session_at):
    session = session_at("filter_cells")
    out = call(session, "filter_genes", min_cells=50)
    assert out.ok and out.result["removed"] == out.result["genes_before"] - session.adata.n_vars > 0
    assert ((session.adata.X > 0).sum(0) >= 50).all()
    assert not call(session, "filter_genes", min_cells=None).ok
    assert "would remove all" in call(session, "filter_genes", min_counts=10**9).error


def test_filter_by_qc_needs_qc_metrics_and_applies_thresholds(session_at):
    out = call(session_at("filter_genes"), "filter_by_qc", max_pct_mt=10)
    assert not out.ok and "needs qc_metrics first" in out.error
    session = session_at("qc_metrics")
    out = call(session, "filter_by_qc", max_pct_mt=10, min_genes=300)
    assert out.ok
    assert set(out.result["removed_by"]) == {"max_pct_mt", "min_genes"}
    assert session.adata.obs["pct_counts_mt"].max() <= 10
    assert session.adata.obs["n_genes_by_counts"].min() >= 300
    assert not call(session, "filter_by_qc", max_pct_mt=150).ok  # a percent is at most 100


def test_detect_and_remove_doublets(session_at, small_input):
    session = session_at("filter_by_qc")
    out = call(session, "detect_doublets", expected_doublet_rate=0.05)
    assert out.ok, out.error
    r = out.result
    assert r["n_predicted_doublets"] == session.adata.obs["predicted_doublet"].sum()
    assert 0 < r["threshold"] < 1 and r["threshold_automatic"]
    truth = load_truth(small_input).loc[session.adata.obs_names]
    called = session.adata.obs["predicted_doublet"].to_numpy()
    assert called[truth["is_doublet"].to_numpy()].mean() > 0.4  # recall of planted doublets
    assert called[~truth["is_doublet"].to_numpy()].mean() < 0.05
    out = call(session, "remove_doublets")
    assert out.ok and out.result["removed"] == r["n_predicted_doublets"]
    assert not session.adata.obs["predicted_doublet"].any()


def test_doublet_steps_in_the_wrong_order(session_at):
    out = call(session_at("filter_by_qc"), "remove_doublets")
    assert not out.ok and "needs detect_doublets first" in out.error
    out = call(session_at("normalize"), "detect_doublets")
    assert not out.ok and "before normalize" in out.error


@pytest.mark.parametrize("rate", [0, 0.9])
def test_doublet_rate_out_of_range(session_at, rate):
    out = call(session_at("filter_by_qc"), "detect_doublets", expected_doublet_rate=rate)
    assert not out.ok and "expected_doublet_rate" in out.error
