"""ReferencePolicy: data-driven choices, bounded retries, and the whole analysis of each demo sample."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import anndata as ad
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.policies.reference import RECIPE, ReferencePolicy, _option_holds
from agent.testing.reference_run import run_reference
from agent.tools import build_registry
from tests.fixtures_data import recovery

REGISTRY = build_registry()
SCHEMAS = REGISTRY.schemas()
RESULTS = {  # just the numbers the policy reads
    "load_data": {"n_genes": 3000, "median_genes_per_cell": 2},
    "call_cells": {"decision": "unfiltered", "median_genes_per_cell": 400,
                   "reason": "unfiltered: 50,000 barcodes; kept 2,000 cells"},
    "filter_genes": {"genes_after": 2900},
    "qc_metrics": {"n_cells": 2000, "suggested_thresholds": {
        "min_genes": 300, "max_genes": 3000, "min_counts": 500, "max_counts": 20000, "max_pct_mt": 8.5}},
    "filter_by_qc": {"cells_after": 1800, "removed": 200},
    "highly_variable_genes": {"n_highly_variable": 1450},
    "remove_doublets": {"cells_after": 1700, "removed": 100},
    "pca": {"n_comps": 50, "suggested_n_pcs": 9},
    "cluster_sweep": {"best_resolution": 0.3, "warnings": ["weak structure: best silhouette 0.03"]},
    "leiden": {"n_clusters": 8, "resolution": 0.3},
    "annotate_clusters": {"label_sizes": {"B": 100, "NK": 50}, "ambiguous": {"3": "CD4 T|CD8 T"},
                          "unknown": {"5": "best B: detection 12% < 25%"}},
}  # fmt: skip


class World:
    """A stand-in with what the policy reads: entries with step, tool, params, status, result, error."""

    def __init__(self, meta: dict | None = None) -> None:
        self.entries: list[SimpleNamespace] = []
        self.meta = meta or {}  # the run's options (--layer, --gene-symbols) as the record has them

    def record(
        self, decision, ok: bool = True, invalid: bool = False, failed: dict | None = None
    ) -> dict:
        """Record the call as the loop would: params validated (defaults filled), or as sent
        when validation failed (``invalid``); ``failed``: a refused call's result (its check)."""
        call = decision.calls[0]
        params = orjson.loads(call.arguments)
        recorded = {} if invalid else REGISTRY.validate(call.name, params)
        self.entries.append(SimpleNamespace(
            step=len(self.entries) + 1, tool=call.name, params=recorded,
            rejected_arguments=call.arguments if invalid else None,
            status="ok" if ok else "error", result=RESULTS.get(call.name, {}) if ok else failed,
            error=None if ok else f"{call.name} broke",
        ))  # fmt: skip
        return params


def decide(world: World):
    return ReferencePolicy(REGISTRY).decide([], SCHEMAS, world)


def test_happy_sequence_uses_earlier_results():
    world, calls = World(), []
    for _ in range(40):
        decision = decide(world)
        if not decision.calls:
            break
        assert decision.calls[0].id == f"ref-{len(world.entries) + 1}"
        calls.append((decision.calls[0].name, world.record(decision)))
        if calls[-1][0] == "finish":
            break
    args = dict(calls)
    assert [name for name, _ in calls][:6] == [
        "load_data",
        "call_cells",
        "plot",
        "filter_cells",
        "filter_genes",
        "qc_metrics",
    ]
    assert args["filter_cells"] == {"min_genes": 100}  # a quarter of the called cells' 400
    assert args["filter_by_qc"] == {"min_genes": 300, "max_genes": 3000, "max_pct_mt": 8.5}
    assert args["detect_doublets"] == {"expected_doublet_rate": 0.06}
    assert args["highly_variable_genes"] == {
        "flavor": "seurat_v3",
        "n_top_genes": 1450,
        "subset": False,
    }
    assert args["pca"] == {"n_comps": 50}
    assert args["neighbors"] == {"n_neighbors": 15, "n_pcs": 14}
    assert args["leiden"] == {"resolution": 0.3}
    plots = [a["kind"] + str(a.get("color")) for name, a in calls if name == "plot"]
    assert plots == [
        "barcode_rankNone",
        "qc_violinNone",
        "qc_scatterNone",
        "doublet_scoresNone",
        "umapleiden",
        "umapcell_type",
        "dotplotNone",
        "annotation_scoresNone",
    ]
    conclusion = args["finish"]["conclusion"]
    assert calls[-1][0] == "finish" and "8 Leiden clusters" in conclusion
    assert "unfiltered: 50,000 barcodes; kept 2,000 cells" in conclusion
    assert "ambiguous: cluster 3 CD4 T|CD8 T" in conclusion and "weak structure" in conclusion
    assert "Unknown: cluster 5 (best B: detection 12% < 25%)" in conclusion
    # every step but those for a run option this run did not set (a CellTypist model)
    assert len(calls) == len([s for s in RECIPE if not s.option or _option_holds(s.option, {})])


def run_until_done(
    world: World, fails: set[str], invalid: bool = False, limit: int = 60, results=None
) -> list[str]:
    names = []
    for _ in range(limit):
        decision = decide(world)
        if not decision.calls:
            return names
        name = decision.calls[0].name
        names.append(name)
        failed = (results or {}).get(name)
        world.record(
            decision, ok=name not in fails, invalid=invalid and name in fails, failed=failed
        )
        if name == "finish" and name not in fails:
            return names
    raise AssertionError(f"no end after {limit} calls: {names}")


@pytest.mark.parametrize("invalid", [False, True])
def test_failed_optional_step_gets_its_fallback_then_is_skipped(invalid):
    world = World()
    names = run_until_done(world, fails={"detect_doublets"}, invalid=invalid)
    assert names.count("detect_doublets") == 2 and "remove_doublets" not in names
    fallback = [e for e in world.entries if e.tool == "detect_doublets"][1]
    sent = orjson.loads(fallback.rejected_arguments) if invalid else fallback.params
    assert sent["threshold"] == 0.25
    assert names[-1] == "finish"


@pytest.mark.parametrize("invalid", [False, True])
def test_a_fallback_equal_to_the_failed_call_is_not_sent(invalid):
    world = World()  # no cluster_sweep result: leiden's first choice is its fallback, 1.0
    names = run_until_done(world, fails={"cluster_sweep", "leiden"}, invalid=invalid)
    assert names.count("leiden") == 1 and names[-1] == "finish"


def test_failed_required_step_ends_with_finish():
    world = World()
    names = run_until_done(world, fails={"pca"})
    assert names.count("pca") == 2 and names[-1] == "finish" and "neighbors" not in names
    assert "stopped early: pca failed" in world.entries[-1].params["conclusion"]
    assert world.entries[-1].params["partial"].startswith("pca failed")  # a partial analysis


def test_finish_refused_as_incomplete_ends_partial_naming_the_stages():
    """finish refused for stages the recipe could not reach: the conclusion again, with the
    stages the refusal names as the partial reason."""
    world = World()
    refusal = {
        "checks": [
            {
                "rule": "complete",
                "verdict": "refused",
                "message": "m",
                "evidence": {"missing": {"labels": "not done (annotate_clusters)"}},
            }
        ]
    }
    names = run_until_done(world, fails={"finish"}, limit=60, results={"finish": refusal})
    assert names.count("finish") == 3  # the conclusion, the fallback, then partial
    last = world.entries[-1].params
    assert (
        last["partial"]
        == "the reference recipe could not reach: labels (not done (annotate_clusters))"
    )
    assert "Leiden clusters" in last["conclusion"]


def test_unloadable_input_and_unfinishable_run_stop_without_a_call():
    assert run_until_done(World(), fails={"load_data"}) == ["load_data"]
    world = World()
    names = run_until_done(world, fails={"finish"})
    assert names.count("finish") == 3  # the conclusion, the fallback, partial
    assert "cannot go on" in decide(world).text


@settings(max_examples=40, deadline=None)
@given(st.lists(st.booleans(), min_size=60, max_size=60))
def test_never_loops_whatever_fails(outcomes):
    world = World()
    for ok in outcomes:
        decision = decide(world)
        if not decision.calls:
            return
        world.record(decision, ok=ok)
        if ok and decision.calls[0].name == "finish":
            return
        same = [
            e
            for e in world.entries
            if e.tool == decision.calls[0].name and e.params == world.entries[-1].params
        ]
        assert len(same) <= 1 or ok, "the same failing call twice"
    raise AssertionError("no end within 60 calls")


@pytest.mark.parametrize("name", ["pbmc1", "pbmc2", "pbmc3"])
def test_reference_analysis_recovers_the_planted_truth(name, demo_inputs, tmp_path):
    session, world = run_reference(demo_inputs[name], tmp_path)
    assert all(e.status == "ok" for e in world.entries), [e.error for e in world.entries if e.error]
    assert world.entries[-1].tool == "finish"
    scores = recovery(session, demo_inputs[name])
    assert scores["ari"] >= 0.8, scores
    assert scores["damaged_removed"] >= 0.8, scores
    assert scores["doublet_recall"] >= 0.5, scores
    assert scores["empty_removed"] == 1.0, scores
    assert scores["singlets_kept"] >= 0.85, scores
    assert scores["label_accuracy"] >= 0.9, scores
    plots = {p.name for p in (tmp_path / "plots").glob("*.png")}
    assert plots == {
        "qc_violin.png", "umap_leiden.png", "umap_cell_type.png", "dotplot.png",
        "annotation_scores.png", "qc_scatter.png", "doublet_scores.png",
    }  # fmt: skip
    final = ad.read_h5ad(tmp_path / "adata.h5ad")
    assert final.n_obs == session.adata.n_obs and "cell_type" in final.obs
    assert list((tmp_path / "checkpoints").glob("step_*.h5ad"))


def test_agent_run_cli_with_the_reference_policy_and_resume(small_input, tmp_path):
    """The whole thing through `python -m agent run` (the lead's loop and runner), stopped at a
    step limit and resumed: the checkpoint is restored and the steps after it re-run exactly."""
    outdir = tmp_path / "run"
    cmd = [sys.executable, "-m", "agent", "run", "--policy", "reference", "--input", str(small_input),
           "--outdir", str(outdir), "--sample", "small"]  # fmt: skip
    root = Path(__file__).parents[1]
    first = subprocess.run(
        [*cmd, "--max-steps", "10"], capture_output=True, text=True, timeout=600, cwd=root
    )
    assert first.returncode == 0, first.stderr[-3000:]
    assert json.loads((outdir / "world_state.json").read_text())["meta"]["status"] == "step_limit"
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=root)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads((outdir / "world_state.json").read_text())
    assert record["meta"]["status"] == "finished"
    entries = record["entries"]  # resumed from detect_doublets' checkpoint, the last expensive one
    doublets = next(e["step"] for e in entries if e["tool"] == "detect_doublets")
    assert record["meta"]["resumed"][0]["checkpoint_step"] == doublets
    assert [e["tool"] for e in entries][-1] == "finish" and all(
        e["status"] == "ok" for e in entries
    )
    qc = next(e for e in entries if e["tool"] == "filter_by_qc")
    assert (
        qc["params"]["max_pct_mt"]
        == next(e for e in entries if e["tool"] == "qc_metrics")["result"]["suggested_thresholds"][
            "max_pct_mt"
        ]
    )
    assert (outdir / "adata.h5ad").is_file() and len(list((outdir / "plots").glob("*.png"))) == 7
