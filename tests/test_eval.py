"""`agent eval`: the reference recipe scores 1 on its own points, a careless model fails exactly
the decisions it gets wrong, and a tiny model on a real vLLM server is asked, parsed and scored at
every point with the server's speed recorded."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from agent.cli import main
from agent.eval.points import read
from agent.testing.scripted_server import ScriptedServer

CASE = "synthetic_tiny"  # 80 cells: every kind of point in seconds


def evaluate(outdir: Path, *args: str) -> dict[str, Any]:
    assert main(["eval", "--outdir", str(outdir), *args]) == 0
    return json.loads((outdir / "eval.json").read_text())


def test_the_reference_scores_one_and_the_versioned_points_are_current(tmp_path):
    doc = evaluate(tmp_path, "--policy", "reference", "--cases", f"{CASE},pbmc68k_reduced",
                   "--end-to-end", CASE)  # fmt: skip
    assert doc["score"] == 1.0 and set(doc["by_kind"].values()) == {1.0}
    kinds = {"next_step", "unfiltered", "qc_thresholds", "hvg", "pcs", "resolution",
             "annotation", "finish"}  # fmt: skip
    assert set(doc["by_kind"]) == kinds
    assert doc["points_file"]["differences"] == []  # else: python -m agent eval --regenerate-points
    run = doc["end_to_end"][CASE]
    assert run["status"] == "finished" and run["ari"] is not None and run["score"] > 0.5
    page = (tmp_path / "eval.html").read_text()
    assert "decision score" in page and f"{CASE}#1" in page


def reply(tool: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"tool": tool, "arguments": json.dumps(arguments)}


# The careless model's choices, by kind of point: each fails its point's rule.
CARELESS = {
    "unfiltered": reply("normalize", {}),  # counts the barcodes before calling cells
    "hvg": reply("highly_variable_genes", {"n_top_genes": 12, "flavor": "seurat_v3"}),
    "pcs": reply("neighbors", {"n_pcs": 3}),  # below the elbow
    "resolution": reply("leiden", {"resolution": 5.0}),
    "annotation": reply("annotate_clusters", {"min_score": -5.0, "min_detection": 0.0}),
}


def test_a_careless_model_fails_exactly_the_decisions_it_gets_wrong(tmp_path):
    points = read()[CASE]
    script, planted = [], set()
    for p in points:
        bad = CARELESS.get(p.kind)
        if p.reference["tool"] == "normalize":  # finishing in the middle of the analysis
            bad = reply("finish", {"conclusion": "5 clusters of T cells"})
        if p.kind == "qc_thresholds" and p.reference["tool"] == "filter_by_qc":
            bad = reply("filter_by_qc", {"max_genes": 10**6})  # keeps every damaged cell
        script.append(bad or reply(p.reference["tool"], p.reference["arguments"]))
        if bad:
            planted.add(p.id)
    server = ScriptedServer(max_model_len=200_000)
    server.script = script
    try:
        doc = evaluate(tmp_path, "--base-url", server.base_url, "--model", "scripted",
                       "--cases", CASE, "--end-to-end", "none")  # fmt: skip
    finally:
        server.close()
    wrong = {v["point"] for v in doc["points"] if not v["acceptable"]}
    assert wrong == planted
    assert doc["points_acceptable"] == pytest.approx(1 - len(planted) / len(points), abs=1e-4)
    assert doc["score"] == pytest.approx(
        sum(doc["by_kind"].values()) / len(doc["by_kind"]), abs=1e-4
    )
    for kind in ("unfiltered", "qc_thresholds", "hvg", "pcs", "resolution", "annotation"):
        assert doc["by_kind"][kind] < 1, kind
    why = {v["point"]: v["why"] for v in doc["points"]}
    by_kind = {p.kind: p.id for p in points if p.id in planted}
    assert "normalize is not among call_cells" in why[by_kind["unfiltered"]]
    assert "n_highly_variable=12 outside" in why[by_kind["hvg"]]
    assert "evidence thresholds loosened" in why[by_kind["annotation"]]
    assert "n_pcs=3 outside" in why[by_kind["pcs"]]
    assert "outside qc_metrics' derived bounds" in why[by_kind["qc_thresholds"]]
    speed = doc["speed"]["points"]
    assert speed["steps"] == len(points) and speed["warm_hit_rate"] > 0.5  # the scripted cache


@pytest.mark.vllm
def test_a_tiny_model_on_real_vllm_is_asked_and_scored_at_every_point(vllm_server, tmp_path):
    doc = evaluate(tmp_path, "--endpoint-file", str(vllm_server.endpoint_file), "--cases", CASE,
                   "--end-to-end", "none", "--max-tokens", "24", "--no-thinking")  # fmt: skip
    points = read()[CASE]
    assert len(doc["points"]) == len(points)  # every point asked and judged
    assert all(isinstance(v["acceptable"], bool) and v["why"] for v in doc["points"])
    assert doc["model"]["model"] == vllm_server.model and doc["model"]["vllm_version"]
    speed = doc["speed"]
    assert speed["points"]["steps"] == len(points) and speed["points"]["ttft_cold_s"] is not None
    assert speed["server"]["requests"] >= len(points)
    assert speed["server"]["prefix_cache_hit_rate"] > 0
