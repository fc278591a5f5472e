"""The docs' tables that restate code are checked against the code, and their links resolve.

Fast: reads files and imports light modules only (no pipeline run, no scanpy)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from agent.exit_status import MEANING, SIGNALLED
from agent.record.models import MetricsRow

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
PAGES = [REPO / "README.md", *sorted(DOCS.glob("*.md"))]
CONFIG_README = REPO / "config" / "README.md"
LINKING = [*PAGES, CONFIG_README, REPO / "bench" / "README.md"]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def table_after(path: Path, heading: str) -> list[list[str]]:
    """The cells of the first table under ``heading``, header and rule left out."""
    lines = path.read_text().splitlines()
    start = lines.index(heading)
    rows, seen = [], False
    for line in lines[start + 1 :]:
        if line.startswith("|"):
            seen = True
            rows.append([cell.strip() for cell in line.strip().strip("|").split(" | ")])
        elif seen or line.startswith("#"):
            break
    return rows[2:]


def test_exit_statuses_are_written_once_as_the_code_has_them():
    """docs/operations.md's table is `agent.exit_status`'s, row for row; no other page writes
    the meanings out again (they link to it)."""
    rows = table_after(DOCS / "operations.md", "## Exit statuses of `agent run`")
    signal_status, signal_meaning = SIGNALLED.split(" ", 1)
    expected = [[str(status.value), meaning] for status, meaning in MEANING.items()]
    assert rows == [*expected, [signal_status, signal_meaning]]
    for page in [*PAGES, CONFIG_README]:
        if page != DOCS / "operations.md":
            text = " ".join(page.read_text().split())
            assert not [m for m in MEANING.values() if m in text], page


def test_metrics_columns_are_the_rows_fields():
    """The metrics.jsonl columns documented in docs/serving.md are MetricsRow's fields."""
    rows = table_after(DOCS / "serving.md", "### The metrics row of a step")
    documented = [name for row in rows for name in re.findall(r"`([a-z_]+)`", row[0])]
    assert len(documented) == len(set(documented)), documented
    assert set(documented) == set(MetricsRow.model_fields)


def config_leaves(schema: dict) -> list[tuple[str, ...]]:
    """Every key path of the config schema that holds a value, following ``$ref``s."""
    defs = schema.get("$defs", {})

    def walk(node: dict, path: tuple[str, ...]) -> list[tuple[str, ...]]:
        if "$ref" in node:
            node = defs[node["$ref"].rsplit("/", 1)[1]]
        props = node.get("properties")
        if not props:
            return [path]
        return [leaf for key, sub in props.items() for leaf in walk(sub, (*path, key))]

    return walk(schema, ())


def test_config_readme_documents_every_key_and_column():
    """config/README.md has a row for every key of the config schema (a key of a group such as
    `resources.analyze` named in its group's row) and for every sheet column."""
    schemas = REPO / "workflow" / "schemas"
    doc = CONFIG_README.read_text()
    rows = [line for line in doc.splitlines() if line.startswith("| `")]
    named = {name: row for row in rows for name in re.findall(r"`([^`]+)`", row.split(" | ")[0])}
    config = yaml.safe_load((schemas / "config.schema.yaml").read_text())
    missing = []
    for leaf in config_leaves(config):
        groups = [".".join(leaf[:n]) for n in range(len(leaf), 0, -1)]
        row = next((named[g] for g in groups if g in named), None)
        key = ".".join(leaf)
        if row is None or (key not in named and f"`{leaf[-1]}`" not in row):
            missing.append(key)
    columns = yaml.safe_load((schemas / "samples.schema.yaml").read_text())["properties"]
    missing += [f"column {c}" for c in columns if f"| `{c}` |" not in doc]
    assert not missing, missing


def slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {
        slug(line.lstrip("#")) for line in page.read_text().splitlines() if line.startswith("#")
    }


@pytest.mark.parametrize("page", LINKING, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page: Path):
    """Every relative link of README.md, docs/*.md, config/README.md and bench/README.md names a
    file that exists, and an anchor into a Markdown page names one of its headings."""
    relative = [t for t in LINK.findall(page.read_text()) if not re.match(r"[a-z]+:", t)]
    assert [target for target in relative if not resolves(page, target)] == []


def resolves(page: Path, target: str) -> bool:
    path, _, anchor = target.partition("#")
    file = (page.parent / path).resolve() if path else page
    if not file.exists():
        return False
    return not anchor or file.suffix != ".md" or anchor in anchors(file)


def test_readme_links_every_docs_page():
    """Each page of docs/ is findable from the README."""
    readme = (REPO / "README.md").read_text()
    assert [p.name for p in DOCS.glob("*.md") if f"(docs/{p.name}" not in readme] == []
