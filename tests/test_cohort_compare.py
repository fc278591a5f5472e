"""`agent compare`: what reprocessing changed, on a tiny cohort that real `agent run` processes
analyse and then reprocess, one sample with another seed (--replace-changed), as the workflow
does after an edited sheet."""

from __future__ import annotations

import csv
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import orjson
import pytest

from agent.cohort.compare import compare, newest_previous
from agent.data.synthetic import SampleSpec, write_sample
from agent.record.provenance import file_sha256

CELLS = 300  # scrublet needs 100+ cells after QC


@dataclass(frozen=True)
class Cohort:
    old: Path  # results/ as it was before the reprocessing (a copy)
    new: Path  # results/ after it: s2 redone with seed 1, its first analysis in previous/


def agent(*args: str | Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "agent", *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def finish(*procs: subprocess.Popen[str]) -> None:
    for p in procs:
        out, _ = p.communicate(timeout=300)
        assert p.returncode == 0, out


@pytest.fixture(scope="module")
def cohort(tmp_path_factory: pytest.TempPathFactory) -> Cohort:
    root = tmp_path_factory.mktemp("reprocessed")
    inputs = {
        name: write_sample(SampleSpec(name, CELLS, seed=seed, format="h5ad"), root / "in" / name)
        for name, seed in (("s1", 11), ("s2", 12))
    }
    new = root / "results"

    def run(name: str, *extra: str) -> subprocess.Popen[str]:
        return agent("run", "--input", inputs[name], "--outdir", new / "samples" / name, *extra)

    finish(run("s1"), run("s2"))  # two cores, two samples at once
    shutil.copytree(new, root / "old")
    finish(run("s2", "--seed", "1", "--replace-changed"))
    return Cohort(root / "old", new)


def read_rows(tsv: Path) -> dict[str, dict[str, str]]:
    with tsv.open() as f:
        return {r["sample"]: r for r in csv.DictReader(f, delimiter="\t")}


def test_two_folders_name_the_changed_sample_and_setting(cohort: Cohort, tmp_path: Path):
    out = subprocess.run(
        [sys.executable, "-m", "agent", "compare", cohort.old, cohort.new, "--outdir", tmp_path],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    rows = read_rows(tmp_path / "comparison.tsv")
    assert set(rows) == {"s1", "s2"}
    s1, s2 = rows["s1"], rows["s2"]
    # the reprocessed sample: its setting named, its clusters and labels compared
    assert "run.seed: 0 -> 1" in s2["parameters_changed"].split("; ")
    assert -1 <= float(s2["ari"]) <= 1 and 0 <= float(s2["same_label"]) <= 1
    assert int(s2["shared_cells"]) > CELLS / 2
    # the other: the same analysis on both sides
    assert (s1["outcome"], float(s1["ari"]), float(s1["same_label"])) == ("unchanged", 1.0, 1.0)
    assert (
        s1["parameters_changed"] == "" and s1["old_cells"] == s1["new_cells"] == s1["shared_cells"]
    )
    confusion = orjson.loads(s1["label_confusion"])
    assert all(set(to) == {label} for label, to in confusion.items())
    # every input record named with its digest, on both sides
    for side, results in (("old", cohort.old), ("new", cohort.new)):
        for name, row in rows.items():
            record = results / "samples" / name / "world_state.json"
            assert row[f"{side}_record"] == str(record.resolve())
            assert row[f"{side}_record_sha256"] == file_sha256(record)
    page = (tmp_path / "comparison.html").read_text()
    assert "labels changed in" in page and "run.seed: 0 -&gt; 1" in page
    assert 'src="http' not in page and "<script" not in page  # self-contained, no script
    if s2["outcome"] != "unchanged":  # largest change first
        assert list(rows) == ["s2", "s1"]


def test_one_folder_compares_with_previous_and_the_report_links_it(cohort: Cohort, tmp_path: Path):
    from agent.report.build import build_report

    rows = {r["sample"]: r for r in compare(cohort.new, None, tmp_path / "comparison")}
    s2 = rows["s2"]
    assert s2["old_record"] == str(newest_previous(cohort.new / "samples" / "s2").resolve())
    assert "run.seed: 0 -> 1" in s2["parameters_changed"]
    assert rows["s1"]["outcome"] == "not reprocessed"
    # the same first analysis as the copy made before reprocessing
    again = {r["sample"]: r for r in compare(cohort.old, cohort.new, tmp_path / "two")}
    assert (s2["ari"], s2["same_label"]) == (again["s2"]["ari"], again["s2"]["same_label"])

    records = sorted((cohort.new / "samples").glob("*/world_state.json"))
    report = tmp_path / "report"
    build_report(records, [], report, comparison_dir=tmp_path / "comparison")
    assert 'href="comparison.html"' in (report / "index.html").read_text()
    assert (report / "comparison.tsv").read_bytes() == (
        tmp_path / "comparison" / "comparison.tsv"
    ).read_bytes()
    graph = orjson.loads((report / "ro-crate" / "ro-crate-metadata.json").read_bytes())["@graph"]
    entities = {e["@id"]: e for e in graph}
    action = entities["#compare-reprocessing"]
    objects = [entities[o["@id"]] for o in action["object"]]
    assert sorted(o["sha256"] for o in objects) == sorted(
        r[f"{side}_record_sha256"] for r in rows.values() for side in ("old", "new")
        if r.get(f"{side}_record")
    )  # fmt: skip
    assert {o["@id"] for o in action["result"]} == {"comparison.tsv", "comparison.html"}


def test_missing_and_unreadable_files_are_rows_that_say_so(cohort: Cohort, tmp_path: Path):
    new = tmp_path / "results" / "samples"
    (new / "s1").mkdir(parents=True)  # the record without its final object
    shutil.copy(cohort.new / "samples" / "s1" / "world_state.json", new / "s1")
    (new / "s2").mkdir()
    (new / "s2" / "world_state.json").write_text("{cut off")
    rows = {
        r["sample"]: r
        for r in compare(cohort.old, new.parent, tmp_path / "out", ["s1", "s2", "s3"])
    }
    assert rows["s1"]["outcome"] == "not compared"
    assert "no final object on the new side (finished)" in rows["s1"]["note"]
    assert rows["s2"]["outcome"] == "not compared"
    assert "unreadable" in rows["s2"]["note"] and str(new / "s2") in rows["s2"]["note"]
    assert (rows["s3"]["outcome"], rows["s3"]["note"]) == (
        "not compared",
        "no analysis of s3 on either side",
    )
    assert (tmp_path / "out" / "comparison.html").is_file()


def test_an_edited_record_or_a_swapped_object_is_not_compared(cohort: Cohort, tmp_path: Path):
    """The earlier analyses as replay would reject them: s1's record with an edited parameter
    (no real change), s2's final object replaced by s1's. Neither is compared; each row says
    which side fails the integrity check and why."""
    old = tmp_path / "old"
    shutil.copytree(cohort.old, old)
    record = old / "samples" / "s1" / "world_state.json"
    doc = orjson.loads(record.read_bytes())
    next(e for e in doc["entries"] if e["tool"] == "leiden")["params"]["resolution"] = 0.1
    record.write_bytes(orjson.dumps(doc))
    swapped = old / "samples" / "s2" / "adata.h5ad"
    shutil.copy(old / "samples" / "s1" / "adata.h5ad", swapped)
    rows = {r["sample"]: r for r in compare(old, cohort.new, tmp_path / "out")}
    s1, s2 = rows["s1"], rows["s2"]
    assert s1["outcome"] == s2["outcome"] == "not compared"
    assert s1["note"].startswith("the old side fails the integrity check: entry of step ")
    assert "was altered" in s1["note"] and s1.get("ari") is None
    assert s2["note"].startswith(f"the old side fails the integrity check: {swapped} is not the")
    assert s2.get("same_label") is None


@pytest.mark.parametrize("given", [("nowhere",), ("old", "nowhere"), ("not-results",)])
def test_a_folder_that_is_not_there_is_named(tmp_path: Path, given: tuple[str, ...]):
    (tmp_path / "old" / "samples").mkdir(parents=True)
    (tmp_path / "not-results").mkdir()
    out = subprocess.run(
        [sys.executable, "-m", "agent", "compare", *given, "--outdir", "out"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1 and given[-1] in out.stderr
    assert not (tmp_path / "out").exists()
