"""agent/tool_kinds.py: the tools' kinds as the report and `agent compare` read them, the same as
the tools declare, and known without importing the tools."""

import subprocess
import sys

from agent.tool_kinds import TOOL_KINDS


def test_the_table_is_what_the_tools_declare():
    from agent.tools import TOOLS

    declared = {fn.__name__: (fn.spec.kind, fn.spec.mutates) for fn in TOOLS}
    # in TOOLS order; a new or changed @tool goes into agent/tool_kinds.py as well
    assert [(name, tuple(k)) for name, k in TOOL_KINDS.items()] == list(declared.items())


def test_readers_of_records_do_not_import_the_tools():
    """The report's tables and `agent compare` take the kinds from the table, not from the
    tools, which pull scanpy and umap (seconds)."""
    code = (
        "import sys, agent.cohort.compare, agent.report.cohort, agent.report.html;"
        "print(sorted(m for m in ('agent.tools', 'scanpy', 'umap') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
