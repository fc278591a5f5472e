"""Lineage-gated labels on real data (issue 37).

Which data chose the thresholds (agent/tools/lineage.py, agent/tools/annotate.py):
- the lineage gate's detection and level thresholds (present 50% / 50%, absent 30% / 35%, ambient
  15%), its specificity and the mixed-cluster detection (60%): CellTypist's sample alone, which
  appears here only as the panel's reference ("CellTypist all genes"), never as a checked set;
- the gate's 'uniform' detection (80%): set above the synthetic demo's background genes, then
  checked on pbmc68k_reduced's T sorts, which the sets below derive from: not held out;
- the subtype evidence thresholds: all three shipped sets (pbmc68k_reduced, pbmc_small,
  CellTypist): not held out either; the sets below are subsets, a thinned copy and a panel of the
  same data, so they check those thresholds at new compositions and depths, not new tissues.
Checked here, each set analysed by the reference recipe up to annotate_clusters
(agent/testing/held_out.py): pbmc68k_reduced (its published Zheng 2017 bulk-profile labels) as T
cells only, as NK with CD8 and memory CD4 T cells, thinned to half its depth; Seurat's
pbmc_small; and the CellTypist sample on a targeted panel (the 765 genes of pbmc68k_reduced),
against its own full-gene labels. The per-type floors (PUBLISHED_FLOORS) were written down before
the sets were run with this code. `pytest -s` prints the per-type agreement
(bench/label_agreement.py too).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import anndata as ad
import numpy as np
import pandas as pd
import pytest
import scanpy as sc
from scipy import sparse

from agent.registry import ToolError
from agent.testing.held_out import (
    CD3,
    CD8_TYPES,
    T_LABELS,
    T_SORTS,
    TUNING,
    agreement,
    analyse,
    detected,
    held_out_inputs,
)
from agent.testing.reference_run import call_tool as call
from agent.tools.annotate import UNKNOWN, annotate_clusters
from agent.tools.lineage import lineage_table
from agent.tools.marker_sets import default_markers, match, parse_markers
from agent.tools.session import Session
from tests.fixtures_realdata import INSTALL_HINT, shipped_or_skip

pytestmark = pytest.mark.slow

# Lineage-level agreement floors per published type with at least MIN_CELLS cells in a set,
# fixed before these sets were run with the lineage gate of this round: the T sorts are T cells
# by FACS (their bulk subtype labels are noisy, their lineage is not); the NK sort holds CD56+
# cells, some of them CD3+ NKT cells, hence the lower floor.
PUBLISHED_FLOORS = {
    **dict.fromkeys(T_SORTS, 0.8), "CD19+ B": 0.9, "CD14+ Monocyte": 0.85, "Dendritic": 0.5,
    "CD34+": 0.8, "CD56+ NK": 0.5,
}  # fmt: skip
MIN_CELLS = 20

INPUTS = held_out_inputs()
HELD_OUT = sorted(set(INPUTS) - {TUNING})


@pytest.fixture(scope="module", params=HELD_OUT or ["none installed"])
def held_out(request: pytest.FixtureRequest, tmp_path_factory) -> dict[str, Any]:
    if request.param not in INPUTS:
        pytest.skip(f"no real set installed ({INSTALL_HINT})")
    adata, published = INPUTS[request.param]
    session = analyse(adata, tmp_path_factory.mktemp("held_out"))
    return {"name": request.param, "session": session, "published": published}


def _need(name: str) -> tuple[ad.AnnData, pd.Series | None]:
    if name not in INPUTS:
        pytest.skip(f"{name} not installed ({INSTALL_HINT})")
    return INPUTS[name]


def test_a_cd3_positive_cluster_is_never_nk(held_out):
    """By the published labels: a cluster most of whose cells are sorted T cells is not NK, and
    where its NK gate was judged, it failed on CD3."""
    published = held_out["published"]
    if published is None:
        pytest.skip(f"{held_out['name']}: no published labels")
    adata = held_out["session"].adata
    annotation = adata.uns["annotation"]
    gates = annotation["lineage_table"].set_index(["cluster", "lineage"])
    clusters = adata.obs["leiden"].astype(str)
    t_share = published.loc[adata.obs_names].isin(T_SORTS).groupby(clusters.to_numpy()).mean()
    labels = annotation["cluster_labels"]
    print(held_out["name"], {c: (labels[c], round(s, 2)) for c, s in t_share.items()})
    for cluster in t_share[t_share > 0.5].index:
        assert labels[cluster] != "NK", cluster
        if (cluster, "NK") in gates.index:
            assert "CD3D" in gates.loc[(cluster, "NK"), "gate"]
            assert not gates.loc[(cluster, "NK"), "passed"]


def test_unknown_names_the_failed_gates_and_labels_follow_a_passed_gate(held_out):
    annotation = held_out["session"].adata.uns["annotation"]
    gates = annotation["lineage_table"]
    for cluster, reason in annotation["unknown_reasons"].items():
        assert reason.startswith("no lineage gate passed: ") and "gate failed" in reason, reason
        assert annotation["cluster_lineages"][cluster] == UNKNOWN
        assert not gates.loc[gates["cluster"] == cluster, "passed"].any()
    for cluster, label in annotation["cluster_labels"].items():
        if label != UNKNOWN:  # a type of the lineage, a group of it, or its name
            lineage = annotation["cluster_lineages"][cluster]
            row = gates[(gates["cluster"] == cluster) & (gates["lineage"] == lineage)]
            assert bool(row["passed"].iloc[0]), (cluster, label)


def _per_type(held_out: dict[str, Any]) -> tuple[dict[str, float], pd.Series, pd.Series]:
    """Lineage agreement per published type with MIN_CELLS or more cells in the set; the
    labels and the published types of the cells kept."""
    published = held_out["published"]
    if published is None:
        pytest.skip(f"{held_out['name']}: no published labels")
    labels = held_out["session"].adata.obs["cell_type"].astype(str)
    per_type = agreement(labels, published)
    print(held_out["name"], "lineage agreement per published type", per_type)
    published = published.loc[labels.index]
    counted = {k: v for k, v in per_type.items() if (published == k).sum() >= MIN_CELLS}
    return counted, labels, published


def test_published_types_reach_their_floors(held_out):
    """Per published type but NK (next test): the share of its cells labelled in its lineage
    reaches PUBLISHED_FLOORS; and the CD8 cells of clusters that detect CD8A/CD8B in a quarter
    of their cells carry CD8 labels."""
    counted, labels, published = _per_type(held_out)
    low = {k: v for k, v in counted.items() if k != "CD56+ NK" and v < PUBLISHED_FLOORS[k]}
    assert not low, (low, counted)
    adata = held_out["session"].adata
    cd8 = detected(held_out["session"], ["CD8A", "CD8B"])
    clusters = adata.obs["leiden"].astype(str)
    in_cd8_cluster = clusters.map(cd8 >= 0.25).astype(bool) & published.isin(CD8_TYPES)
    carried = labels[in_cd8_cluster]
    print(held_out["name"], f"{len(carried)} published CD8 cells in CD8A/B clusters:",
          carried.value_counts().to_dict())  # fmt: skip
    assert carried.str.startswith("CD8").all(), carried.value_counts()


@pytest.mark.xfail(
    strict=True,
    reason="measured 2026-12: 0.0 on 'pbmc68k NK and T' and 'pbmc68k half depth' (floor 0.5, "
    "fixed before): the cells published as CD56+ NK (labels by correlation with sorted bulk "
    "profiles; 65% detect CD3) share Leiden clusters with CD8 T cells, which the gate calls T "
    "(a CD3+ cluster is never NK); the floor is not met",
)
def test_published_nk_cells_reach_their_floor(held_out):
    counted, _, _ = _per_type(held_out)
    if "CD56+ NK" not in counted:
        pytest.skip(f"{held_out['name']}: fewer than {MIN_CELLS} published NK cells")
    assert counted["CD56+ NK"] >= PUBLISHED_FLOORS["CD56+ NK"], counted


def test_a_t_only_sample_is_t_also_as_one_cluster(held_out):
    """Every cluster of the T-only sample passes the T gate; CD8 labels where CD8 is detected;
    taken as one cluster (nothing to rank it against) it gets the lineage, not Unknown."""
    if held_out["name"] != "pbmc68k T cells":
        pytest.skip("the T-only sample")
    session = held_out["session"]
    annotation = session.adata.uns["annotation"]
    assert set(annotation["cluster_lineages"].values()) == {"T"}, annotation["unknown_reasons"]
    assert set(annotation["cluster_labels"].values()) <= set(T_LABELS)
    assert any(label.startswith("CD8") for label in annotation["cluster_labels"].values())
    whole = Session(session.outdir / "whole", seed=0)  # the fixture's session stays as it is
    whole.adata, whole.done = session.adata.copy(), set(session.done)
    whole.adata.obs["whole"] = "all"
    out = call(whole, "annotate_clusters", groupby="whole")
    assert out.ok, out.error
    assert out.result["clusters"]["all"]["label"] in T_LABELS, out.result["clusters"]
    assert "one cluster" in out.result["ranked_from"]


def test_a_panel_keeps_the_lineages_of_all_genes(held_out, tmp_path):
    """The CellTypist sample on 765 genes: each cell's lineage as with all 32,786 genes (the
    full-gene lineages are the reference here; the sample has no published labels), except in
    clusters flagged ambiguous (its NK and T cells merge into one cluster on the panel)."""
    if held_out["name"] != "CellTypist panel":
        pytest.skip("the panel set")
    full = analyse(INPUTS[TUNING][0], tmp_path / "all")
    panel = held_out["session"].adata
    cells = panel.obs_names.intersection(full.adata.obs_names)

    def lineage(adata: ad.AnnData) -> pd.Series:
        by_cluster = adata.uns["annotation"]["cluster_lineages"]
        return adata.obs["leiden"].astype(str).map(by_cluster).loc[cells]

    same = lineage(panel) == lineage(full.adata)
    flagged = panel.obs["cell_type_ambiguous"].loc[cells].to_numpy()
    print("panel vs all genes:", pd.crosstab(lineage(panel), lineage(full.adata)))
    print("flagged ambiguous:", panel.uns["annotation"]["ambiguous"])
    assert same[(lineage(panel) != UNKNOWN).to_numpy() & ~flagged].mean() >= 0.95
    assert (same | flagged).mean() >= 0.9  # a lineage wrong on the panel is flagged
    assert (lineage(panel) == UNKNOWN).mean() <= 0.3


def test_a_set_without_its_defining_genes_is_not_used(tmp_path):
    """CD8A and CD8B filtered away: the CD8 sets are not used, the result says why, and no
    cluster is called CD8 on the sets' other genes (the issue: a myeloid cluster 'CD8 naive T'
    on CRTAM and RGS10)."""
    counts, _ = _need("pbmc68k half depth")
    session = analyse(counts[:, ~counts.var_names.isin(["CD8A", "CD8B"])].copy(), tmp_path)
    result = session.adata.uns["annotation"]
    for name in ("CD8 naive T", "CD8 effector-memory T"):
        assert "defining genes (CD8A, CD8B)" in result["sets_skipped"][name]
    assert not any(label.startswith("CD8") for label in result["cluster_labels"].values())


def test_cd3_filtered_out_of_a_sample_without_t_cells_is_absent(tmp_path):
    """Sorted B cells and monocytes carry no CD3 (zeroed: a sort leaves no T ambient): the
    recipe's gene filter removes CD3D/E/G, and the lineages that lack CD3 are judged with it
    absent instead of all being skipped (the issue: only Proliferating was left)."""
    counts, published = _need("pbmc68k half depth")
    sorted_cells = published.isin(["CD19+ B", "CD14+ Monocyte"]).to_numpy()
    sample = counts[sorted_cells].copy()
    sample.X = sparse.csr_matrix(sample.X)
    sample.X[:, sample.var_names.get_indexer(CD3)] = 0
    sample.X.eliminate_zeros()
    session = analyse(sample, tmp_path)
    annotation = session.adata.uns["annotation"]
    assert set(CD3) <= set(session.adata.uns["filter_genes"]["undetected_genes"])
    assert {"B", "Myeloid"} <= set(annotation["cluster_lineages"].values()), annotation
    labels = session.adata.obs["cell_type"].astype(str)
    assert agreement(labels, published)["CD19+ B"] >= 0.9


def _normalised(counts: ad.AnnData, groups: list[str]) -> Session:
    """A session holding ``counts`` log-normalised as the recipe leaves them, with ``groups``
    as the clusters (obs 'group')."""
    adata = ad.AnnData(sparse.csr_matrix(counts.X, dtype=np.float32), var=counts.var[[]])
    adata.obs_names = [f"cell{i}" for i in range(adata.n_obs)]
    adata.obs["group"] = pd.Categorical(groups)
    adata.layers["counts"] = adata.X.copy()
    sc.pp.normalize_total(adata)
    sc.pp.log1p(adata)
    session = Session(Path(tempfile.mkdtemp()), seed=0)
    session.adata, session.done = adata, {"normalize"}
    return session


@pytest.fixture(scope="module")
def sorted_groups() -> tuple[ad.AnnData, pd.Series]:
    """pbmc68k_reduced's counts with its published sorts."""
    return shipped_or_skip("pbmc68k_reduced")


@pytest.mark.parametrize("t_clusters", [1, 6])
def test_t_clusters_pass_when_t_cells_are_most_of_the_sample(sorted_groups, t_clusters):
    """The published T sorts split at random into ``t_clusters`` clusters beside one of the B
    sort: every T cluster passes the T gate and the B cluster the B gate (the gate compared the
    T genes with a lower quartile of clusters that fell among the T clusters themselves)."""
    counts, published = sorted_groups
    t_cells, b_cells = published.isin(T_SORTS).to_numpy(), (published == "CD19+ B").to_numpy()
    keep = t_cells | b_cells
    split = np.random.default_rng(0).integers(0, t_clusters, int(keep.sum()))
    groups = np.where(t_cells[keep], [f"T{i}" for i in split], "B")
    sample = counts[keep]
    found = match(default_markers(), sample.var_names)
    session = _normalised(sample, list(groups))
    gates = lineage_table(
        session.adata.X, session.adata.var_names, session.adata.obs["group"].astype(str),
        {k: found.lineages[k] for k in ("T", "B", "NK")},
    )  # fmt: skip
    passed = gates[gates["passed"]].groupby("cluster")["lineage"].apply(set).to_dict()
    assert passed == {"B": {"B"}, **{f"T{i}": {"T"} for i in range(t_clusters)}}, gates


def test_ambient_cd3_is_absent_and_a_b_t_mix_is_flagged(sorted_groups):
    """B cells with ambient RNA from the sample's pooled profile added until over half of them
    detect CD3, as deep data do: the B gate passes them by CD3's ambient level. B cells mixed
    with a sixth as many T cells pass the B gate by CD3's level only: labelled in the B lineage,
    flagged with T as the runner-up."""
    counts, published = sorted_groups
    rng = np.random.default_rng(0)
    matrix = sparse.csr_matrix(counts.X, dtype=np.float64)
    pooled = np.asarray(matrix.sum(axis=0)).ravel() / matrix.sum()
    b = np.flatnonzero((published == "CD19+ B").to_numpy())
    t = rng.permutation(np.flatnonzero(published.isin(T_SORTS).to_numpy()))
    mono = np.flatnonzero((published == "CD14+ Monocyte").to_numpy())
    # ambient counts per cell for CD3 to be detected in 55% of the cells by ambient alone
    load = -np.log(1 - 0.55) / pooled[counts.var_names.get_indexer(CD3)].sum()
    ambient = sparse.csr_matrix(rng.poisson(load * pooled, (len(b), len(pooled))))
    mixed = len(b) // 5  # a sixth of the mixed cluster
    parts = [(matrix[t[mixed:]], "T"), (matrix[mono], "mono"), (matrix[b] + ambient, "B ambient"),
             (sparse.vstack([matrix[b], matrix[t[:mixed]]]), "B and T")]  # fmt: skip
    sample = ad.AnnData(sparse.vstack([p for p, _ in parts]).tocsr(), var=counts.var[[]])
    session = _normalised(sample, [name for p, name in parts for _ in range(p.shape[0])])
    result = annotate_clusters(session, groupby="group")["clusters"]
    gates = session.adata.uns["annotation"]["lineage_table"].set_index(["cluster", "lineage"])
    deep = gates.loc[("B ambient", "B")]
    assert deep["absent_detection"] > 0.5 and deep["passed"], deep["gate"]
    assert deep["absent_by"] == "ambient level" and result["B ambient"]["label"] != UNKNOWN
    mix = result["B and T"]
    assert mix["lineage"] == "B" and mix["ambiguous"] and mix["runner_up"] == "T", mix
    assert "part of the cells may carry them" in mix["lineage_gate"]


def test_a_lineage_without_a_usable_type_gets_its_name(session_at):
    """A lineage whose gate passes but none of whose sets the data can use (one gene of two in
    the data) labels its clusters with the lineage's name."""
    session = session_at("rank_genes_groups")
    doc = {
        "cell_types": {"T x": ["CD3D", "NOT_A_GENE"], "B x": ["MS4A1", "CD79A", "CD79B"]},
        "lineages": {
            "T": {"present": ["CD3D", "CD3E"], "absent": [], "cell_types": ["T x"]},
            "B": {"present": ["MS4A1", "CD79A"], "absent": ["CD3D"], "cell_types": ["B x"]},
        },
    }
    (session.outdir / "m.json").write_text(json.dumps(doc))
    out = call(session, "annotate_clusters", markers_file="m.json")
    assert out.ok, out.error
    assert "T x" in out.result["sets_skipped"]
    assert "T" in out.result["label_sizes"], out.result["clusters"]


@pytest.mark.parametrize(
    ("change", "said"),
    [
        ({"lineages": {"T": {"present": ["CD3D"], "absent": [], "cell_types": ["T y"]}}},
         "names unknown cell types ['T y']"),
        ({"lineages": {"T": {"present": ["CD3D"], "absent": [], "cell_types": ["T x"],
                             "groups": ["CD8A"]}}}, "lineages['T']['groups'] must be a JSON object"),
        ({"defining_genes": ["CD3D"]}, "defining_genes must be a JSON object"),
        ({"lineages": ["T"]}, "lineages must be a JSON object"),
        ({"lineages": {"T": {"present": ["CD3D"], "absent": [], "cell_types": ["T x"]}}},
         "cell types ['B x'] are in no lineage"),
        ({"lineages": {"T": {"present": ["CD3D"], "absent": [], "cell_types": ["T x", "B x"]},
                       "B": {"present": ["MS4A1"], "absent": [], "cell_types": ["B x"]}}},
         "cell type 'B x' is in two lineages ('T' and 'B')"),
    ],
)  # fmt: skip
def test_a_malformed_markers_file_is_refused_by_field(change, said):
    doc = {"cell_types": {"T x": ["CD3D", "IL32"], "B x": ["MS4A1", "CD79A"]}, **change}
    with pytest.raises(ToolError, match=r"^m\.json: ") as refused:
        parse_markers(doc, "m.json")
    assert said in str(refused.value)
