"""call_cells against DropletUtils itself (issue 37).

The oracle is Bioconductor's DropletUtils (Debian's r-bioc-dropletutils, which
tests/realdata/install.sh installs), run through Rscript with a fixed seed on the very counts
call_cells reads after load_data: real cells that packages ship among empty droplets of their own
ambient RNA, at full and thinned depth, light and heavy ambient loads, empties above the ambient
bound in most matrices and overdispersed in most, 3,000-40,000 empties (agent/testing/droplets.py
ORACLE_CASES). Knee, inflection, ambient profile and alpha are deterministic and must match; the
calls rest on Monte-Carlo p-values from two different random streams, which differ at the FDR
boundary, so the called sets must agree to Jaccard >= 0.95 and the iterations needed within one
tenfold step.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pytest
from scipy import sparse

from agent.testing.droplets import ORACLE_CASES, dropletutils, is_cell, rscript
from agent.testing.reference_run import call_tool as call
from agent.tools.cells import LOST_WARN_SHARE
from agent.tools.emptydrops import good_turing_proportions
from agent.tools.session import Session
from tests.fixtures_realdata import INSTALL_HINT, shipped_or_skip

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def compared(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Per oracle matrix: what call_cells read and returned, what it kept, and DropletUtils'."""
    if rscript() is None:
        pytest.skip(f"R with DropletUtils is not installed ({INSTALL_HINT})")
    folder = tmp_path_factory.mktemp("oracle")
    runs, inputs, cells = {}, {}, {}
    for name, case in ORACLE_CASES.items():
        if case.real_set not in cells:  # CellTypist's table takes seconds to read
            cells[case.real_set] = shipped_or_skip(case.real_set)[0]
        path = folder / f"{name}.h5ad"
        case.build(cells[case.real_set]).write_h5ad(path)
        session = Session(folder / name, input_path=path)
        assert call(session, "load_data").ok
        inputs[name] = session.adata.copy()
        start = time.perf_counter()
        out = call(session, "call_cells")
        assert out.ok, out.error
        runs[name] = {"input": inputs[name], "result": out.result, "kept": session.adata,
                      "seconds": time.perf_counter() - start}  # fmt: skip
    for name, oracle in dropletutils(inputs, workers=2).items():  # CI's two cores
        runs[name]["oracle"] = oracle
    return runs


@pytest.mark.parametrize("name", ORACLE_CASES)
def test_the_cells_called_agree_with_dropletutils(compared, name):
    run = compared[name]
    oracle, result = run["oracle"], run["result"]
    ours = run["input"].obs_names.isin(run["kept"].obs_names)
    theirs = oracle["calls"]["cell"].to_numpy()
    jaccard = (ours & theirs).sum() / (ours | theirs).sum()
    assert jaccard >= 0.95, (name, int(ours.sum()), int(theirs.sum()), jaccard)
    # whether barcodes at the floor still miss the FDR after a step depends on the random stream
    assert oracle["niters"] / 10 <= result["iterations"] <= oracle["niters"] * 10, oracle["niters"]
    assert result["retain"] == round(oracle["retain"])
    assert is_cell(run["kept"].obs_names).mean() >= 0.99  # at most 1% empty barcodes kept


def test_most_matrices_put_empties_where_they_are_tested(compared):
    """The 1% bound above can fail only where EmptyDrops tests empties (above lower)."""
    tested = []
    for name, run in compared.items():
        totals = np.asarray(run["input"].X.sum(axis=1)).ravel()
        if ((totals > run["result"]["lower"]) & ~is_cell(run["input"].obs_names)).sum() > 1_000:
            tested.append(name)
    assert len(tested) > len(compared) / 2, tested


@pytest.mark.parametrize("name", ORACLE_CASES)
def test_the_curve_and_the_ambient_model_match_dropletutils(compared, name):
    run = compared[name]
    oracle, evidence = run["oracle"], run["result"]["evidence"]
    for point in ("knee", "inflection"):
        assert abs(evidence[point] - oracle[point]) <= 0.05 * oracle[point], (point, oracle)
    assert run["result"]["alpha"] == pytest.approx(oracle["alpha"], rel=1e-3)
    planted = ORACLE_CASES[name].droplets.empty_alpha
    if planted is not None:  # the fit found the empties' overdispersion, off its 10,000 bound
        assert planted / 2 <= run["result"]["alpha"] <= planted * 2, (planted, oracle["alpha"])
    # the ambient profile, gene by gene, over the genes seen anywhere (the others are 0 there)
    counts = sparse.csr_matrix(run["input"].X)
    totals, seen = np.asarray(counts.sum(axis=1)).ravel(), counts.getnnz(axis=0) > 0
    pool = counts[totals <= run["result"]["lower"]][:, seen]
    ours = good_turing_proportions(np.asarray(pool.sum(axis=0)).ravel())
    np.testing.assert_allclose(ours, oracle["ambient"][seen], rtol=1e-9)
    assert (oracle["ambient"][~seen] == 0).all()
    where = {g: i for i, g in enumerate(run["input"].var_names)}
    for gene, share in run["result"]["ambient"]["top_genes"].items():
        assert share == pytest.approx(oracle["ambient"][where[gene]], abs=1e-5)


@pytest.mark.parametrize("name", ORACLE_CASES)
def test_what_was_not_called_is_said(compared, name):
    """Barcodes above the inflection left uncalled are counted beside the cells kept, in the
    result, the reason and (past LOST_WARN_SHARE of the cells kept) a warning, which claims
    neither that they are cells nor that they are empties."""
    run = compared[name]
    result, totals = run["result"], np.asarray(run["input"].X.sum(axis=1)).ravel()
    kept = run["input"].obs_names.isin(run["kept"].obs_names)
    left = (totals >= result["evidence"]["inflection"]) & ~kept
    lost = result["not_called"]
    assert lost["barcodes"] == left.sum() and lost["above"] == result["evidence"]["inflection"]
    assert f"{left.sum():,} barcodes above the inflection" in result["reason"] or not left.any()
    warned = [w for w in result["warnings"] if "above the inflection" in w]
    assert bool(warned) == (left.sum() > LOST_WARN_SHARE * result["n_cells"])
    if warned:
        assert "the counts do not say which" in warned[0] and "retain" not in warned[0]
    # what is left above the inflection is real cells, not empties, on these matrices
    assert is_cell(run["input"].obs_names[left]).all()
