"""Normalisation to annotation, and plots: happy paths, order checks, bad values."""

from __future__ import annotations

import json

import numpy as np
import pytest
import scanpy as sc
from sklearn.metrics import adjusted_rand_score

from agent.data.synthetic import load_truth
from agent.testing.reference_run import call_tool as call
from agent.tools import TOOLS, build_registry

PNG = b"\x89PNG\r\n\x1a\n"


def test_normalize_keeps_counts_and_all_genes(session_at):
    session = session_at("remove_doublets")
    counts = session.adata.X.copy()
    out = call(session, "normalize")
    assert out.ok
    adata = session.adata
    totals = np.asarray(counts.sum(1)).ravel()
    assert out.result["target_sum"] == float(np.median(totals))
    assert (adata.layers["counts"] != counts).nnz == 0
    assert np.allclose(np.expm1(adata.X).sum(1), out.result["target_sum"], rtol=1e-4)
    assert adata.raw is None and adata.n_vars == counts.shape[1]  # X: all genes, log-normalised
    again = call(session, "normalize")
    assert not again.ok and "already" in again.error


def test_steps_before_their_prerequisites_say_what_is_missing(session_at):
    loaded = session_at("load_data")
    for tool, args, missing in [
        ("highly_variable_genes", {}, "normalize"),
        ("pca", {}, "normalize"),
        ("neighbors", {}, "pca"),
        ("umap", {}, "neighbors"),
        ("leiden", {}, "neighbors"),
        ("cluster_sweep", {}, "neighbors"),
    ]:
        out = call(loaded, tool, **args)
        assert not out.ok and f"needs {missing}" in out.error, (tool, out.error)
    out = call(session_at("pca"), "leiden", resolution=1.0)
    assert not out.ok and "leiden needs neighbors first" in out.error


def test_highly_variable_genes(session_at):
    session = session_at("normalize")
    n_genes = session.adata.n_vars
    out = call(session, "highly_variable_genes", n_top_genes=n_genes + 1)
    assert not out.ok and f"more than the {n_genes} genes" in out.error
    out = call(
        session, "highly_variable_genes", flavor="seurat", n_top_genes=300, subset=True, limit=5
    )
    assert out.ok and session.adata.n_vars == 300 and len(out.result["top_genes"]) == 5
    assert out.result["left_out"] == 295 and session.adata.raw.n_vars == n_genes
    assert not call(session, "highly_variable_genes", flavor="magic").ok
    kept = session_at("normalize")
    out = call(kept, "highly_variable_genes", flavor="seurat", n_top_genes=300)
    assert out.ok and kept.adata.n_vars == n_genes
    assert kept.adata.var["highly_variable"].sum() == 300


def test_seurat_v3_picks_the_planted_markers(session_at):
    session = session_at("normalize")
    out = call(session, "highly_variable_genes", flavor="seurat_v3", n_top_genes=500)
    assert out.ok, out.error
    hvg = set(session.adata.var_names)
    assert {"LYZ", "MS4A1", "GNLY", "CD3D", "PPBP"} <= hvg


def test_regress_out_keys(session_at):
    session = session_at("highly_variable_genes")
    session.adata = session.adata[:, session.adata.var["highly_variable"]].copy()  # fewer: faster
    out = call(session, "regress_out", keys=["no_such_column"])
    assert not out.ok and "no_such_column" in out.error
    out = call(session, "regress_out", keys=["total_counts", "pct_counts_mt"])
    assert out.ok, out.error
    x = session.adata.X
    mt = session.adata.obs["pct_counts_mt"].to_numpy()
    corr = [abs(np.corrcoef(x[:, j], mt)[0, 1]) for j in range(20) if x[:, j].std() > 0]
    assert max(corr) < 0.05  # the covariate is gone from every gene


def test_scale_and_pca(session_at):
    session = session_at("highly_variable_genes")
    logged = session.adata.X.copy()
    hvg = session.adata.var["highly_variable"].to_numpy()
    out = call(session, "scale", max_value=10)
    assert out.ok and out.result["n_genes"] == hvg.sum()
    assert (logged != session.adata.X).nnz == 0  # X stays log-normalised; pca scales a copy
    few = session.adata[:120].copy()
    session.adata, full = few, session.adata
    out = call(session, "pca", n_comps=150)
    assert not out.ok and "n_comps=150 is too many for 120 cells" in out.error
    session.adata = full
    out = call(session, "pca", n_comps=30)
    assert out.ok
    r = out.result
    assert len(r["variance_ratio"]) == 30 and r["variance_ratio"] == sorted(
        r["variance_ratio"], reverse=True
    )
    assert 3 <= r["suggested_n_pcs"] <= 15  # 8 planted types: signal in the first few components
    assert session.adata.uns["pca"]["params"]["zero_center"] is True
    assert r["genes_used"] == hvg.sum() and r["scaled"] == {"max_value": 10.0, "zero_center": True}
    assert not session.adata.varm["PCs"][~hvg].any()  # loadings only on the genes used
    scaled = sc.pp.scale(logged[:, hvg].toarray(), max_value=10, copy=True)
    expected = sc.pp.pca(scaled, n_comps=5, svd_solver="arpack", random_state=0)
    got = session.adata.obsm["X_pca"][:, :5]
    assert np.allclose(np.abs(got), np.abs(expected), atol=1e-2 * np.abs(expected).max())


def test_scale_order(session_at):
    out = call(session_at("load_data"), "scale")
    assert not out.ok and "scale needs normalize first" in out.error
    session = session_at("scale")
    assert "already" in call(session, "scale").error
    assert "before scale" in call(session, "highly_variable_genes").error
    assert not call(session, "scale", max_value=-1).ok


def test_umap_happy_path_and_bad_values(session_at):
    session = session_at("neighbors")
    out = call(session, "umap", min_dist=2.0, spread=3.0)
    assert not out.ok and "min_dist" in out.error  # at most 1
    out = call(session, "umap", min_dist=0.8, spread=0.5)
    assert not out.ok and "must not exceed spread" in out.error
    out = call(session, "umap", min_dist=0.3)
    assert out.ok and session.adata.obsm["X_umap"].shape == (session.adata.n_obs, 2)
    assert out.result["extent"][0][0] < out.result["extent"][0][1]


def test_neighbors_n_pcs_beyond_pca(session_at):
    session = session_at("pca")
    available = session.adata.obsm["X_pca"].shape[1]
    out = call(session, "neighbors", n_pcs=available + 1)
    assert not out.ok and f"more than the {available} components" in out.error
    out = call(session, "neighbors", n_neighbors=10, n_pcs=10)
    assert out.ok and out.result["scanpy_params"]["n_neighbors"] == 10


def test_leiden_resolution_bounds_and_result(session_at, small_input):
    session = session_at("umap")
    for bad in (-1, 0, 50):
        out = call(session, "leiden", resolution=bad)
        assert not out.ok and "resolution" in out.error
    assert not call(session, "leiden", key_added="bad key!").ok
    out = call(session, "leiden", resolution=0.3)
    assert out.ok
    r = out.result
    assert sum(r["cluster_sizes"].values()) == session.adata.n_obs
    assert r["n_clusters"] == session.adata.obs["leiden"].nunique()
    assert r["scanpy_params"]["resolution"] == 0.3
    truth = load_truth(small_input).loc[session.adata.obs_names]
    singlets = ~truth["is_doublet"].to_numpy()
    assert (
        adjusted_rand_score(truth["cell_type"][singlets], session.adata.obs["leiden"][singlets])
        > 0.8
    )
    again = call(session, "leiden", resolution=0.3)
    assert again.result["cluster_sizes"] == r["cluster_sizes"]  # seeded: same clusters


def test_cluster_sweep_scores_resolutions_and_keeps_no_labels(session_at):
    session = session_at("umap")
    columns = set(session.adata.obs.columns)
    out = call(session, "cluster_sweep", resolutions=[1.0, 0.1, 0.5])
    assert out.ok
    table = out.result["table"]
    assert [row["resolution"] for row in table] == [0.1, 0.5, 1.0]
    assert [row["n_clusters"] for row in table] == sorted(row["n_clusters"] for row in table)
    qualified = [row["resolution"] for row in table if row["qualified"]]
    best = out.result["best_resolution"]
    assert best == max(qualified)  # the finest that qualifies
    assert "Cohen's d" in out.result["criterion"]
    warned = " ".join(out.result["warnings"])  # a choice at the grid's edge is flagged
    assert ("finest swept" in warned) == (best == 1.0) and ("coarsest" in warned) == (best == 0.1)
    recorded = session.adata.uns["cluster_sweep"]
    assert list(recorded["table"]["resolution"]) == [0.1, 0.5, 1.0]
    assert len(recorded["clusters"]) == sum(row["n_clusters"] for row in table)  # per cluster
    assert recorded["best_resolution"] == out.result["best_resolution"]
    assert set(session.adata.obs.columns) == columns
    assert not call(session, "cluster_sweep", resolutions=[0.5]).ok  # at least two
    assert not call(session, "cluster_sweep", resolutions=[0.5, -1]).ok


def test_rank_genes_groups(session_at):
    session = session_at("leiden")
    out = call(session, "rank_genes_groups", groupby="no_such_column")
    assert not out.ok and "call leiden first" in out.error
    out = call(session, "rank_genes_groups", n_genes=3, limit=2)
    assert out.ok
    r = out.result
    assert len(r["top_markers"]) == 2 and all(len(v) == 3 for v in r["top_markers"].values())
    assert r["left_out"] == f"{r['n_groups'] - 2} groups not listed"
    first = next(iter(r["top_markers"].values()))[0]
    assert first["log2fc"] > 1 and first["pval_adj"] < 1e-3
    assert not r["use_raw"] and r["scanpy_params"]["method"] == "wilcoxon"  # X: all genes


def test_annotate_clusters_recovers_the_planted_types(session_at, small_input):
    session = session_at("rank_genes_groups")
    out = call(session, "annotate_clusters")
    assert out.ok, out.error
    truth = load_truth(small_input).loc[session.adata.obs_names]
    singlets = ~truth["is_doublet"].to_numpy()
    labels = session.adata.obs["cell_type"].astype(str).to_numpy()
    assert (labels[singlets] == truth["cell_type"].to_numpy()[singlets]).mean() > 0.9
    planted = set(truth["cell_type"][singlets]) - {"empty"}
    # every planted type's set is usable, though the data lack some of its genes: the profiles
    # are not built from the marker lists (tests/test_synthetic.py)
    assert planted <= set(out.result["sets_used"])
    assert sum(out.result["label_sizes"].values()) == session.adata.n_obs


def test_annotate_with_a_user_file_and_bad_files(session_at):
    session = session_at("leiden")
    path = session.outdir / "markers.json"
    path.write_text(
        json.dumps(
            {
                "cell_types": {
                    "Myeloid": ["LYZ", "CST3", "NOT_A_GENE"],
                    "Lymphoid": ["CD3D", "MS4A1"],
                }
            }
        )
    )
    out = call(session, "annotate_clusters", markers_file="markers.json", key_added="lineage")
    assert out.ok and set(session.adata.obs["lineage"]) <= {"Myeloid", "Lymphoid", "Unknown"}
    assert out.result["genes_missing"] == {"Myeloid": ["NOT_A_GENE"]}
    for content, message in [
        ({"cell_types": {"X": ["NOPE1", "NOPE2"]}}, "no marker set has 2 or more of its genes"),
        ({"cell_types": {"X": "LYZ"}}, "must be a non-empty list"),
        ("not json", "not valid JSON"),
    ]:
        path.write_text(content if isinstance(content, str) else json.dumps(content))
        out = call(session, "annotate_clusters", markers_file="markers.json")
        assert not out.ok and message in out.error, out.error
    out = call(session, "annotate_clusters", markers_file="../../../etc/passwd")
    assert not out.ok and "neither the run's input" in out.error


@pytest.mark.parametrize(
    ("stage", "args", "name"),
    [
        ("qc_metrics", {"kind": "qc_violin"}, "qc_violin.png"),
        ("pca", {"kind": "pca_variance"}, "pca_variance.png"),
        ("leiden", {"kind": "umap"}, "umap_leiden.png"),
        ("annotate_clusters", {"kind": "umap", "color": "cell_type"}, "umap_cell_type.png"),
        ("annotate_clusters", {"kind": "umap", "color": "LYZ", "filename": "lyz.png"}, "lyz.png"),
        ("annotate_clusters", {"kind": "dotplot"}, "dotplot.png"),
        ("rank_genes_groups", {"kind": "dotplot"}, "dotplot.png"),
    ],
)
def test_plots_write_png_files(session_at, stage, args, name):
    session = session_at(stage)
    out = call(session, "plot", **args)
    assert out.ok, out.error
    path = session.outdir / "plots" / name
    assert out.result["path"] == f"plots/{name}" and path.read_bytes()[:8] == PNG
    assert path.stat().st_size > 5000


def test_plot_errors(session_at):
    session = session_at("leiden")
    for args, message in [
        ({"kind": "umap", "color": "nope"}, "neither a cell annotation"),
        ({"kind": "umap", "filename": "../../escape.png"}, "leaves"),
        ({"kind": "umap", "filename": "x.pdf"}, "must end in .png"),
        ({"kind": "dotplot"}, "needs annotate_clusters or rank_genes_groups"),
        ({"kind": "histogram"}, "kind"),
    ]:
        out = call(session, "plot", **args)
        assert not out.ok and message in out.error, out.error
    assert not (session.outdir.parent / "escape.png").exists()
    out = call(session_at("neighbors"), "plot", kind="umap")
    assert not out.ok and "needs umap" in out.error


def test_every_tool_has_a_schema_with_descriptions():
    schemas = build_registry().schemas()
    assert [s["function"]["name"] for s in schemas] == [t.__name__ for t in TOOLS]
    assert len(schemas) == 24
    for s in schemas:
        fn = s["function"]
        assert fn["description"], fn["name"]
        for name, prop in fn["parameters"]["properties"].items():
            assert prop.get("description"), f"{fn['name']}.{name} has no description"
