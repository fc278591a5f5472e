"""The import graph of agent/: no circle, and the record at the bottom.

Read from the source with ast: every ``import`` and ``from ... import`` of an agent module counts,
also inside functions, except those under ``if TYPE_CHECKING:``; a package's ``__init__.py`` is a
module of its own (``agent.report``). ``from agent.x import y`` points at ``agent.x.y`` where that
is a module, else at ``agent.x``.
"""

from __future__ import annotations

import ast
from pathlib import Path

AGENT = Path(__file__).parents[1] / "agent"


def modules() -> dict[str, Path]:
    found = {}
    for path in AGENT.rglob("*.py"):
        parts = path.relative_to(AGENT.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _type_checking_only(tree: ast.Module) -> set[int]:
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped |= {id(n) for statement in node.body for n in ast.walk(statement)}
    return skipped


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The agent modules ``name`` (at ``path``) imports."""
    tree = ast.parse(path.read_text())
    skipped = _type_checking_only(tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            found |= {
                f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names
            }
    return {_owner(m, known) for m in found if m.split(".")[0] == "agent"} - {name, None}


def _owner(name: str, known: dict[str, Path]) -> str | None:
    """The module a dotted name lies in (``agent.x.CONSTANT`` -> ``agent.x``)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The circles of the graph: its strongly connected parts of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while not part or part[-1] != v:
                part.append(stack.pop())
            if len(part) > 1 or v in edges.get(v, ()):
                found.append(sorted(part))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_the_import_graph_has_no_circle():
    assert cycles(graph()) == []


def test_the_cycle_finder_finds_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_record_imports_nothing_that_reads_or_reports_it():
    """agent/record/ stands below the report, the cohort commands, replay, the runner and the
    loop: none of them is imported by it."""
    above = ("agent.report", "agent.cohort", "agent.replay", "agent.runner", "agent.loop",
             "agent.resume", "agent.policies", "agent.tools", "agent.eval", "agent.serve")  # fmt: skip
    edges = graph()
    upward = {
        (name, to)
        for name, targets in edges.items()
        if name.startswith("agent.record")
        for to in targets
        if to.startswith(above)
    }
    assert upward == set()


def test_the_cohort_commands_stand_below_the_report():
    edges = graph()
    upward = {
        (name, to)
        for name, targets in edges.items()
        if name.startswith("agent.cohort")
        for to in targets
        if to.startswith("agent.report")
    }
    assert upward == set()
