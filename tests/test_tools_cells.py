"""call_cells on real cells with and without their empty droplets, and load_data's content checks
(counts in .raw, spatial spots); genes sharing a name are tested in test_tools_io.py.

The unfiltered matrix is pbmc68k_reduced's 700 real PBMCs (counts rebuilt as
tests/fixtures_realdata.py does) plus 20,000 empty droplets: multinomial draws of 1-100 UMIs from
the pooled counts of those same cells, the ambient RNA a droplet catches when the cells lyse
(agent/testing/droplets.py). The calls are compared with DropletUtils' in
test_cells_dropletutils.py.
"""

from __future__ import annotations

from pathlib import Path

import anndata as ad
import numpy as np
import pytest
from scipy import sparse

from agent.config import RunConfig
from agent.policies.reference import _conclusion
from agent.record.world_state import WorldState
from agent.runner import run_sample
from agent.testing.droplets import Droplets, is_cell, unfiltered
from agent.testing.reference_run import call_tool as call
from agent.testing.reference_run import run_reference
from agent.tools.emptydrops import count_at_or_below, dm_loglik
from agent.tools.session import Session
from tests.fixtures_realdata import shipped_or_skip

N_EMPTY = 20_000


def _real_cells() -> ad.AnnData:
    return shipped_or_skip("pbmc68k_reduced")[0]


def _unfiltered(cells: ad.AnnData, how: Droplets, path: Path) -> Path:
    unfiltered(cells, how).write_h5ad(path)
    return path


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("droplets")
    cells = _real_cells()
    paths = {"filtered": folder / "filtered.h5ad"}
    cells.write_h5ad(paths["filtered"])
    paths["unfiltered"] = _unfiltered(cells, Droplets(N_EMPTY), folder / "unfiltered.h5ad")
    return paths


def _loaded(path: Path, outdir: Path) -> Session:
    session = Session(outdir, input_path=path)
    assert call(session, "load_data").ok
    return session


def _empty_share(adata: ad.AnnData) -> float:
    return float(adata.obs_names.str.startswith("EMPTY").mean())


def test_unfiltered_droplets_keep_the_cells_and_record_the_evidence(inputs, tmp_path):
    session = _loaded(inputs["unfiltered"], tmp_path)
    out = call(session, "call_cells")
    assert out.ok, out.error
    r = out.result
    assert r["decision"] == "unfiltered" and r["reason"].startswith("unfiltered: 20,700 barcodes")
    evidence = r["evidence"]
    assert evidence["barcodes"] == 700 + N_EMPTY and evidence["share_low_count"] > 0.9
    assert 100 < evidence["inflection"] <= evidence["knee"]  # both above the empties
    assert r["barcodes_retained"] + r["barcodes_called"] == r["n_cells"] == session.adata.n_obs
    assert r["n_cells"] >= 0.95 * 700 and _empty_share(session.adata) <= 0.01
    assert r["ambient"]["barcodes"] == N_EMPTY and len(r["ambient"]["top_genes"]) == 10
    assert (r["fdr_threshold"], r["lower"], r["iterations"], r["seed"]) == (0.001, 100, 10_000, 0)
    # the p-values' floor reached some barcodes, all called: no need for more iterations
    assert r["limited"] > 0 and r["limited_not_called"] == 0 and r["warnings"] == []
    assert r["not_called"]["barcodes"] == 0
    assert r["reason"].endswith(
        f"every barcode above the inflection ({evidence['inflection']} UMIs) was called"
    )
    stored = session.adata.uns["cell_calling"]
    assert stored["decision"] == "unfiltered" and stored["retain"] == evidence["knee"]
    assert len(stored["curve"]["rank"]) == len(stored["curve"]["total"]) > 100
    assert (session.adata.obs["empty_drops_fdr"] <= 0.001).all()
    plotted = call(session, "plot", kind="barcode_rank")
    assert plotted.ok and (tmp_path / plotted.result["path"]).stat().st_size > 10_000


def test_a_filtered_matrix_passes_through_unchanged(inputs, tmp_path):
    session = _loaded(inputs["filtered"], tmp_path)
    before = session.adata.copy()
    out = call(session, "call_cells")
    assert out.ok and out.result["decision"] == "filtered"
    assert out.result["reason"].startswith("filtered: 700 barcodes, 0.0% with <= 100 UMIs")
    assert list(session.adata.obs_names) == list(before.obs_names)
    assert (session.adata.X != before.X).nnz == 0
    refused = call(session, "plot", kind="barcode_rank")  # nothing to draw: no droplets called
    assert not refused.ok and "no unfiltered droplet matrix" in refused.error


def test_droplets_without_cells_are_refused_as_input(tmp_path):
    path = tmp_path / "ambient.h5ad"
    droplets = unfiltered(_real_cells(), Droplets(5_000, seed=1))
    droplets[~is_cell(droplets.obs_names)].write_h5ad(path)
    config = RunConfig(input=path, outdir=tmp_path / "run", policy="reference")
    assert run_sample(config) == "input_refused"  # `agent run` exits 3: nothing analysed
    record = WorldState.load(config.outdir / "world_state.json")
    assert [e.tool for e in record.entries] == ["load_data", "call_cells"]
    reason = record.meta["error"]
    assert reason.startswith("input refused: call_cells: 5,000 barcodes, 100.0% with <= 100 UMIs")
    assert "cells cannot be told from empty droplets" in reason
    assert not (config.outdir / "adata.h5ad").exists()


def test_the_reference_analysis_of_droplets_matches_that_of_the_cells(inputs, tmp_path):
    """Done-when of issue 24: about as many real cells kept from the unfiltered matrix as from the
    filtered one (within 5 points), at most 1% empty barcodes in the final object."""
    final = {}
    for name, path in inputs.items():
        session, world = run_reference(path, tmp_path / name)
        assert world.entries[-1].tool == "finish" and world.entries[-1].status == "ok"
        final[name] = (session.adata, world)
    kept = {
        name: adata.n_obs - adata.obs_names.str.startswith("EMPTY").sum()
        for name, (adata, _) in final.items()
    }
    assert abs(kept["unfiltered"] - kept["filtered"]) / 700 <= 0.05, kept
    assert _empty_share(final["unfiltered"][0]) <= 0.01
    unfiltered, filtered = final["unfiltered"][1], final["filtered"][1]
    plots = {
        e.params.get("kind") for e in unfiltered.entries if e.tool == "plot" and e.status == "ok"
    }
    assert "barcode_rank" in plots
    assert "unfiltered: 20,700 barcodes" in unfiltered.entries[-1].params["conclusion"]
    calling = next(e for e in filtered.entries if e.tool == "call_cells")
    assert calling.result["decision"] == "filtered" and calling.result["n_cells"] == 700


def test_counts_in_raw_become_x_and_the_filters_work(tmp_path):
    counts = _real_cells()[:100]
    lognorm = counts.copy()
    lognorm.raw = counts
    lognorm.X = np.log1p(lognorm.X.toarray())
    lognorm.uns["log1p"] = {"base": None}
    path = tmp_path / "lognorm.h5ad"
    lognorm.write_h5ad(path)
    session = Session(tmp_path / "o", input_path=path)
    assert call(session, "load_data", layer="raw").ok
    assert session.adata.raw is None and "log1p" not in session.adata.uns
    assert (session.adata.X != counts.X).nnz == 0
    assert call(session, "filter_cells", min_genes=10).ok
    assert call(session, "filter_genes", min_cells=3).ok


def test_spatial_spots_are_named_and_skip_doublet_detection(tmp_path):
    spots = _real_cells()[:200].copy()
    rows, cols = np.divmod(np.arange(200), 20)  # Visium's hexagonal grid, 100 pixels apart
    spots.obsm["spatial"] = np.column_stack([cols * 100 + rows % 2 * 50, rows * 86.6])
    path = tmp_path / "visium.h5ad"
    spots.write_h5ad(path)
    session = Session(tmp_path / "o", input_path=path)
    out = call(session, "load_data")
    assert out.ok and out.result["modality"] == "spatial spots"
    skipped = call(session, "detect_doublets")  # the tool says why it calls none
    assert skipped.ok and "spatial spots" in skipped.result["skipped"]
    facts = {"load_data": out.result, "detect_doublets": skipped.result}
    conclusion = _conclusion(lambda tool: facts.get(tool, {}))["conclusion"]
    assert skipped.result["skipped"] in conclusion


def test_ambient_barcodes_get_uniform_p_values():
    """Barcodes drawn from the Dirichlet-multinomial null (each its own Dirichlet draw around the
    ambient profile) get p-values uniform on (0, 1]. A null simulated from the fixed profile
    alone (a multinomial) gave them all p near 1: too high, so real low-count cells were lost."""
    rng = np.random.default_rng(0)
    alpha, prop = 5.0, rng.dirichlet(np.ones(200))
    totals = rng.integers(50, 150, size=400)
    counts = [rng.multinomial(t, rng.dirichlet(alpha * prop)) for t in totals]
    observed = dm_loglik(sparse.csr_matrix(np.array(counts)), prop, alpha)
    below = count_at_or_below(totals, observed, prop, alpha, 999, np.random.default_rng(1))
    p = (below + 1) / 1000
    assert 0.02 <= (p <= 0.05).mean() <= 0.09, (p <= 0.05).mean()
    assert 0.4 <= float(np.median(p)) <= 0.6, np.median(p)


def test_iterations_grow_until_the_floor_no_longer_hides_cells(tmp_path):
    """Real cells among empties of 5-300 UMIs: with 1,000 iterations the p-values' floor
    (1/1,001), corrected over the thousands of empties above the ambient bound, misses the FDR,
    so the iterations grow tenfold until no barcode at the floor is left uncalled; capped, the
    last step goes to max_iterations itself, and the result says how many remain."""
    path = _unfiltered(_real_cells(), Droplets(N_EMPTY, (5, 300), seed=2), tmp_path / "heavy.h5ad")
    grown = call(_loaded(path, tmp_path / "grown"), "call_cells", iterations=1_000)
    assert grown.ok and grown.result["iterations"] > 1_000
    assert grown.result["limited_not_called"] == 0 and grown.result["n_cells"] >= 0.95 * 700
    session = _loaded(path, tmp_path / "capped")
    refused = call(session, "call_cells", iterations=2_000, max_iterations=1_000)
    assert not refused.ok and "iterations=2,000 must not exceed max_iterations=1,000" in (
        refused.error
    )
    capped = call(session, "call_cells", iterations=1_000, max_iterations=2_000)
    assert capped.ok and capped.result["iterations"] == 2_000  # not the 1,000 of a tenfold step
    stuck = capped.result["limited_not_called"]
    assert stuck > 0 and capped.result["n_cells"] < grown.result["n_cells"]
    assert f"{stuck:,} barcodes at the Monte-Carlo floor (1/2,001) miss FDR 0.001" in "".join(
        capped.result["warnings"]
    )


def test_non_integer_counts_are_rounded_before_the_totals(tmp_path):
    """DropletUtils rounds the matrix, then sums: estimated counts a third above their integers
    must give the totals, the ambient pool and the calls of the integer counts (row sums of the
    unrounded values lift the empties near lower above it). load_data refuses such values; the
    tool holds to DropletUtils' order for whatever object it is given."""
    path = _unfiltered(_real_cells(), Droplets(5_000, seed=3), tmp_path / "droplets.h5ad")
    results = {}
    for name, offset in (("integer", 0.0), ("estimated", 0.3)):
        session = _loaded(path, tmp_path / name)
        session.adata.X.data += offset
        out = call(session, "call_cells")
        assert out.ok, out.error
        results[name] = (out.result, list(session.adata.obs_names))
    (integer, kept), (estimated, kept_estimated) = results["integer"], results["estimated"]
    assert estimated["evidence"] == integer["evidence"]
    assert estimated["ambient"]["barcodes"] == integer["ambient"]["barcodes"] == 5_000
    assert kept_estimated == kept
