"""Resolution choice and cell-type labels: planted populations, weak structure, near-tied
labels, labels only on evidence (Unknown with its reason), a wrong marker list caught, real
PBMCs at cell-type level, a single-lineage real sample, mouse and lower-case gene symbols.

The synthetic types are planted from gene programmes written apart from the marker sets
(tests/test_synthetic.py checks that), so a wrong marker list fails these tests."""

from __future__ import annotations

import io
import json
from importlib import resources
from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd
import pytest
import scanpy as sc
from sklearn.metrics import adjusted_rand_score

from agent.data.synthetic import load_truth
from agent.testing.reference_run import call_tool as call
from agent.testing.reference_run import run_reference
from agent.tools.annotate import UNKNOWN, default_marker_sets
from agent.tools.session import Session
from tests.fixtures_realdata import PUBLISHED_FLOORS, per_type_agreement, shipped_or_skip

T_TYPES = ("CD4 naive T", "CD4 memory T", "Treg", "CD8 naive T", "CD8 effector-memory T")
T_LINEAGE = (*T_TYPES, "T", "CD4 T", "CD8 T")  # with the lineage and its groups' labels
# pbmc68k_reduced's shipped Louvain clusters: the published floors, but 21 of the 129 CD14+
# monocytes sit in Louvain 5, whose cells detect CD3 in 83% (doublets by the look): Unknown there,
# its myeloid and NK gates failing on CD3 (issue 37).
LOUVAIN_FLOORS = {**PUBLISHED_FLOORS, "CD14+ Monocyte": 0.75}


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
    """Cells drawn from one Gaussian: no resolution separates them, and the result says so; the
    choice is the resolution that keeps them in one cluster."""
    rng = np.random.default_rng(0)
    adata = ad.AnnData(rng.normal(size=(400, 30)).astype(np.float32))
    sc.pp.pca(adata, n_comps=10)
    sc.pp.neighbors(adata, n_neighbors=15, random_state=0)
    session = Session(tmp_path)
    session.adata, session.done = adata, {"neighbors"}
    out = call(session, "cluster_sweep", resolutions=[0.5, 1.0])
    assert out.ok, out.error
    warnings = " ".join(out.result["warnings"])
    assert "weak structure" in warnings and "coarsest swept" in warnings
    assert out.result["best_n_clusters"] == 1, out.result["table"]
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
    t_clusters = sorted(majority[majority.isin(T_TYPES)].index)
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
    # the human monocyte programme in mouse case lacks Lyz2/Ly6c2/Ccr2 and has S100a8/S100a9/
    # Csf3r, which in mouse mark neutrophils: those cells are left out here
    for cell_type in ("CD4 naive T", "B", "NK", "Platelet"):
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


def _labels(session: Session, small_input) -> tuple[pd.Series, pd.Series]:
    truth = _singlet_truth(session, small_input)
    return truth, session.adata.obs["cell_type"].loc[truth.index].astype(str)


def test_every_planted_type_labelled_with_its_evidence(session_at, small_input, tmp_path):
    session = session_at("rank_genes_groups")
    out = call(session, "annotate_clusters")
    assert out.ok, out.error
    truth, labels = _labels(session, small_input)
    per_type = {t: round(float((labels[truth == t] == t).mean()), 3) for t in truth.unique()}
    print("label agreement per planted type", per_type)
    assert min(per_type.values()) > 0.9, per_type
    r = out.result
    assert r["ranked_from"] == "rank_genes_groups (wilcoxon)" and r["unknown"] == {}
    for entry in r["clusters"].values():
        assert entry["score"] >= 0.1 and entry["detection"] >= 0.25 and entry["ranked_markers"]
        assert len(entry["top_types"]) == 3
    table = session.adata.uns["annotation"]["table"]
    assert len(table) == session.adata.obs["leiden"].nunique() * len(r["sets_used"])
    assert table.loc[table["qualified"], "own_ranked"].min() >= 1
    session.adata.write_h5ad(tmp_path / "a.h5ad")  # the table and set names fit an .h5ad
    assert ad.read_h5ad(tmp_path / "a.h5ad").uns["annotation"]["table"].shape == table.shape
    plot = call(session, "plot", kind="annotation_scores")
    assert plot.ok, plot.error
    assert (session.outdir / plot.result["path"]).stat().st_size > 5000


def test_a_wrong_marker_list_fails(session_at, small_input):
    """The B and NK gene lists swapped: B cells are not called 'B' nor NK cells 'NK'. The labels
    follow the genes, and the planted profiles do not copy the lists, so a wrong list shows."""
    session = session_at("rank_genes_groups")
    sets = default_marker_sets()
    sets["B"], sets["NK"] = sets["NK"], sets["B"]
    (session.outdir / "markers.json").write_text(json.dumps({"cell_types": sets}))
    out = call(session, "annotate_clusters", markers_file="markers.json")
    assert out.ok, out.error
    truth, labels = _labels(session, small_input)
    assert (labels[truth == "B"] == "B").mean() < 0.1
    assert (labels[truth == "NK"] == "NK").mean() < 0.1


def test_no_evidence_gives_unknown_with_the_reason(session_at, small_input):
    """Only sets for types the sample lacks (erythroid, mast cells) and for B: every other cell
    is Unknown, each cluster with the test its best type failed."""
    session = session_at("rank_genes_groups")
    human = default_marker_sets()
    sets = {name: human[name] for name in ("Erythroid", "Mast or basophil", "B")}
    (session.outdir / "markers.json").write_text(json.dumps({"cell_types": sets}))
    out = call(session, "annotate_clusters", markers_file="markers.json")
    assert out.ok, out.error
    truth, labels = _labels(session, small_input)
    assert (labels[truth == "B"] == "B").mean() > 0.9
    assert (labels[truth != "B"] == UNKNOWN).mean() > 0.95
    unknown = out.result["unknown"]
    assert len(unknown) >= 5 and all(reason.startswith("best ") for reason in unknown.values())
    assert all(
        any(test in reason for test in ("detection", "ranked", "score"))
        for reason in unknown.values()
    )
    assert session.adata.uns["annotation"]["unknown_reasons"] == unknown


def test_real_pbmc_clusters_get_their_sorted_cell_type(tmp_path):
    """scanpy's bundled 68k PBMC subset (log-normalised .raw, its Louvain clusters, FACS-sorted
    bulk labels): cell-type-level agreement per sorted population, and the CD34+ progenitors
    are HSPC (the issue: 'CD4 T')."""
    adata = sc.datasets.pbmc68k_reduced()
    session = Session(tmp_path)
    session.adata, session.done = adata, {"load_data", "normalize"}
    out = call(session, "annotate_clusters", groupby="louvain")
    assert out.ok, out.error
    assert out.result["ranked_from"].startswith("ranked here")  # it ships no ranking
    agreement = per_type_agreement(adata.obs["cell_type"], adata.obs["bulk_labels"])
    print("pbmc68k_reduced (Louvain) agreement per published type", agreement)
    assert all(agreement[kind] >= floor for kind, floor in LOUVAIN_FLOORS.items()), agreement
    assert set(adata.obs["cell_type"][adata.obs["bulk_labels"] == "CD34+"]) == {"HSPC"}


@pytest.fixture(scope="module")
def cd4_only(tmp_path_factory: pytest.TempPathFactory) -> Session:
    """The reference analysis, up to annotate_clusters, of pbmc68k_reduced's CD4 T sorts alone."""
    adata, published = shipped_or_skip("pbmc68k_reduced")
    folder: Path = tmp_path_factory.mktemp("cd4_only")
    adata[published.str.startswith("CD4+").to_numpy()].copy().write_h5ad(folder / "cd4.h5ad")
    session, _ = run_reference(folder / "cd4.h5ad", folder / "run", stop_after="annotate_clusters")
    return session


def test_single_lineage_sample_gets_the_lineage_label(cd4_only):
    """Only CD4 T cells (issue 24: such a sample was labelled 'Macrophage'; issue 37: pure T
    cells 75% Unknown): every cluster passes the T gate and gets a T label, the lineage's own
    where the subtype cannot be told."""
    annotation = cd4_only.adata.uns["annotation"]
    labels = set(cd4_only.adata.obs["cell_type"].astype(str))
    print("CD4 T cells only:", annotation["cluster_labels"], annotation["unknown_reasons"])
    assert labels <= set(T_LINEAGE), labels
    assert set(annotation["cluster_lineages"].values()) == {"T"}
    assert annotation["unknown_reasons"] == {}


@pytest.mark.parametrize(
    ("species", "name"), [("human", "markers.json"), ("mouse", "markers_mouse.json")]
)
def test_every_marker_gene_has_a_source_and_overlaps_are_deliberate(species, name):
    """markers_sources.tsv cites each gene of each set, and each gene a lineage needs present,
    absent or for a group of it (and nothing else); a gene in two sets is listed with its reason
    in the file's deliberate_overlaps; a set's defining genes are its own."""
    data = resources.files("agent.data")
    doc = json.loads(data.joinpath(name).read_text())
    sources = pd.read_csv(io.StringIO(data.joinpath("markers_sources.tsv").read_text()), sep="\t")
    assert list(sources.columns) == ["species", "cell_type", "gene", "source"]
    assert sources["source"].str.len().min() > 10
    cited = sources[sources["species"] == species]
    listed = {(t, g) for t, genes in doc["cell_types"].items() for g in genes}
    in_lineages = {
        (f"{name} lineage: {role}", g)
        for name, spec in doc["lineages"].items()
        for role, genes in [(r, spec[r]) for r in ("present", "absent")]
        + list(spec.get("groups", {}).items())
        for g in genes
    }
    assert set(zip(cited["cell_type"], cited["gene"], strict=True)) == listed | in_lineages
    assert all(set(g) <= set(doc["cell_types"][t]) for t, g in doc["defining_genes"].items())
    typed = [t for spec in doc["lineages"].values() for t in spec["cell_types"]]
    assert sorted(typed) == sorted(doc["cell_types"])  # every type in exactly one lineage
    assert not cited.duplicated(["cell_type", "gene"]).any()
    sets_of = pd.Series([g for _, g in listed]).value_counts()
    assert set(sets_of[sets_of > 1].index) == set(doc["deliberate_overlaps"])
    assert all(len(reason) > 20 for reason in doc["deliberate_overlaps"].values())
