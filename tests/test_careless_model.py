"""A careless model drives `agent run --policy llm`: every bad choice ends refused or flagged
with its evidence, never a green `finished` (agent/checks.py, agent/tools/finish.py).

The model is the scripted OpenAI-compatible server (agent/testing/scripted_server.py) playing
the replies a weak model makes, against the demo sample the report tests analyse (1,500 cells).
The scenarios that begin from a complete analysis resume one base run, which played the
reference recipe's own calls (taken from the demo run's record) up to just before finish.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import anndata as ad
import numpy as np
import pytest

from agent.cli import main
from agent.record.layout import SampleLayout
from agent.record.world_state import WorldState
from agent.testing.scripted_server import ScriptedServer

MAX_CONTEXT = 200_000  # the tool schemas alone exceed the stand-in's default 8K tokens


def reply(tool: str, **arguments: Any) -> dict[str, Any]:
    return {"tool": tool, "arguments": json.dumps(arguments)}


def together(*calls: dict[str, Any]) -> dict[str, Any]:
    """Several tool calls in one reply."""
    return {"calls": list(calls)}


def run(input_path: Path, outdir: Path, script: list[dict], max_steps: int = 40) -> WorldState:
    """`agent run --policy llm` against the scripted model; the record it leaves. Once the
    script is played, the stand-in answers without a call (the loop nudges, then gives up)."""
    server = ScriptedServer(max_model_len=MAX_CONTEXT)
    server.script = list(script)
    args = ["run", "--input", str(input_path), "--outdir", str(outdir), "--sample", "s",
            "--policy", "llm", "--base-url", server.base_url, "--model", "scripted",
            "--max-steps", str(max_steps)]  # fmt: skip
    try:
        assert main(args) == 0  # a complete record, whatever the analysis' status
    finally:
        server.close()
    return WorldState.load(SampleLayout(outdir).record)


def checks(world: WorldState, rule: str) -> list[dict[str, Any]]:
    return [c for c in world.meta["checks"] if c["rule"] == rule]


def entries(world: WorldState, tool: str) -> list[Any]:
    return [e for e in world.entries if e.tool == tool]


@pytest.fixture(scope="module")
def recipe_calls(demo_run) -> list[dict[str, Any]]:
    """The reference recipe's calls on the demo sample, as replies of the model."""
    world = WorldState.load(demo_run.world_state)
    return [reply(e.tool, **e.params) for e in world.entries if e.status == "ok"]


@pytest.fixture(scope="module")
def before_finish(demo_run, recipe_calls, tmp_path_factory) -> Path:
    """A run of the recipe's calls up to finish, stopped at the step limit just before it."""
    outdir = tmp_path_factory.mktemp("careless") / "base"
    calls = recipe_calls[:-1]
    world = run(demo_run.input, outdir, calls, max_steps=len(calls))
    assert world.meta["status"] == "step_limit"
    return outdir


def resumed(base: Path, tmp_path: Path, demo_run, script: list[dict]) -> WorldState:
    """The base run resumed with more steps, the model playing ``script`` from there."""
    outdir = tmp_path / "s"
    shutil.copytree(base, outdir)
    done = len(WorldState.load(SampleLayout(outdir).record).entries)
    return run(demo_run.input, outdir, script, max_steps=done + 12)


def test_the_recipes_own_calls_through_the_model_finish_with_checks_passing(
    before_finish, recipe_calls, demo_run, tmp_path
):
    world = resumed(before_finish, tmp_path, demo_run, recipe_calls[-1:])
    assert world.meta["status"] == "finished"
    verdicts = {c["rule"]: c["verdict"] for c in world.meta["checks"]}
    assert verdicts["complete"] == "pass" and verdicts["conclusion"] == "pass"
    assert "refused" not in verdicts.values()
    final = ad.read_h5ad(SampleLayout(tmp_path / "s").final)
    assert final.uns["analysis"]["status"] == "finished"


def test_finish_right_after_load_is_refused_naming_every_stage(demo_run, tmp_path):
    world = run(demo_run.input, tmp_path / "o", [
        reply("load_data"), reply("finish", conclusion="12 clusters, all T cells"),
    ])  # fmt: skip
    assert world.meta["status"] == "repeated_failures"
    (refused,) = checks(world, "complete")
    assert refused["verdict"] == "refused" and refused["step"] == 2
    assert {"cells", "qc", "cell_filter", "doublets", "clusters", "labels"} <= set(
        refused["evidence"]["missing"]
    )
    assert not SampleLayout(tmp_path / "o").final.exists()


def test_a_partial_finish_is_partial_with_its_conclusion_flagged(demo_run, tmp_path):
    world = run(demo_run.input, tmp_path / "o", [
        reply("load_data"),
        reply("finish", conclusion="12 clusters, all T cells", partial="no time"),
    ])  # fmt: skip
    assert world.meta["status"] == "partial"
    assert "no time" in world.meta["error"] and "labels" in world.meta["error"]
    (conclusion,) = checks(world, "conclusion")
    assert conclusion["verdict"] == "warn"
    assert conclusion["evidence"]["clusters_stated"] == [12]
    assert conclusion["evidence"]["clusters_in_object"] == 0
    assert "T" in conclusion["evidence"]["types_not_in_object"]
    final = ad.read_h5ad(SampleLayout(tmp_path / "o").final)
    assert final.uns["analysis"]["status"] == "partial"
    assert final.uns["analysis"]["partial_reason"] == "no time"


def test_the_recipe_without_qc_filters_and_doublets_is_not_finished(demo_run, tmp_path):
    """Also a filter the tool refused (every cell removed), and the model going on without one."""
    world = run(demo_run.input, tmp_path / "o", [
        reply("load_data"), reply("call_cells"), reply("qc_metrics"),
        reply("filter_by_qc", min_genes=10**6),
        reply("normalize"), reply("highly_variable_genes"), reply("pca", n_comps=20),
        reply("neighbors"), reply("leiden"), reply("rank_genes_groups"),
        reply("annotate_clusters"), reply("finish", conclusion="done"),
        reply("finish", conclusion="done", partial="QC skipped"),
    ])  # fmt: skip
    assert entries(world, "filter_by_qc")[0].status == "error"
    first, second = checks(world, "complete")
    assert first["verdict"] == "refused"
    assert set(first["evidence"]["missing"]) == {"cell_filter", "doublets"}
    assert second["verdict"] == "warn" and world.meta["status"] == "partial"


def test_destructive_and_repeated_filters(demo_run, tmp_path):
    adata = ad.read_h5ad(demo_run.input)
    genes = np.asarray((adata.X > 0).sum(axis=1)).ravel()
    p95 = int(np.percentile(genes, 95))
    world = run(demo_run.input, tmp_path / "o", [
        reply("load_data"), reply("call_cells"), reply("qc_metrics"),
        reply("filter_by_qc", min_genes=p95),  # 95% of the cells
        together(reply("filter_by_qc", max_pct_mt=5.0), reply("filter_by_qc", max_pct_mt=50.0)),
        reply("filter_cells", min_genes=p95, override_reason="a test of the override"),
        reply("finish", partial="a test of the filters"),
    ])  # fmt: skip
    refused, _low, high, forced = entries(world, "filter_by_qc") + entries(world, "filter_cells")
    assert refused.status == "error" and "over 90%" in refused.error
    (share,) = [c for c in checks(world, "removed_share") if c["step"] == refused.step]
    assert share["verdict"] == "refused" and share["evidence"]["share"] > 0.9
    assert refused.digest_before == refused.digest_after  # nothing was changed
    assert high.result["effective_thresholds"] == {"max_pct_mt": 5.0}
    (repeated,) = checks(world, "filter_repeated")
    assert repeated["evidence"]["effective"] == {"max_pct_mt": 5.0}
    assert forced.status == "ok"
    (warned,) = [c for c in checks(world, "removed_share") if c["step"] == forced.step]
    assert warned["verdict"] == "warn"
    assert warned["evidence"]["override_reason"] == "a test of the override"
    final = ad.read_h5ad(SampleLayout(tmp_path / "o").final)
    assert dict(final.uns["qc_thresholds"]["applied"]) == {"max_pct_mt": 5.0}
    assert len(final.uns["qc_thresholds"]["applications"]) == 2
    assert world.meta["status"] == "partial"


def test_calls_after_finish_are_refused_and_the_record_matches_the_object(
    before_finish, recipe_calls, demo_run, tmp_path
):
    finish = recipe_calls[-1]
    world = resumed(before_finish, tmp_path, demo_run, [
        together(finish, reply("leiden", resolution=5.0)),
    ])  # fmt: skip
    assert world.meta["status"] == "finished"
    last = world.entries[-1]
    assert last.tool == "leiden" and last.status == "error" and "after" in last.error
    (after,) = checks(world, "after_finish")
    assert after["verdict"] == "refused" and after["step"] == last.step
    done = world.last_ok("finish")
    final = ad.read_h5ad(SampleLayout(tmp_path / "s").final)
    assert done.result["n_clusters"] == final.obs["leiden"].nunique()
    assert done.result["leiden_sizes"] == final.obs["leiden"].value_counts().to_dict()


def test_loosened_evidence_and_a_reclustering_after_labels(before_finish, demo_run, tmp_path):
    world = resumed(before_finish, tmp_path, demo_run, [
        reply("annotate_clusters", min_score=-5.0, min_detection=0.0),
        reply("leiden", resolution=0.001),
        reply("finish", conclusion="9 clusters"),
    ])  # fmt: skip
    (loose,) = [c for c in checks(world, "evidence_settings") if c["verdict"] == "warn"]
    assert loose["evidence"]["loosened"]["min_score"]["given"] == -5.0
    assert loose["evidence"]["loosened"]["min_detection"]["given"] == 0.0
    refused = [c for c in checks(world, "complete") if c["verdict"] == "refused"]
    assert {"markers", "labels"} <= set(refused[-1]["evidence"]["missing"])
    assert "stale after leiden" in refused[-1]["evidence"]["missing"]["labels"]
    assert world.meta["status"] != "finished"
