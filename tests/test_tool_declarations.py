"""agent/tool_declarations.py: what the tools' @tool declarations say, read from their source
without importing them, the same as the imported tools declare."""

import subprocess
import sys

import pytest

from agent import tool_declarations
from agent.tool_declarations import (
    CALL_CELLS,
    DECLARED,
    FINISH,
    LOAD,
    TOOL_MODULES,
    TOOLS_DIR,
    read_module,
)


def test_what_is_read_is_what_the_tools_declare():
    from agent.tools import TOOLS

    declared = {fn.__name__: (fn.spec.kind, fn.spec.mutates, fn.spec.stage) for fn in TOOLS}
    # in TOOLS order: the order the model is shown the tools in
    assert [(name, tuple(d)) for name, d in DECLARED.items()] == list(declared.items())


def test_every_module_that_declares_tools_is_listed():
    """A tool in a module TOOL_MODULES leaves out would be neither offered nor known."""
    declaring = {p.stem for p in TOOLS_DIR.glob("*.py") if read_module(p.stem)}
    assert declaring == set(TOOL_MODULES)


def test_a_declaration_not_written_in_literals_is_refused_with_its_place(tmp_path, monkeypatch):
    """Read without importing, kind, mutates and stage can only be literals."""
    (tmp_path / "odd.py").write_text("@tool(KIND, mutates=False)\ndef odd(session): ...\n")
    monkeypatch.setattr(tool_declarations, "TOOLS_DIR", tmp_path)
    with pytest.raises(ValueError, match=r"odd\.py:1: @tool's kind, mutates and stage must be"):
        read_module("odd")


def test_the_tools_the_loop_treats_apart_are_found_by_their_kind():
    assert (LOAD, CALL_CELLS, FINISH) == ("load_data", "call_cells", "finish")


def test_readers_of_records_do_not_import_the_tools():
    """The report's tables and `agent compare` take the kinds from the declarations as written,
    not from the tools, which pull scanpy and umap (seconds)."""
    code = (
        "import sys, agent.cohort.compare, agent.report.cohort, agent.report.html;"
        "print(sorted(m for m in ('agent.tools', 'scanpy', 'umap') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
