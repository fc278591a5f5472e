"""The cohort report on a real demo run, hand-varied copies of it (for drift), a real failed run,
a missing and an unreadable world state: table, flags, page, RO-Crate, and the page in Chromium."""

from __future__ import annotations

import contextlib
import csv
import io
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import orjson
import pandas as pd
import pytest

from agent.cli import main as cli
from agent.report.drift import robust_flags
from agent.report.truth import score
from agent.world_state import WorldState

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# Copies of the demo record with one QC threshold changed; "drifty" also kept few cells.
VARIANTS = {"copy_a": 12.0, "copy_b": 10.5, "drifty": 40.0}


@dataclass(frozen=True)
class Cohort:
    outdir: Path
    world_states: dict[str, Path]
    table: dict[str, dict[str, str]]
    html: str
    stdout: str


def _variant(demo_ws: Path, folder: Path, name: str, max_pct_mt: float) -> Path:
    doc = orjson.loads(demo_ws.read_bytes())
    doc["meta"]["sample"] = name
    for e in doc["entries"]:
        if e["tool"] == "filter_by_qc":
            e["params"]["max_pct_mt"] = max_pct_mt
        if e["tool"] == "finish" and name == "drifty":
            e["result"]["n_cells"] = 200
    folder.mkdir(parents=True)
    shutil.copy(demo_ws.parent / "metrics.jsonl", folder / "metrics.jsonl")
    (folder / "world_state.json").write_bytes(orjson.dumps(doc))
    return folder / "world_state.json"


def _failed_run(root: Path) -> Path:
    """A real run on a corrupt input: the analysis cannot load it and ends without finish."""
    from agent.config import RunConfig
    from agent.runner import run_sample

    bad = root / "data" / "broken.h5ad"
    bad.parent.mkdir(parents=True)
    bad.write_bytes(b"not an h5ad file")
    outdir = root / "samples" / "broken"
    assert run_sample(RunConfig(input=bad, outdir=outdir, sample="broken")) != "finished"
    return outdir / "world_state.json"


@pytest.fixture(scope="module")
def cohort(demo_run, demo_replay, tmp_path_factory) -> Cohort:
    root = tmp_path_factory.mktemp("cohort")
    samples = root / "samples"
    states = {"pbmc2": demo_run.world_state}
    for name, mt in VARIANTS.items():
        states[name] = _variant(demo_run.world_state, samples / name, name, mt)
    states["broken"] = _failed_run(root)
    states["lost"] = samples / "lost" / "world_state.json"
    (samples / "garbled").mkdir()
    states["garbled"] = samples / "garbled" / "world_state.json"
    states["garbled"].write_text('{"schema_version": 1, "meta": {"sam')
    outdir = root / "report"
    argv = ["report", "--world-states", *map(str, states.values()), "--outdir", str(outdir)]
    argv += ["--replays", str(demo_run.outdir / "replay.json"), "--workflow-root", "."]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli(argv) == 0
    with open(outdir / "cohort.tsv", newline="") as f:
        table = {r["sample"]: r for r in csv.DictReader(f, delimiter="\t")}
    return Cohort(outdir, states, table, (outdir / "index.html").read_text(), out.getvalue())


def test_table_has_a_row_per_sample_with_the_recorded_numbers(cohort, demo_run, demo_replay):
    assert list(cohort.table) == ["pbmc2", *VARIANTS, "broken", "lost", "garbled"]
    row = cohort.table["pbmc2"]
    world = WorldState.load(demo_run.world_state)
    load, finish = world.last_ok("load_data"), world.last_ok("finish")
    qc, leiden = world.last_ok("filter_by_qc"), world.last_ok("leiden")
    assert row["status"] == "finished" and row["policy"] == "reference"
    assert row["input_sha256"] == world.meta["input_sha256"]
    assert int(row["cells_before"]) == load.result["n_cells"]
    assert int(row["cells_after"]) == finish.result["n_cells"]
    assert int(row["clusters"]) == leiden.result["n_clusters"]
    assert float(row["leiden.resolution"]) == leiden.params["resolution"]
    assert float(row["filter_by_qc.max_pct_mt"]) == qc.params["max_pct_mt"]
    assert int(row["steps"]) == len(world.entries) and row["errors"] == "0"
    assert int(row["iterations"]) == len(world.entries)
    assert row["replay"] == demo_replay["verdict"]
    assert float(row["ari"]) >= 0.8  # truth.tsv found beside the input
    assert 0 <= float(row["doublet_recall"]) <= 1 and int(row["doublets_removed"]) > 0
    assert "CD14 Mono" in row["labels"]
    assert row["prompt_tokens"] == "" and row["model"] == ""  # no model behind the reference
    assert cohort.table["copy_a"]["replay"] == "not replayed"


def test_failed_missing_and_unreadable_samples_are_rows_not_crashes(cohort):
    broken = cohort.table["broken"]
    assert broken["status"] == "repeated_failures"
    assert "without finish" in broken["error"] and int(broken["errors"]) > 0
    assert "first error, step 1 (load_data): could not read" in cohort.html
    assert cohort.table["lost"]["status"] == "missing"
    assert "no world state at" in cohort.table["lost"]["error"]
    assert cohort.table["garbled"]["status"] == "unreadable"
    assert "not a readable world state" in cohort.table["garbled"]["error"]
    assert "3 failed: broken, lost, garbled" in cohort.stdout


def test_drift_and_outliers_flag_only_the_deviant_sample(cohort):
    drifty = cohort.table["drifty"]
    assert "filter_by_qc.max_pct_mt=40" in drifty["drift"]
    assert "cells_kept_fraction" in drifty["outliers"]
    for name in ("pbmc2", "copy_a", "copy_b"):
        assert cohort.table[name]["drift"] == "" and cohort.table[name]["outliers"] == ""


def test_robust_flags_use_a_floor_and_need_three_values():
    table = pd.DataFrame({"sample": list("abcd"), "x": [1.0, 1.0, 1.0, 1.05], "y": [1, 1, 1, 2]})
    flags = robust_flags(table, ["x", "y"])
    assert [(f.sample, f.column) for f in flags] == [("d", "y")]  # 5% is inside the 10% floor
    assert flags[0].distance == 10.0 and "above the cohort median 1" in str(flags[0])
    assert robust_flags(table.iloc[:2], ["y"]) == []
    assert robust_flags(table.assign(y=["1", "1", "1", "2"]), ["y"]) == []  # not numbers


def test_truth_scores():
    truth = pd.DataFrame(
        {
            "cell_type": ["T", "T", "B", "B", "T+B", "empty", "B"],
            "is_doublet": [False, False, False, False, True, False, False],
            "is_damaged": [False, False, False, False, False, False, True],
            "is_empty": [False, False, False, False, False, True, False],
        },
        index=[f"c{i}" for i in range(7)],
    )
    kept = pd.DataFrame({"leiden": ["0", "0", "1", "1"]}, index=["c0", "c1", "c2", "c3"])
    s = score(kept, truth)
    assert s["ari"] == 1.0 and s["doublet_recall"] == 1.0 and s["damaged_removed"] == 1.0
    assert s["singlets_kept"] == 1.0 and s["planted_types"] == 2
    kept = pd.DataFrame({"leiden": ["0", "1", "0", "1", "0"]}, index=["c0", "c1", "c2", "c3", "c4"])
    s = score(kept, truth)
    assert s["ari"] < 0.5 and s["doublet_recall"] == 0.0


def test_page_is_self_contained_and_shows_every_sample(cohort):
    html = cohort.html
    assert "http://" not in html and "https://" not in html
    sources = re.findall(r'src="([^"]*)"', html)
    assert len(sources) >= 5 + 4  # cohort figures and the demo sample's own plots
    assert all(s.startswith("data:image/png;base64,") for s in sources)
    links = re.findall(r'href="([^"]*)"', html)
    assert all(
        h.startswith("#") or h in ("cohort.tsv", "ro-crate/ro-crate-metadata.json") for h in links
    )
    for name in cohort.table:
        assert f'id="s-{name}"' in html
    assert html.count('class="sample failed"') == 3
    assert "Cells kept per sample" in html and "Cached-token ratio per iteration" in html
    assert "filter_by_qc.max_pct_mt=40 is" in html  # the drift flag, in words
    assert "load_data" in html and "leiden" in html  # the steps with their parameters


def test_ro_crate_links_inputs_records_outputs_and_versions(cohort, demo_run):
    from rocrate.rocrate import ROCrate

    crate_dir = cohort.outdir / "ro-crate"
    doc = orjson.loads((crate_dir / "ro-crate-metadata.json").read_bytes())
    graph = {e["@id"]: e for e in doc["@graph"]}
    root = graph["./"]
    profiles = {p["@id"] for p in root["conformsTo"]}
    assert {
        "https://w3id.org/ro/wfrun/process/0.5",
        "https://w3id.org/ro/wfrun/workflow/0.5",
    } <= profiles
    assert graph[root["mainEntity"]["@id"]]["@type"] == [
        "File",
        "SoftwareSourceCode",
        "ComputationalWorkflow",
    ]
    action = graph["#analyze-pbmc2"]
    assert action["actionStatus"]["@id"].endswith("CompletedActionStatus")
    source = graph[action["object"][0]["@id"]]
    assert source["@id"] == Path(demo_run.input).resolve().as_uri()
    assert source["sha256"] == WorldState.load(demo_run.world_state).meta["input_sha256"]
    results = {r["@id"] for r in action["result"]}
    assert "samples/pbmc2/world_state.json" in results
    assert (
        crate_dir / "samples/pbmc2/world_state.json"
    ).read_bytes() == demo_run.world_state.read_bytes()
    assert graph["#analyze-broken"]["actionStatus"]["@id"].endswith("FailedActionStatus")
    assert "#replay-pbmc2" in graph
    agent = graph[action["instrument"]["@id"]]
    requirements = {
        graph[r["@id"]]["name"]: graph[r["@id"]]["version"] for r in agent["softwareRequirements"]
    }
    assert (
        requirements["scanpy"] == WorldState.load(demo_run.world_state).meta["versions"]["scanpy"]
    )
    assert {m["@id"] for m in root["mentions"]} >= {"#cohort-run", "#analyze-pbmc2"}
    assert ROCrate(crate_dir).get("#cohort-run") is not None  # the library reads it back


def test_duplicate_sample_names_are_refused(demo_run, tmp_path, capsys):
    other = tmp_path / "again" / "world_state.json"
    other.parent.mkdir()
    shutil.copy(demo_run.world_state, other)
    argv = [
        "report",
        "--world-states",
        str(demo_run.world_state),
        str(other),
        "--outdir",
        str(tmp_path / "r"),
    ]
    assert cli(argv) == 2
    assert "sample name 'pbmc2' appears twice" in capsys.readouterr().err


@pytest.mark.skipif(
    CHROMIUM is None, reason="chromium not installed (tests/browser/install.sh installs it)"
)
def test_page_renders_in_headless_chromium(cohort, tmp_path):
    import matplotlib.image

    shot = tmp_path / "report.png"
    cmd = [
        CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
        "--no-first-run", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", f"--user-data-dir={tmp_path / 'profile'}", "--enable-logging=stderr",
        "--v=0", "--hide-scrollbars", "--window-size=1400,2200", f"--screenshot={shot}",
        (cohort.outdir / "index.html").resolve().as_uri(),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    # The page has no scripts; its CSP logs any resource that is not embedded as a console line.
    console = [line for line in done.stderr.splitlines() if ":CONSOLE" in line]
    assert console == []
    pixels = matplotlib.image.imread(shot)
    assert pixels.shape[:2] == (2200, 1400)
    assert float(np.std(pixels[..., :3])) > 0.05  # not a blank page
