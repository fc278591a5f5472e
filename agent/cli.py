"""`python -m agent SUBCOMMAND ...`: each subcommand lives in its own module.

A module named here provides ``add_arguments(parser)`` and ``main(args) -> int``; it is imported
only when its subcommand runs, so `run` does not pay for vLLM imports and `serve` not for scanpy.
A module keeps its heavy imports inside the functions that need them, so that a bad option or a
missing path is answered at once.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from importlib import metadata

from agent import say
from agent.exit_status import ExitStatus
from agent.netenv import bypass_proxy_for_local

SUBCOMMANDS = {
    "run": ("agent.runner", "analyse one sample with the agent loop"),
    "synth": ("agent.data.synthetic", "write a synthetic sample or the demo cohort"),
    "serve": ("agent.serve.launch", "start a vLLM server with the four layers and wait on health"),
    "plan": ("agent.serve.plan_cli", "plan KV-cache capacity for a model on a GPU, as serve does"),
    "replay": ("agent.replay.cli", "re-run a recorded world state and compare the results"),
    "report": ("agent.report", "aggregate world states into the cohort report"),
    "compare": ("agent.cohort.compare", "what reprocessing changed: two analyses of each sample"),
    "integrate": (
        "agent.cohort.integrate",
        "integrate the finished samples into one cohort object",
    ),
    "composition": (
        "agent.cohort.composition",
        "each sample's share of every label, and a test of conditions",
    ),
    "de": ("agent.cohort.de", "differential expression between conditions per label (PyDESeq2)"),
    "eval": ("agent.eval.cli", "score a served model's decisions and speed before a cohort"),
}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows an option's default, unless it is empty or the help already names it (as the
    options generated from RunConfig do)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        empty = action.default is None or action.default is False or action.default == []
        if empty or "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def version() -> str:
    try:
        return f"scagent {metadata.version('scagent')}"
    except metadata.PackageNotFoundError:  # a source tree on PYTHONPATH, never installed
        return "scagent (not installed)"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="python -m agent", description=__doc__.splitlines()[0], formatter_class=HelpFormatter
    )
    parser.add_argument("--version", action="version", version=version())
    sub = parser.add_subparsers(dest="command", required=True, metavar="SUBCOMMAND")
    for name, (_, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] not in SUBCOMMANDS:
        parser.parse_args(argv)  # usage, --help, --version, or the unknown subcommand's error
        return ExitStatus.REFUSED
    say.command = f"agent {argv[0]}"
    bypass_proxy_for_local()  # before any client exists: a node's http_proxy never sees loopback
    module = importlib.import_module(SUBCOMMANDS[argv[0]][0])
    cmd = argparse.ArgumentParser(
        prog=f"python -m agent {argv[0]}",
        description=SUBCOMMANDS[argv[0]][1],
        formatter_class=HelpFormatter,
    )
    cmd.add_argument("--version", action="version", version=version())
    module.add_arguments(cmd)
    return int(module.main(cmd.parse_args(argv[1:])) or 0)
