"""The reference analysis on real count matrices that installed packages ship (issue 15).

Each test runs once per set (tests/fixtures_realdata.py: pbmc68k_reduced from scanpy, pbmc_small
from Debian's r-cran-seurat, CellTypist's sample); the analysis itself runs once per session.
No mouse set with gene symbols ships in a package found so far, so mouse QC is tested on
synthetic data only. `pytest -s` shows the agreement with the published labels.
"""

from __future__ import annotations

from typing import Any

import anndata as ad
import numpy as np
import pandas as pd
import pytest

from agent.data.synthetic import truth_path
from agent.record.truth import read_truth, score
from tests.fixtures_realdata import PUBLISHED_FLOORS, REAL_SETS, per_type_agreement

# ARI against the published labels, measured 2026-12 with the reference recipe of issue 15's
# branch: pbmc68k_reduced (Zheng 2017 bulk-profile labels, themselves noisy) leiden 0.478,
# cell_type 0.595. The floors sit below to leave room for the QC/resolution work in flight;
# the lead re-measures and raises them.
ARI_FLOORS = {"pbmc68k_reduced": {"leiden": 0.35, "cell_type": 0.45}}
# QC (filter_cells + filter_by_qc) removed at most 7.3% of a set (CellTypist's, all by pct MT);
# a zero-spread MT threshold removed a quarter of a PBMC sample.
MAX_QC_REMOVED = 0.15


def final_object(run: dict[str, Any]) -> ad.AnnData:
    return ad.read_h5ad(run["session"].layout.final)


def test_real_set_analysis_finishes_with_clusters(real_run: dict[str, Any]) -> None:
    finish = real_run["world"].last_ok("finish")
    assert finish is not None, f"{real_run['name']}: the reference analysis did not finish"
    assert finish.result["n_clusters"] >= 2, finish.result.get("leiden_sizes")


def test_real_set_species_found_from_genes(real_run: dict[str, Any]) -> None:
    qc = real_run["world"].last_ok("qc_metrics")
    assert qc.result["species"] == REAL_SETS[real_run["name"]].species, qc.result


def test_real_set_qc_has_no_zero_mt_threshold(real_run: dict[str, Any]) -> None:
    world = real_run["world"]
    qc = world.last_ok("filter_by_qc")
    if world.last_ok("qc_metrics").result["gene_sets"]["mt"] == 0:  # pbmc_small: 230 genes
        # a percent that is 0 in every cell: no MT cut-off is sent, and the conclusion says so
        assert qc is not None and qc.params.get("max_pct_mt") is None, qc and qc.params
        conclusion = world.last_ok("finish").params["conclusion"]
        assert "no mitochondrial genes: no MT filter" in conclusion
    else:
        assert qc is not None and qc.params["max_pct_mt"] > 0, qc and qc.params
    loaded = world.last_ok("load_data").result["n_cells"]
    removed = sum(world.last_ok(t).result["removed"] for t in ("filter_cells", "filter_by_qc"))
    assert removed / loaded <= MAX_QC_REMOVED, f"QC removed {removed} of {loaded} cells"


def test_real_set_final_object_keeps_genes_and_counts(real_run: dict[str, Any]) -> None:
    final = final_object(real_run)
    genes_after = real_run["world"].last_ok("filter_genes").result["genes_after"]
    assert final.n_vars == genes_after, "the final object dropped genes that passed filtering"
    assert "highly_variable" in final.var
    shipped = ad.read_h5ad(real_run["input"])[final.obs_names, final.var_names]
    assert "counts" in final.layers, list(final.layers)
    counts = final.layers["counts"]
    assert (abs(counts - shipped.X) > 0).nnz == 0, "layers['counts'] differs from the input"
    x = final.X.toarray() if hasattr(final.X, "toarray") else np.asarray(final.X)
    assert x.min() >= 0, "X is scaled, not log-normalised"


def test_real_set_agrees_with_published_labels(real_run: dict[str, Any]) -> None:
    floors = ARI_FLOORS.get(real_run["name"])
    if floors is None:
        pytest.skip(f"{real_run['name']} ships no published labels")
    obs = final_object(real_run).obs
    truth = read_truth(truth_path(real_run["input"]))
    ari = {key: score(obs, truth, cluster_key=key)["ari"] for key in floors}
    print(f"{real_run['name']}: ARI vs published labels {ari}")
    assert all(ari[key] >= floor for key, floor in floors.items()), (ari, floors)


def test_real_set_cell_types_agree_with_published_labels(real_run: dict[str, Any]) -> None:
    """Cell-type level, per published type (PUBLISHED_TYPES); the CD34+ progenitors are HSPC
    or Unknown, never 'CD4 T' (issue 24)."""
    if real_run["name"] != "pbmc68k_reduced":
        pytest.skip(f"{real_run['name']} ships no published cell types")
    obs = final_object(real_run).obs
    published = read_truth(truth_path(real_run["input"]))["cell_type"]
    agreement = per_type_agreement(obs["cell_type"], published)
    print(f"{real_run['name']}: agreement per published type {agreement}")
    assert all(agreement[kind] >= floor for kind, floor in PUBLISHED_FLOORS.items()), agreement
    progenitors = obs["cell_type"][published.loc[obs.index] == "CD34+"].astype(str)
    assert set(progenitors) <= {"HSPC", "Unknown"}, progenitors.value_counts()


def test_real_set_b_cells_are_labelled_b(real_run: dict[str, Any]) -> None:
    """The cluster whose cells most often detect both MS4A1 and CD79A is labelled B (issue 24:
    CellTypist's was 'Mature DC')."""
    final = final_object(real_run)
    if not {"MS4A1", "CD79A"} <= set(final.var_names):
        pytest.skip(f"{real_run['name']} lacks MS4A1 or CD79A")
    counts = final[:, ["MS4A1", "CD79A"]].layers["counts"]
    both = np.asarray((counts > 0).sum(axis=1)).ravel() == 2
    share = pd.Series(both, index=final.obs_names).groupby(final.obs["leiden"].to_numpy()).mean()
    b_cluster = share.idxmax()
    labels = final.obs["cell_type"].astype(str)[final.obs["leiden"].astype(str) == b_cluster]
    print(f"{real_run['name']}: cluster {b_cluster} ({share.max():.0%} MS4A1+CD79A+) {set(labels)}")
    assert set(labels) == {"B"}, share.round(2).to_dict()
