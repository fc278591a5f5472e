"""The resolution sweep's criterion (issue 24): a size-aware separation test, per-cluster
stability, the grid-edge warning; real T cells split CD4 from CD8, one population stays whole."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from agent.data.synthetic import SampleSpec, truth_path, write_sample
from agent.testing.reference_run import call_tool as call
from agent.testing.reference_run import run_reference
from agent.tools.cluster import (
    MIN_SEPARATING_GENES,
    MIN_STABILITY,
    _choose,
    _expression,
    _pca_used,
    separating_genes,
)
from agent.tools.session import Session
from tests.fixtures_realdata import shipped_or_skip, write_truth


@pytest.fixture(scope="module")
def t_cells(tmp_path_factory: pytest.TempPathFactory) -> tuple[Session, pd.Series]:
    """scanpy's pbmc68k_reduced, only the cells published as T cells (CD4+ and CD8+ types: 192),
    through the reference recipe up to umap; with their published labels."""
    adata, labels = shipped_or_skip("pbmc68k_reduced")
    keep = labels.str.startswith(("CD4+", "CD8+")).to_numpy()
    path = tmp_path_factory.mktemp("t_cells") / "t_cells.h5ad"
    adata[keep].copy().write_h5ad(path)
    write_truth(labels[keep], truth_path(path))
    session, _ = run_reference(path, path.parent / "run", stop_after="umap")
    return session, labels[keep]


def _sweep(session: Session, tmp_path: Path, **args) -> tuple[dict, Session]:
    fresh = Session(tmp_path / "sweep", seed=session.seed)
    fresh.adata, fresh.done = session.adata.copy(), set(session.done)
    out = call(fresh, "cluster_sweep", **args)
    assert out.ok, out.error
    return out.result, fresh


def test_t_cells_split_cd4_from_cd8(t_cells, tmp_path):
    """Half of these cells are published CD8+ (CD8B detected in 44-70% of them): the choice keeps
    a cluster of CD8 cells apart from one of CD4 cells instead of one cluster for all."""
    session, labels = t_cells
    result, swept = _sweep(session, tmp_path)
    assert result["best_n_clusters"] >= 2, result["table"]
    call(swept, "leiden", resolution=result["best_resolution"])
    clusters = swept.adata.obs["leiden"]
    cd8 = labels.loc[clusters.index].str.startswith("CD8+")
    share = cd8.groupby(clusters.to_numpy()).mean()
    assert share.max() >= 0.85 and share.min() <= 0.3, share
    recorded = swept.adata.uns["cluster_sweep"]["clusters"]
    chosen = recorded[recorded["resolution"] == result["best_resolution"]]
    assert len(chosen) == result["best_n_clusters"]
    assert (chosen["stability"] >= MIN_STABILITY).all()
    assert (chosen["separating_genes"] >= MIN_SEPARATING_GENES).all()


def test_tiny_random_subsets_do_not_separate(t_cells):
    """Ten random cells called a cluster of their own find too few separating genes, while a
    real population of the same data passes."""
    session, labels = t_cells
    adata = session.adata
    expression, coords = _expression(adata), _pca_used(adata)
    rng = np.random.default_rng(0)
    for _ in range(10):
        tiny = np.zeros(adata.n_obs, int)
        tiny[rng.choice(adata.n_obs, 10, replace=False)] = 1
        counts, nearest = separating_genes(expression, coords, tiny)
        assert counts[1] < MIN_SEPARATING_GENES and nearest[1] == 0, counts
    cytotoxic = labels.loc[adata.obs_names].eq("CD8+ Cytotoxic T").astype(int).to_numpy()
    counts, _ = separating_genes(expression, coords, cytotoxic)
    assert counts.min() >= MIN_SEPARATING_GENES, counts


def test_one_population_stays_one_cluster(tmp_path):
    """Classical monocytes alone: finer resolutions cut them into pieces without markers, which
    the sweep does not take."""
    spec = SampleSpec("mono", 600, seed=5, format="h5ad", composition={"CD14 Mono": 1.0},
                      doublet_fraction=0.0)  # fmt: skip
    path = write_sample(spec, tmp_path / "data")
    session, _ = run_reference(path, tmp_path / "run", stop_after="umap")
    result, _ = _sweep(session, tmp_path, resolutions=[0.1, 0.5, 1.0, 1.4])
    rows = {row["resolution"]: row for row in result["table"]}
    assert result["best_n_clusters"] == 1, result["table"]
    assert rows[1.4]["n_clusters"] > 1 and rows[1.4]["share_separated"] == 0
    assert any("coarsest swept" in w for w in result["warnings"]), result["warnings"]


def _row(resolution: float, qualified: bool) -> dict:
    return {
        "resolution": resolution, "qualified": qualified, "n_clusters": 3, "silhouette": 0.3,
        "share_separated": 1.0 if qualified else 0.5, "share_stable": 1.0,
        "min_stability": 0.9, "stability": [0.9, 0.95, 1.0],
    }  # fmt: skip


def test_choice_at_the_grid_edge_is_flagged():
    chosen, warnings = _choose([_row(0.2, True), _row(0.5, True), _row(1.0, True)])
    assert chosen["resolution"] == 1.0 and "finest swept" in " ".join(warnings)
    chosen, warnings = _choose([_row(0.2, True), _row(0.5, False), _row(1.0, False)])
    assert chosen["resolution"] == 0.2 and "coarsest swept" in " ".join(warnings)
    chosen, warnings = _choose([_row(0.2, True), _row(0.5, True), _row(1.0, False)])
    assert chosen["resolution"] == 0.5 and warnings == []
    chosen, warnings = _choose([_row(0.2, False), _row(0.5, False), _row(1.0, False)])
    assert chosen["resolution"] == 0.2 and "no resolution met the criterion" in warnings[0]
    doubtful = {**_row(0.5, True), "stability": [0.9, 0.7, 1.0]}
    _, warnings = _choose([_row(0.2, True), doubtful, _row(1.0, False)])
    assert warnings == [
        "clusters with a stability of only 0.6-0.75 at 0.5: 1 (a pattern, but which cells "
        "belong to them is doubtful)"
    ]
