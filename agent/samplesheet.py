"""The sample sheet (config/samples.tsv): read and checked before any job is planned.

Every error names the sheet, the line, the sample and the column, and says what was expected; the
wording is this module's own (values are judged with jsonschema's structured errors, never by
reading the text of another tool's message). One pass over the sheet: a 1,000-sample sheet costs
about ten times a 100-sample one.
"""

from __future__ import annotations

import csv
import os
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jsonschema
import yaml

SCHEMA = Path(__file__).resolve().parents[1] / "workflow" / "schemas" / "samples.schema.yaml"


class SampleSheetError(ValueError):
    """A sheet that cannot be used; the message says where and why.

    ``sheet``, ``line``, ``sample`` and ``column`` say where, as far as known (None otherwise);
    ``problem`` is what was found or expected there.
    """

    def __init__(
        self,
        message: str,
        sheet: Path | None = None,
        line: int | None = None,
        sample: str | None = None,
        column: str | None = None,
        problem: str | None = None,
    ):
        super().__init__(message)
        self.sheet, self.line, self.sample, self.column = sheet, line, sample, column
        self.problem = problem if problem is not None else message


def sheet_error(
    sheet: Path, line: int, sample: str | None, column: str | None, message: str
) -> SampleSheetError:
    """``sample sheet SHEET, line N (sample 'S'), column 'C': MESSAGE``."""
    where = f"{sheet}, line {line}"
    if sample:
        where += f" (sample {sample!r})"
    if column:
        where += f", column {column!r}"
    return SampleSheetError(
        f"sample sheet {where}: {message}", sheet, line, sample, column, message
    )


@dataclass
class Sheet:
    path: Path
    rows: list[dict[str, Any]]  # non-empty cells only; integer columns as int
    lines: list[int]  # the line of each row in the file
    warnings: list[str] = field(default_factory=list)  # what is allowed but likely a mistake

    def error(self, i: int, column: str | None, message: str) -> SampleSheetError:
        """An error about row ``i``."""
        return sheet_error(self.path, self.lines[i], self.rows[i].get("sample"), column, message)


def read_sheet(
    sheet: Path, schema: dict[str, Any], extra_columns: Collection[str] | None = ()
) -> Sheet:
    """Read the TSV into rows of non-empty cells, checking the header against the schema.

    ``extra_columns``: columns the schema does not name that the sheet may hold, as text (the
    samples' descriptions that config names, such as a condition or a grouping); None allows any
    (a reader of a sheet the workflow checked already). Integer columns are converted here so
    that the schema judges values, not spellings; a cell that is no number is reported with its
    line.
    """
    if not sheet.is_file():
        problem = "does not exist (config key 'samples')"
        raise SampleSheetError(f"sample sheet {sheet} {problem}", sheet, problem=problem)
    columns = schema["properties"]
    integer_columns = {name for name, spec in columns.items() if spec.get("type") == "integer"}
    with sheet.open(newline="", encoding="utf-8-sig") as handle:  # Excel writes a BOM
        reader = csv.reader(handle, delimiter="\t")
        header = [cell.strip() for cell in next(reader, [])]
        missing = [name for name in schema["required"] if name not in header]
        if missing:
            raise sheet_error(
                sheet, 1, None, missing[0],
                f"missing column (header has {header}; required: {schema['required']})",
            )  # fmt: skip
        allowed = columns.keys() | set(extra_columns or ())
        unknown = [name for name in header if name not in allowed]
        if unknown and extra_columns is not None:
            raise sheet_error(
                sheet, 1, None, unknown[0], f"unknown column (allowed: {sorted(allowed)})"
            )
        if len(set(header)) != len(header):
            raise sheet_error(sheet, 1, None, None, f"repeated column name in {header}")
        rows, lines = [], []
        for cells in reader:
            if not any(cell.strip() for cell in cells):
                continue
            line = reader.line_num
            if len(cells) != len(header):
                raise sheet_error(
                    sheet, line, None, None,
                    f"{len(cells)} tab-separated cells, the header has {len(header)}",
                )  # fmt: skip
            row = {
                name: cell.strip() for name, cell in zip(header, cells, strict=True) if cell.strip()
            }
            for name in integer_columns & row.keys():
                try:
                    row[name] = int(row[name])
                except ValueError:
                    raise sheet_error(
                        sheet, line, row.get("sample"), name,
                        f"expected a whole number, got {row[name]!r}",
                    ) from None  # fmt: skip
            rows.append(row)
            lines.append(line)
    if not rows:
        raise SampleSheetError(f"sample sheet {sheet} has no samples", sheet, problem="no samples")
    return Sheet(sheet, rows, lines)


# What a value that breaks one schema keyword is told, in this project's words; the keyword's
# value from the schema is `rule`. Keywords not named here get the generic sentence below.
EXPECTED: dict[str, Callable[[Any, Any], str]] = {
    "enum": lambda value, rule: f"{value!r} is not one of {list(rule)!r}",
    "const": lambda value, rule: f"{value!r} is not {rule!r}",
    "type": lambda value, rule: f"expected a value of type {rule!r}, got {value!r}",
    "minimum": lambda value, rule: f"{value!r} is less than the minimum of {rule!r}",
    "maximum": lambda value, rule: f"{value!r} is more than the maximum of {rule!r}",
    "exclusiveMinimum": lambda value, rule: f"{value!r} is not more than {rule!r}",
    "exclusiveMaximum": lambda value, rule: f"{value!r} is not less than {rule!r}",
    "pattern": lambda value, rule: f"{value!r} does not match {rule!r}",
    "minLength": lambda value, rule: f"{value!r} is shorter than {rule!r} characters",
    "maxLength": lambda value, rule: f"{len(value)} characters, more than the maximum of {rule!r}",
}


def describe(error: jsonschema.ValidationError) -> str:
    """What is wrong with a cell, from the error's structured fields (never its message), with
    the description of the (sub)schema holding the broken rule: the schema says why."""
    explain = EXPECTED.get(str(error.validator))
    if explain is not None:
        problem = explain(error.instance, error.validator_value)
    else:
        problem = f"{error.instance!r} breaks the schema's {error.validator!r} rule ({error.validator_value!r})"
    why = error.schema.get("description") if isinstance(error.schema, dict) else None
    return f"{problem} ({' '.join(why.split())})" if why else problem


def validate_rows(
    sheet: Sheet, schema: dict[str, Any], extra_columns: Collection[str] = ()
) -> None:
    """Each row against the schema (``extra_columns`` as free text): a required cell left
    empty, then the first value (in column order) that the schema refuses."""
    text = {"type": "string", "description": "a column that config names"}
    schema = {**schema, "properties": {**{c: text for c in extra_columns}, **schema["properties"]}}
    validator = jsonschema.Draft202012Validator(schema)
    order = {name: k for k, name in enumerate(schema["properties"])}
    for i, row in enumerate(sheet.rows):
        empty = [name for name in schema["required"] if name not in row]
        if empty:
            raise sheet.error(i, empty[0], "empty cell, a value is required")
        errors = list(validator.iter_errors(row))
        if not errors:
            continue
        # a cell's error (path = its column), the leftmost first; a row-level one otherwise
        first = min(
            errors, key=lambda e: order.get(e.path[0], len(order)) if e.path else len(order)
        )
        column = str(first.path[0]) if first.path else None
        raise sheet.error(i, column, describe(first))


# Columns that name files; Snakemake reads a brace in a path as a wildcard
PATH_COLUMNS = ("path", "celltypist_model")


def check_samples(sheet: Sheet, made_by_workflow: Callable[[str], bool], hint: str = "") -> None:
    """Sheet-level rules the schema cannot state: unique names; paths without braces; inputs that
    exist, or that the workflow makes (``made_by_workflow(path)``; ``hint`` says which those
    are); model files that exist. Rows naming one input (the same file, by any path) are
    allowed (another seed, another model) but noted in ``sheet.warnings``."""
    first_line: dict[str, int] = {}
    inputs: dict[Any, int] = {}  # the input's identity -> the first line naming it
    for i, row in enumerate(sheet.rows):
        name, line = row["sample"], sheet.lines[i]
        if name in first_line:
            raise sheet.error(i, "sample", f"duplicate sample (first on line {first_line[name]})")
        first_line[name] = line
        for column in PATH_COLUMNS:
            if any(brace in row.get(column, "") for brace in "{}"):
                raise sheet.error(
                    i, column,
                    f"{row[column]!r} holds a brace, which Snakemake reads as a wildcard: "
                    "rename the file or folder",
                )  # fmt: skip
        path = row["path"]
        same = _identity(path)
        if same in inputs:
            sheet.warnings.append(
                f"sample sheet {sheet.path}, line {line} (sample {name!r}): input {path!r} is "
                f"also the input of line {inputs[same]}; analysed twice, as asked"
            )
        inputs.setdefault(same, line)
        if not made_by_workflow(path) and not os.path.exists(path):
            raise sheet.error(
                i, "path",
                f"{path!r} does not exist (relative paths are from {Path.cwd()}{hint})",
            )  # fmt: skip
        raw = row.get("raw_input")
        if raw and not os.path.exists(raw):
            raise sheet.error(
                i, "raw_input",
                f"{raw!r} does not exist (expected the sample's unfiltered droplet matrix; "
                f"relative paths are from {Path.cwd()})",
            )  # fmt: skip
        model = row.get("celltypist_model")
        if model and not os.path.isfile(model):
            raise sheet.error(
                i, "celltypist_model",
                f"{model!r} is not a file (expected a CellTypist model .pkl; relative paths are "
                f"from {Path.cwd()})",
            )  # fmt: skip


def _identity(path: str) -> Any:
    """What tells inputs apart: the file itself (device and inode, whatever path names it), or
    the normalised path of one not there yet (the workflow makes it)."""
    try:
        st = os.stat(path)
    except OSError:
        return os.path.normpath(os.path.abspath(path))
    return (st.st_dev, st.st_ino)


def load_sheet(
    path: Path,
    made_by_workflow: Callable[[str], bool] = lambda _: False,
    hint: str = "",
    schema: Path = SCHEMA,
    extra_columns: Collection[str] = (),
) -> Sheet:
    """Read and check a sample sheet; SampleSheetError names what is wrong and where.
    ``extra_columns``: columns beyond the schema's that config names (free text)."""
    with schema.open() as handle:
        spec = yaml.safe_load(handle)
    sheet = read_sheet(path, spec, extra_columns)
    validate_rows(sheet, spec, extra_columns)
    check_samples(sheet, made_by_workflow, hint)
    return sheet


def sample_cells(path: Path) -> dict[str, dict[str, str]]:
    """sample -> its sheet cells (every column but 'sample'), as text, for the cohort steps that
    describe samples by them (obs columns, conditions, groups). Columns the schema does not name
    are read too: the workflow checked the sheet against the columns its config names."""
    with SCHEMA.open() as handle:
        spec = yaml.safe_load(handle)
    rows = read_sheet(path, spec, extra_columns=None).rows
    return {str(r["sample"]): {k: str(v) for k, v in r.items() if k != "sample"} for r in rows}
