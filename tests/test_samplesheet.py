"""The sample sheet module: a good sheet, and each kind of error naming its line and column."""

import re
from pathlib import Path

import pytest

from agent.samplesheet import SampleSheetError, load_sheet


def sheet(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "samples.tsv"
    path.write_text(text)
    return path


def test_a_good_sheet_keeps_lines_and_converts_whole_numbers(tmp_path):
    (tmp_path / "x.h5ad").write_bytes(b"")
    path = sheet(tmp_path, f"sample\tpath\tseed\n\na\t{tmp_path}/x.h5ad\t3\nb\tmade/b\t\n")
    got = load_sheet(path, made_by_workflow=lambda p: p.startswith("made/"))
    assert got.rows == [{"sample": "a", "path": f"{tmp_path}/x.h5ad", "seed": 3},
                        {"sample": "b", "path": "made/b"}]  # fmt: skip
    assert got.lines == [3, 4]


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("sample\n", "line 1, column 'path': missing column"),
        ("sample\tpath\tMEM\n", "line 1, column 'MEM': unknown column"),
        ("sample\tpath\na\tp\tq\n", "line 2: 3 tab-separated cells, the header has 2"),
        ("sample\tpath\tseed\na\tp\tone\n", "line 2 (sample 'a'), column 'seed': expected a whole number, got 'one'"),
        ("sample\tpath\na\t\n", "line 2 (sample 'a'), column 'path': empty cell, a value is required"),
        ("sample\tpath\tpolicy\na\tp\tgpt\n", "line 2 (sample 'a'), column 'policy': 'gpt' is not one of"),
        ("sample\tpath\tmem_mb\na\tp\t0\n", "line 2 (sample 'a'), column 'mem_mb': 0 is less than the minimum of 1"),
        ("sample\tpath\na/b\tp\n", "line 2 (sample 'a/b'), column 'sample': 'a/b' does not match"),
        (f"sample\tpath\n{'a' * 300}\tp\n", "column 'sample': 300 characters, more than the maximum of 100 (unique sample name of letters, digits, '_', '.', '-', at most 100 characters: it becomes folder, log file and Slurm job names)"),
        ("sample\tpath\na\t-x\n", "line 2 (sample 'a'), column 'path': '-x' does not match '^[^-]' (a path must not start with '-': the tools would read it as an option; prefix it with './')"),
        ("sample\tpath\na\tp\na\tp\n", "line 3 (sample 'a'), column 'sample': duplicate sample (first on line 2)"),
        ("sample\tpath\na\tnowhere\n", "line 2 (sample 'a'), column 'path': 'nowhere' does not exist"),
        ("sample\tpath\n", "has no samples"),
    ],
)  # fmt: skip
def test_each_error_names_the_sheet_line_and_column(tmp_path, text, where):
    path = sheet(tmp_path, text)
    made = (lambda p: p == "p") if "nowhere" not in text else (lambda p: False)
    with pytest.raises(SampleSheetError) as err:
        load_sheet(path, made_by_workflow=made)
    assert str(err.value).startswith(f"sample sheet {path}")
    assert where in str(err.value)


def test_a_sheet_saved_with_a_byte_order_mark_is_read(tmp_path):
    path = tmp_path / "samples.tsv"
    path.write_bytes("sample\tpath\na\tp\n".encode("utf-8-sig"))  # as Excel saves it
    assert load_sheet(path, made_by_workflow=lambda p: True).rows == [{"sample": "a", "path": "p"}]


def test_a_missing_sheet_is_named(tmp_path):
    with pytest.raises(SampleSheetError, match=r"nope\.tsv does not exist"):
        load_sheet(tmp_path / "nope.tsv")


def test_the_error_carries_where_and_what(tmp_path):
    path = sheet(tmp_path, "sample\tpath\tmem_mb\na\tp\t0\n")
    with pytest.raises(SampleSheetError) as err:
        load_sheet(path, made_by_workflow=lambda p: True)
    e = err.value
    assert (e.sheet, e.line, e.sample, e.column) == (path, 2, "a", "mem_mb")
    assert e.problem == "0 is less than the minimum of 1"
    assert isinstance(e, ValueError)


def test_the_wording_is_built_from_the_schema_rule_not_a_message(tmp_path):
    """Any schema: keywords this module words itself, and a generic sentence for the others."""
    schema = tmp_path / "schema.yaml"
    schema.write_text(
        "type: object\nrequired: [sample, path]\nproperties:\n"
        "  sample: {type: string}\n  path: {type: string}\n"
        "  seed: {type: integer, maximum: 9}\n  cpus: {type: integer, multipleOf: 2}\n"
    )
    for cells, expected in [
        ("seed\n10", "column 'seed': 10 is more than the maximum of 9"),
        ("cpus\n3", "column 'cpus': 3 breaks the schema's 'multipleOf' rule (2)"),
    ]:
        header, value = cells.split("\n")
        path = sheet(tmp_path, f"sample\tpath\t{header}\na\tp\t{value}\n")
        with pytest.raises(SampleSheetError, match=re.escape(expected)):
            load_sheet(path, made_by_workflow=lambda p: True, schema=schema)


def test_columns_config_names_are_read_as_text_and_others_refused(tmp_path):
    """A condition under another column name (config conditions.column) is allowed where named,
    its values free text; the cohort steps read every column (sample_cells)."""
    from agent.samplesheet import sample_cells

    path = sheet(tmp_path, "sample\tpath\ttreatment\tcondition\na\tmade/a\tIFN-b 2\tctrl\n")
    got = load_sheet(path, made_by_workflow=lambda p: True, extra_columns=["treatment"])
    assert got.rows == [
        {"sample": "a", "path": "made/a", "treatment": "IFN-b 2", "condition": "ctrl"}
    ]
    with pytest.raises(SampleSheetError, match="column 'treatment': unknown column"):
        load_sheet(path, made_by_workflow=lambda p: True)
    assert sample_cells(path) == {
        "a": {"path": "made/a", "treatment": "IFN-b 2", "condition": "ctrl"}
    }
