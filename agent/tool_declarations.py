"""What each tool's ``@tool`` declaration says, read from the source of ``agent/tools/``: the
kind and ``mutates`` that readers of records (the report, ``agent compare``) group tools by, the
stage each reaches, and the tools the loop and resume treat apart, found by their kind (the one
that loads the input, the one that calls cells, the one that finishes). The modules that declare
tools are listed here, once; ``agent.tools.TOOLS`` imports them in this order.

Read from the source, not imported: the tools pull scanpy and umap (seconds), which readers of
records do without. Read, not generated into a data file: the decorator stays the only thing a
new tool writes, with no generator to run and no second file to keep in step, and parsing the
modules takes a few tens of milliseconds. The price: the arguments read here (``kind``,
``mutates``, ``stage``) must be literals; tests/test_tool_declarations.py checks that what is
read equals what the imported tools declare. Nothing of the agent is imported here, so any
module may read it (agent.checks, which the registry imports, does).
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import NamedTuple

# The modules under agent/tools/ that declare tools, in the order the model is shown their tools
# (that of a standard analysis); a module's tools come in their order in its source.
TOOL_MODULES = (
    "io", "cells", "qc", "filters", "doublets", "preprocess", "embed", "cluster", "ambient",
    "markers", "annotate", "celltypist_annotate", "plots", "save", "finish",
)  # fmt: skip
TOOLS_DIR = Path(__file__).parent / "tools"


class Declared(NamedTuple):
    """The arguments of ``agent.registry.tool`` read here, with its defaults."""

    kind: str  # agent.registry.Kind
    mutates: bool = True  # changes the data: its parameters are analysis choices
    stage: str | None = None  # the agent.registry.Stage a success reaches


def _declared(call: ast.Call, where: str) -> Declared:
    if len(call.args) > 1:
        raise ValueError(f"{where}: @tool takes its kind by position, the rest by keyword")
    given = {"kind": call.args[0]} if call.args else {}
    given |= {k.arg: k.value for k in call.keywords if k.arg in Declared._fields}
    try:
        return Declared(**{name: ast.literal_eval(value) for name, value in given.items()})
    except ValueError:
        raise ValueError(f"{where}: @tool's kind, mutates and stage must be literals") from None


def read_module(module: str) -> dict[str, Declared]:
    """The tools a module of agent/tools/ declares, by name, in source order."""
    path = TOOLS_DIR / f"{module}.py"
    found = {}
    for node in ast.parse(path.read_text(), str(path)).body:
        for d in getattr(node, "decorator_list", ()):
            if isinstance(d, ast.Call) and isinstance(d.func, ast.Name) and d.func.id == "tool":
                found[node.name] = _declared(d, f"{path}:{d.lineno}")
    return found


DECLARED: dict[str, Declared] = {
    name: declared for module in TOOL_MODULES for name, declared in read_module(module).items()
}


def only(kind: str) -> str:
    """The one tool of ``kind``."""
    names = [name for name, declared in DECLARED.items() if declared.kind == kind]
    if len(names) != 1:
        raise ValueError(f"one tool must be of kind {kind!r}, not {names}")
    return names[0]


LOAD = only("load")  # reads the input: while it has not succeeded, there are no data
CALL_CELLS = only("cell_calling")  # decides whether the data hold cells at all
FINISH = only("finish")  # writes the final object; the run ends when it succeeds
