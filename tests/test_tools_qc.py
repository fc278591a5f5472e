"""QC metrics, the cell and gene filters, and doublet detection on a real-shaped sample."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from scipy import sparse

from agent.data.synthetic import SampleSpec, load_truth, write_sample
from agent.policies.reference import RECIPE, _conclusion, _min_genes, _qc_thresholds
from agent.testing.reference_run import call_tool as call
from agent.tools.plots import _figure, plt
from agent.tools.qc import _suggest
from agent.tools.session import Session


def test_qc_metrics_quantiles_and_mad_suggestions(session_at, small_input):
    session = session_at("filter_genes")
    out = call(session, "qc_metrics")
    assert out.ok, out.error
    r = out.result
    assert r["gene_sets"] == {"mt": 13, "ribo": 77, "hb": 10}
    assert r["species"] == "human" and r["patterns"]["mt_prefix"] == "MT-"
    assert r["floors_applied"] == []  # the demo's spreads need no floor
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


def test_without_mitochondrial_genes_no_mt_filter_is_applied(session_at):
    session = session_at("filter_genes")
    out = call(session, "qc_metrics", mt_prefix="NOSUCH-")
    r = out.result
    assert out.ok and r["gene_sets"]["mt"] == 0 and r["pct_counts_mt"]["p99"] == 0
    assert r["suggested_thresholds"]["max_pct_mt"] is None  # not a 5% cut that cannot act
    assert "max_pct_mt" not in r["cells_outside_each"] and "pct_counts_mt" not in r["spread"]
    assert "no max_pct_mt filter was applied" in r["not_applied"]["max_pct_mt"] == r["warnings"][0]
    stored = session.adata.uns["qc_thresholds"]
    assert "max_pct_mt" not in stored["suggested"] and "max_pct_mt" in stored["not_applied"]
    # the reference recipe sends no MT cut-off and says so in its conclusion
    facts = lambda tool: {"qc_metrics": r}.get(tool, {})  # noqa: E731
    assert _qc_thresholds(facts) == {
        k: r["suggested_thresholds"][k] for k in ("min_genes", "max_genes")
    }
    assert call(session, "filter_by_qc", max_pct_mt=20.0).error.startswith(
        "filter_by_qc: no mitochondrial genes"
    )
    out = call(session, "filter_by_qc", min_genes=300, max_pct_mt=20.0)
    assert out.ok and out.result["thresholds"] == {"min_genes": 300}
    assert (
        "max_pct_mt" in out.result["not_applied"] and "max_pct_mt" not in out.result["removed_by"]
    )
    assert session.adata.uns["qc_thresholds"]["applied"] == {"min_genes": 300}
    assert "no mitochondrial genes: no MT filter" in _conclusion(facts)["conclusion"]


def _mt_counts_zero_or_one(session, n_outliers: int = 12) -> np.ndarray:
    """Most cells 0 or 1 mitochondrial count, a few at 15% of their counts; returns those few."""
    adata = session.adata
    x = adata.X.toarray()
    mt = np.flatnonzero(adata.var_names.str.startswith("MT-"))
    rng = np.random.default_rng(0)
    x[:, mt] = 0
    x[rng.random(adata.n_obs) < 0.4, mt[0]] = 1
    outliers = rng.choice(adata.n_obs, n_outliers, replace=False)
    x[outliers, mt[0]] = np.round(0.15 / 0.85 * x[outliers].sum(axis=1))
    adata.X = sparse.csr_matrix(x)
    return outliers


def test_zero_mad_of_pct_mt_is_floored(session_at):
    session = session_at("filter_genes")
    outliers = _mt_counts_zero_or_one(session)
    out = call(session, "qc_metrics")
    assert out.ok, out.error
    r = out.result
    pct = session.adata.obs["pct_counts_mt"].to_numpy()
    assert r["spread"]["pct_counts_mt"]["mad"] == 0 and (pct > 0).mean() > 0.3  # median + k*0
    assert r["suggested_thresholds"]["max_pct_mt"] == 5.0
    assert "max_pct_mt" in r["floors_applied"][-1] and "max(5.0" in r["method"]
    flagged = np.flatnonzero(pct > r["suggested_thresholds"]["max_pct_mt"])
    assert set(flagged) == set(outliers)  # only the planted outliers


def test_zero_mad_of_genes_and_counts_is_floored():
    same = np.log1p(np.full(50, 1000.0))
    obs = pd.DataFrame(
        {"log1p_n_genes_by_counts": same, "log1p_total_counts": same, "pct_counts_mt": np.ones(50)}
    )
    suggested, spread, floors = _suggest(obs, nmads=5, nmads_mt=3)
    assert suggested["min_genes"] < 1000 / 1.5 and suggested["max_counts"] > 1000 * 1.5
    assert spread["log1p_n_genes"] == {"median": round(same[0], 4), "mad": 0, "mad_used": 0.1}
    assert len(floors) == 4  # three spreads and max_pct_mt


# the mouse globins (MGI) in place of the human ones: their symbols are not a change of case
MOUSE_GLOBINS = dict(zip(
    ["HBA1", "HBA2", "HBB", "HBD", "HBG1", "HBG2", "HBM", "HBQ1", "HBZ", "HBE1"],
    ["Hba-a1", "Hba-a2", "Hbb-bs", "Hbb-bt", "Hbb-b1", "Hbb-b2", "Hbb-y", "Hbq1a", "Hba-x",
     "Hbb-bh1"], strict=True,
))  # fmt: skip


def _mouse_case(name: str) -> str:
    if name in MOUSE_GLOBINS:
        return MOUSE_GLOBINS[name]
    return "mt-" + name[3:].capitalize() if name.startswith("MT-") else name.capitalize()


def test_qc_metrics_on_mouse_symbols(session_at, small_input):
    session = session_at("filter_genes")
    session.adata.var_names = [_mouse_case(g) for g in session.adata.var_names]
    out = call(session, "qc_metrics")
    assert out.ok, out.error
    r = out.result
    assert r["species"] == "mouse" and "title case" in r["species_evidence"]
    assert r["patterns"]["mt_prefix"] == "mt-" and r["patterns_given"] == []
    assert r["gene_sets"] == {"mt": 13, "ribo": 77, "hb": 10}
    truth = load_truth(small_input).loc[session.adata.obs_names]
    flagged = session.adata.obs["pct_counts_mt"] > r["suggested_thresholds"]["max_pct_mt"]
    assert flagged[truth["is_damaged"].to_numpy()].mean() > 0.9
    # a pattern given wins, and is matched ignoring case
    out = call(session, "qc_metrics", mt_prefix="MT-ND")
    assert (
        out.result["patterns_given"] == ["mt_prefix"] and out.result["gene_sets"]["mt"] == 7
    )  # ND1-6, ND4L


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"mt_prefix": ""}, "mt_prefix=''"),
        ({"hb_pattern": "^HB["}, "hb_pattern='^HB['"),
        ({"ribo_pattern": "^RP("}, "ribo_pattern='^RP('"),
    ],
)
def test_qc_metrics_bad_patterns(session_at, args, message):
    out = call(session_at("filter_genes"), "qc_metrics", **args)
    assert not out.ok and message in out.error


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


def test_qc_violin_before_filtering_draws_the_thresholds(session_at):
    steps = [(s.tool, s.kind) for s in RECIPE]
    violin = steps.index(("plot", "qc_violin"))
    assert steps.index(("qc_metrics", None)) < violin < steps.index(("filter_by_qc", None))
    session = session_at("qc_metrics")
    suggested = session.adata.uns["qc_thresholds"]["suggested"]
    out = call(session, "plot", kind="qc_violin")
    assert out.ok, out.error
    assert out.result["thresholds_drawn"] == {"from": "suggested", **suggested}
    assert (session.outdir / out.result["path"]).stat().st_size > 10_000
    fig = _figure(session, "qc_violin", None, "leiden")
    drawn = {line.get_ydata()[0] for ax in fig.axes for line in ax.get_lines()}
    plt.close(fig)
    assert set(suggested.values()) <= drawn
    assert call(session, "filter_by_qc", max_pct_mt=10.0, min_genes=300).ok
    out = call(session, "plot", kind="qc_violin")
    assert out.result["thresholds_drawn"] == {"from": "applied", "min_genes": 300, "max_pct_mt": 10}


def test_qc_scatter_before_filtering_draws_thresholds_with_the_legend_off_the_cells(session_at):
    steps = [(s.tool, s.kind) for s in RECIPE]
    scatter = steps.index(("plot", "qc_scatter"))
    assert steps.index(("qc_metrics", None)) < scatter < steps.index(("filter_by_qc", None))
    session = session_at("qc_metrics")
    suggested = session.adata.uns["qc_thresholds"]["suggested"]
    out = call(session, "plot", kind="qc_scatter")
    assert out.ok, out.error
    assert out.result["thresholds_drawn"] == {"from": "suggested", **suggested}
    fig = _figure(session, "qc_scatter", None, "leiden")
    ax = fig.axes[0]
    lines = {line.get_label().split()[0]: line for line in ax.get_lines()}
    assert lines["min_genes"].get_ydata()[0] == suggested["min_genes"]
    assert lines["max_counts"].get_xdata()[0] == suggested["max_counts"]
    ringed = [c for c in ax.collections if c.get_label().startswith("max_pct_mt")]
    pct = session.adata.obs["pct_counts_mt"].to_numpy()
    assert len(ringed[0].get_offsets()) == (pct > suggested["max_pct_mt"]).sum() > 0
    fig.canvas.draw()
    legend = ax.get_legend().get_window_extent()
    assert legend.y1 < ax.get_window_extent().y0  # below the axes: covers no cell
    plt.close(fig)


def _policy_min_genes(session) -> tuple[int, np.ndarray, pd.DataFrame]:
    """The reference policy's min_genes after load_data, genes per barcode, and the truth."""
    loaded = call(session, "load_data").result
    min_genes = _min_genes(lambda tool: loaded if tool == "load_data" else {})["min_genes"]
    truth = load_truth(session.input_path).loc[session.adata.obs_names]
    return min_genes, np.diff(session.adata.X.indptr), truth


def test_min_genes_from_a_shallow_sample_keeps_its_cells(tmp_path):
    shallow = SampleSpec("shallow", 80, seed=5, format="h5ad", median_umis=150)
    path = write_sample(shallow, tmp_path / "shallow")
    min_genes, genes, truth = _policy_min_genes(Session(tmp_path / "out", seed=0, input_path=path))
    healthy = ~(truth["is_empty"] | truth["is_damaged"]).to_numpy()
    assert set(truth["cell_type"][healthy & (genes < 50)]) == {"Platelet"}  # a floor of 50 lost
    assert min_genes < 50 and (genes[healthy] < min_genes).sum() == 0


def test_min_genes_still_removes_the_demo_empty_droplets(fresh_session):
    min_genes, genes, truth = _policy_min_genes(fresh_session)
    empty = truth["is_empty"].to_numpy()
    assert min_genes == 200 and (genes[empty] < min_genes).mean() > 0.95
    assert (genes[~empty] < min_genes).mean() < 0.02
