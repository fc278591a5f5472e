"""Edges of the sheet, the run options and the report: a brace in a sheet path, two rows naming
one input, a name longer than file systems allow, and a report built while a sample runs."""

from __future__ import annotations

import re
import shutil

import orjson
import pytest

from agent import cli
from agent.record.layout import SampleLayout
from agent.record.lock import FolderLock
from agent.report.build import build_report
from agent.samplesheet import SampleSheetError, load_sheet
from tests.fixtures_report import DemoRun
from tests.fixtures_workflow import WorkflowDir


def test_a_brace_in_a_sheet_path_is_a_sheet_error_not_a_wildcard_error(
    workflow_dir: WorkflowDir,
):
    data = workflow_dir.path / "data {x}.h5ad"
    data.touch()
    workflow_dir.write_sheet([{"sample": "a", "path": str(data)}])
    out = workflow_dir.snakemake("-n")
    assert out.returncode != 0 and "WildcardError" not in out.stdout, out.stdout[-2000:]
    assert "line 2 (sample 'a'), column 'path': " in out.stdout
    assert "holds a brace, which Snakemake reads as a wildcard" in out.stdout


def test_two_rows_naming_one_input_are_analysed_with_a_warning(workflow_dir: WorkflowDir, tmp_path):
    """Allowed (the same input under two seeds), but said: by another path (a symbolic link)
    too, as the same file; a copy is another file."""
    data = tmp_path / "x.h5ad"
    data.touch()
    (tmp_path / "link.h5ad").symlink_to(data)
    shutil.copy(data, tmp_path / "copy.h5ad")
    rows = [("a", data), ("b", tmp_path / "link.h5ad"), ("c", tmp_path / "copy.h5ad")]
    sheet = workflow_dir.write_sheet([{"sample": s, "path": str(p)} for s, p in rows])
    assert load_sheet(sheet).warnings == [
        f"sample sheet {sheet}, line 3 (sample 'b'): input {str(tmp_path / 'link.h5ad')!r} is "
        "also the input of line 2; analysed twice, as asked"
    ]
    out = workflow_dir.snakemake("-n")
    assert out.returncode == 0, out.stdout[-2000:]
    assert out.stdout.count("is also the input of line 2") == 1


@pytest.mark.parametrize("option", ["--input", "--outdir"])
def test_a_name_too_long_for_any_file_system_is_refused_not_retried(tmp_path, capsys, option):
    """Permanent, so exit 2 in one line, never exit 1 with "a rerun resumes"."""
    long = tmp_path / ("a" * 300)
    given = {"--input": tmp_path, "--outdir": tmp_path / "out", option: long / "x"}
    assert cli.main(["run", *(str(x) for kv in given.items() for x in kv)]) == 2
    err = capsys.readouterr().err
    assert f"{option} {long / 'x'}: the name aaaa" in err and "is 300 bytes long" in err
    assert "a rerun resumes" not in err and len(err.splitlines()) == 1


def test_a_sample_running_as_the_report_is_built_is_not_failed(demo_run: DemoRun, tmp_path):
    """A record that says running, whose folder's lock a live run holds, is not counted failed;
    one that says running with nobody holding it (killed unawares) is."""
    folders = {}
    for name in ("going", "killed"):
        layout = SampleLayout(tmp_path / name)
        layout.root.mkdir()
        doc = orjson.loads(demo_run.world_state.read_bytes())
        doc["meta"].update(sample=name, status="running")
        del doc["meta"]["seal"]
        layout.record.write_bytes(orjson.dumps(doc))
        folders[name] = layout
    with FolderLock(folders["going"].lock):
        build_report([f.record for f in folders.values()], [], tmp_path / "report")
    index = (tmp_path / "report" / "index.html").read_text()
    failed = re.search(r'<div class="n">(\d+)</div><div class="l">failed</div>', index)
    assert failed and failed.group(1) == "1", index[:3000]
    assert "still running (pid " in (tmp_path / "report" / "samples" / "going.html").read_text()


def test_sheet_brace_errors_name_the_column_of_the_model_too(tmp_path):
    model = tmp_path / "m{1}.pkl"
    model.touch()
    sheet = tmp_path / "samples.tsv"
    sheet.write_text(f"sample\tpath\tcelltypist_model\na\tp\t{model}\n")
    with pytest.raises(SampleSheetError) as err:
        load_sheet(sheet, made_by_workflow=lambda p: True)
    assert "line 2 (sample 'a'), column 'celltypist_model': " in str(err.value)
    assert "holds a brace" in str(err.value)
