"""One style for what a subcommand tells its user on stderr: ``agent COMMAND: message``, and
``agent COMMAND: error: message`` for a failure, as argparse writes its own (``prog: error:``).

A leaf module: any module may import it; `agent/cli.py` names the command before it runs one."""

from __future__ import annotations

import sys

command = "agent"  # "agent SUBCOMMAND" once cli.main has chosen one


def note(message: str) -> None:
    print(f"{command}: {message}", file=sys.stderr, flush=True)


def error(message: str) -> None:
    note(f"error: {message}")
