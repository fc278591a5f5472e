"""Resolution choice and cell-type labels: planted populations, weak structure, near-tied
labels, mouse and lower-case gene symbols."""

from __future__ import annotations

import json

import anndata as ad
import numpy as np
import pandas as pd
import scanpy as sc
from sklearn.metrics import adjusted_rand_score

from agent.data.synthetic import load_truth
from agent.tools.session import Session
from tests.fixtures_data import call_tool as call


def _singlet_truth(session: Session, small_input) -> pd.Series:
    truth = load_truth(small_input).loc[session.adata.obs_names]
    return truth["cell_type"][~truth["is_doublet"] & ~truth["is_empty"]]


def test_sweep_chooses_the_finest_separated_resolution(session_at, small_input):
    """0.1 merges planted types, 2.0 splits them without marker genes; the choice lies between,
    recovers every planted type and keeps the 13 planted DCs in a cluster of their own."""
    session = session_at("umap")
    out = call(session, "cluster_sweep", resolutions=[0.1, 0.5, 1.0, 2.0])
    assert out.ok, out.error
    rows = {row["resolution"]: row for row in out.result["table"]}
    assert rows[2.0]["share_separated"] < 1 and not rows[2.0]["qualified"]
    assert rows[2.0]["n_clusters"] > rows[1.0]["n_clusters"] > rows[0.1]["n_clusters"]
    chosen = out.result["best_resolution"]
    assert chosen not in (0.1, 2.0)
    assert (
        call(session, "leiden", resolution=chosen).result["n_clusters"]
        == rows[chosen]["n_clusters"]
    )  # the sweep clusters exactly as leiden does
    truth = _singlet_truth(session, small_input)
    labels = session.adata.obs["leiden"].loc[truth.index]
    assert adjusted_rand_score(truth, labels) > 0.95
    dc = labels[truth == "DC"]
    dc_cluster = dc.value_counts().idxmax()
    assert (dc == dc_cluster).mean() >= 0.9 and (truth[labels == dc_cluster] == "DC").mean() >= 0.9
    call(session, "leiden", resolution=0.1, key_added="coarse")
    coarse = session.adata.obs["coarse"].loc[truth.index]
    assert coarse.nunique() < truth.nunique()  # the coarsest merges planted types
    assert adjusted_rand_score(truth, coarse) < adjusted_rand_score(truth, labels)


def test_sweep_warns_on_weak_structure(tmp_path):
    """Cells drawn from one Gaussian: no resolution separates them, and the result says so."""
    rng = np.random.default_rng(0)
    adata = ad.AnnData(rng.normal(size=(400, 30)).astype(np.float32))
    sc.pp.pca(adata, n_comps=10)
    sc.pp.neighbors(adata, n_neighbors=15, random_state=0)
    session = Session(tmp_path)
    session.adata, session.done = adata, {"neighbors"}
    out = call(session, "cluster_sweep", resolutions=[0.5, 1.0])
    assert out.ok, out.error
    warnings = " ".join(out.result["warnings"])
    assert "weak structure" in warnings and "no resolution met the criterion" in warnings
    assert adata.uns["cluster_sweep"]["warnings"] == out.result["warnings"]


def test_near_tied_marker_sets_are_flagged_ambiguous(session_at, small_input):
    session = session_at("leiden")
    sets = {
        "T a": ["CD3D", "CD3E", "IL32", "TRAC"],
        "T b": ["CD3D", "CD3E", "IL32", "CD2"],  # the same T-cell genes, one swapped
        "Myeloid": ["LYZ", "CST3", "TYROBP"],
    }
    (session.outdir / "markers.json").write_text(json.dumps({"cell_types": sets}))
    out = call(session, "annotate_clusters", markers_file="markers.json")
    assert out.ok, out.error
    r = out.result
    truth = _singlet_truth(session, small_input)
    clusters = session.adata.obs["leiden"].loc[truth.index].astype(str)
    majority = truth.groupby(clusters.to_numpy()).agg(lambda t: t.value_counts().idxmax())
    t_clusters = sorted(majority[majority.isin(["CD4 T", "CD8 T"])].index)
    assert sorted(r["ambiguous"]) == t_clusters
    assert all(set(r["ambiguous"][c].split("|")) == {"T a", "T b"} for c in t_clusters)
    mono = majority[majority == "CD14 Mono"].index[0]
    assert r["clusters"][mono]["label"] == "Myeloid" and not r["clusters"][mono]["ambiguous"]
    for c in t_clusters:
        entry = r["clusters"][c]
        assert entry["margin"] < 0.2 * entry["score"]
    flag = session.adata.obs["cell_type_ambiguous"]
    assert flag.to_numpy().tolist() == session.adata.obs["leiden"].isin(t_clusters).tolist()
    assert "within 20%" in r["ambiguity_rule"]
    default = call(session, "annotate_clusters")  # the built-in sets: clear winners here
    assert default.ok and default.result["ambiguous"] == {}


def _renamed(adata: ad.AnnData, rename) -> ad.AnnData:
    """The data with every gene symbol renamed, in .raw too where there is one."""
    raw = adata.raw.to_adata() if adata.raw is not None else None
    adata.var_names = [rename(g) for g in adata.var_names]
    if raw is not None:
        raw.var_names = [rename(g) for g in raw.var_names]
        adata.raw = raw
    return adata


def _mouse_case(gene: str) -> str:
    return "mt-" + gene[3:].capitalize() if gene.startswith("MT-") else gene.capitalize()


def test_mouse_symbols_get_the_mouse_marker_sets(session_at, small_input):
    session = session_at("leiden")
    session.adata = _renamed(session.adata, _mouse_case)
    out = call(session, "annotate_clusters")
    assert out.ok, out.error
    r = out.result
    assert r["species"] == "mouse" and r["marker_sets"] == "agent/data/markers_mouse.json"
    assert "Lyz2" in r["genes_missing"]["CD14 Mono"]  # a mouse gene the human-derived data lack
    assert session.adata.uns["annotation"]["markers"]["B"][0] == "Ms4a1"
    truth = _singlet_truth(session, small_input)
    labels = session.adata.obs["cell_type"].loc[truth.index].astype(str)
    for cell_type in ("CD4 T", "B", "NK", "CD14 Mono", "Platelet"):
        assert (labels[truth == cell_type] == cell_type).mean() > 0.9, cell_type


def test_unknown_species_gets_human_sets_matched_ignoring_case(session_at, small_input):
    session = session_at("leiden")
    session.adata = _renamed(session.adata, str.lower)
    out = call(session, "annotate_clusters")
    assert out.ok, out.error
    assert out.result["species"] == "unknown"
    assert out.result["marker_sets"] == "agent/data/markers.json"
    assert session.adata.uns["annotation"]["markers"]["B"][0] == "ms4a1"  # the data's spelling
    truth = _singlet_truth(session, small_input)
    labels = session.adata.obs["cell_type"].loc[truth.index].astype(str).to_numpy()
    assert (labels == truth.to_numpy()).mean() > 0.9
