"""doublets: flag: the predicted doublets stay, marked, and the markers and the labels' evidence
leave them out (issue 40)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anndata as ad
import numpy as np
import pandas as pd
import pytest
import scanpy as sc

from agent.data.synthetic import SampleSpec, write_sample
from agent.policies.reference import RECIPE, _option_holds
from agent.record.collect import Sample
from agent.report.cohort import doublets_said, row
from agent.testing.reference_run import call_tool, run_reference

# doublets planted among a few cells: Scrublet flags some, and they are checked below
SPEC = SampleSpec("flagged", 800, seed=9, format="h5ad", doublet_fraction=0.1)


@pytest.fixture(scope="module")
def flagged_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("flag")
    path = write_sample(SPEC, folder / "data")
    session, world = run_reference(path, folder / "out", doublets="flag")
    return {"session": session, "world": world}


def _ok(world: Any, tool: str) -> Any:
    return next((e for e in reversed(world.entries) if e.tool == tool and e.status == "ok"), None)


def test_flag_keeps_the_doublets_marked(flagged_run: dict[str, Any]) -> None:
    session, world = flagged_run["session"], flagged_run["world"]
    assert world.entries[-1].tool == "finish" and world.entries[-1].status == "ok"
    assert "remove_doublets" not in {e.tool for e in world.entries}
    predicted = _ok(world, "detect_doublets").result["n_predicted_doublets"]
    assert predicted > 0
    adata = session.adata
    assert int(adata.obs["predicted_doublet"].sum()) == predicted  # all of them still there
    assert adata.obs["cell_type"].notna().all()  # and labelled with their cluster
    assert "flagged and kept" in _ok(world, "finish").params["conclusion"]


def test_flagged_doublets_are_left_out_of_markers_and_evidence(
    flagged_run: dict[str, Any],
) -> None:
    session, world = flagged_run["session"], flagged_run["world"]
    adata = session.adata
    doublets = adata.obs["predicted_doublet"].to_numpy(bool)
    assert _ok(world, "rank_genes_groups").result["doublets_excluded"] == doublets.sum()
    assert _ok(world, "annotate_clusters").result["doublets_excluded"] == doublets.sum()
    # the stored ranking is that of the singlets alone
    source = adata.raw if adata.raw is not None else adata
    singlets = ad.AnnData(
        source.X[~doublets], obs=adata.obs.loc[~doublets, ["leiden"]],
        var=pd.DataFrame(index=source.var_names), uns={"log1p": adata.uns["log1p"]},
    )  # fmt: skip
    singlets.obs["leiden"] = singlets.obs["leiden"].cat.remove_unused_categories()
    method = adata.uns["rank_genes_groups"]["params"]["method"]
    sc.tl.rank_genes_groups(singlets, "leiden", method=method, use_raw=False)
    for group in singlets.uns["rank_genes_groups"]["names"].dtype.names:
        ours = adata.uns["rank_genes_groups"]["names"][group][:20]
        assert list(ours) == list(singlets.uns["rank_genes_groups"]["names"][group][:20])
    # a cluster of flagged doublets only has no evidence: Unknown, saying why
    unknown = _ok(world, "annotate_clusters").result["unknown"]
    for cluster, cells in adata.obs.groupby("leiden", observed=True)["predicted_doublet"]:
        if cells.all():
            assert "flagged doublet" in unknown[str(cluster)]


def test_the_report_says_the_doublets_were_flagged(flagged_run: dict[str, Any]) -> None:
    world = flagged_run["world"]
    sample = Sample("flagged", Path("."), Path("world_state.json"), "finished", world=world)
    found = row(sample)
    predicted = _ok(world, "detect_doublets").result["n_predicted_doublets"]
    assert found["doublets"] == "flag" and found["doublets_flagged"] == predicted
    assert found["doublets_removed"] is None
    assert found["ambient_method"] == "decontx" and found["ambient_contamination"] > 0
    assert doublets_said(sample).startswith(f"flagged and kept: {predicted} cells")


def test_remove_doublets_is_refused_when_the_run_flags(flagged_run: dict[str, Any]) -> None:
    session = flagged_run["session"]
    before = session.adata.n_obs
    outcome = call_tool(session, "remove_doublets")
    assert not outcome.ok and "flags doublets" in outcome.error
    assert session.adata.n_obs == before


def test_the_recipe_removes_only_when_asked() -> None:
    step = next(s for s in RECIPE if s.tool == "remove_doublets")
    assert _option_holds(step.option, {"doublets": "remove"})
    assert _option_holds(step.option, {})  # records made before the setting removed them
    assert not _option_holds(step.option, {"doublets": "flag"})


def test_markers_without_doublets_rank_all_cells(tmp_path: Path) -> None:
    """With nothing flagged the ranking is scanpy's over every cell, as before."""
    rng = np.random.default_rng(0)
    adata = ad.AnnData(rng.poisson(2.0, (60, 30)).astype(np.float32))
    adata.obs["leiden"] = pd.Categorical(np.repeat(["0", "1", "2"], 20))
    adata.X[:20, :5] += 10
    sc.pp.normalize_total(adata)
    sc.pp.log1p(adata)
    adata.obs["predicted_doublet"] = False
    from agent.tools.session import Session

    session = Session(tmp_path, seed=0)
    session.adata = adata
    session.done.add("normalize")
    outcome = call_tool(session, "rank_genes_groups")
    assert outcome.ok and outcome.result["doublets_excluded"] == 0
    expected = adata.copy()
    sc.tl.rank_genes_groups(expected, "leiden", method="wilcoxon", use_raw=False)
    names = adata.uns["rank_genes_groups"]["names"]
    assert list(names["0"]) == list(expected.uns["rank_genes_groups"]["names"]["0"])
