"""The saved adata.h5ad after the reference recipe: an object people can reuse."""

from __future__ import annotations

import anndata as ad
import numpy as np
import pytest

from agent.testing.reference_run import call_tool as call


@pytest.fixture
def final(session_at, reference_stages) -> tuple[ad.AnnData, dict]:
    """The object finish writes after the whole recipe, and the stages' results by tool."""
    session = session_at("plot")  # the last step before finish
    out = call(session, "finish", conclusion="test")
    assert out.ok, out.error
    results = {tool: result for tool, (_, _, result, _) in reference_stages.items()}
    return ad.read_h5ad(session.layout.final), results


def test_keeps_every_filtered_gene_with_its_counts(final, small_input):
    adata, results = final
    assert adata.n_vars == results["filter_genes"]["genes_after"]
    loaded = ad.read_h5ad(small_input)[adata.obs_names, adata.var_names]
    counts = adata.layers["counts"]
    assert np.array_equal(counts.data, np.round(counts.data))  # integer counts
    assert (counts != loaded.X).nnz == 0  # the input's counts of the kept cells


def test_x_is_log_normalised_not_scaled(final):
    adata, results = final
    x = adata.X
    assert x.min() >= 0  # scaled values would be negative
    totals = np.expm1(x).sum(axis=1)
    assert np.allclose(totals, results["normalize"]["target_sum"], rtol=1e-3)


def test_holds_gene_flags_embeddings_clusters_labels_and_parameters(final):
    adata, results = final
    hvg = adata.var["highly_variable"]
    assert hvg.sum() == results["highly_variable_genes"]["n_highly_variable"] < adata.n_vars
    assert adata.obsm["X_pca"].shape == (adata.n_obs, results["pca"]["n_comps"])
    assert adata.obsm["X_umap"].shape == (adata.n_obs, 2)
    assert adata.obs["leiden"].nunique() == results["leiden"]["n_clusters"]
    assert adata.obs["cell_type"].notna().all()
    for key in ("hvg", "pca", "neighbors", "umap", "leiden", "rank_genes_groups", "scale"):
        assert key in adata.uns, key
    assert adata.uns["pca"]["params"]["mask_var"] == "highly_variable"
