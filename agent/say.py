"""One style for what a subcommand tells its user on stderr: ``agent COMMAND: message``, and
``agent COMMAND: error: message`` for a failure, as argparse writes its own (``prog: error:``).

A leaf module: any module may import it; `agent/cli.py` names the command before it runs one."""

from __future__ import annotations

import sys
import time

command = "agent"  # "agent SUBCOMMAND" once cli.main has chosen one


def note(message: str) -> None:
    print(f"{command}: {message}", file=sys.stderr, flush=True)


def error(message: str) -> None:
    note(f"error: {message}")


class Progress:
    """One line on stderr per stage with the seconds since the start: a cohort of hundreds takes
    tens of seconds, and a silent job looks hung."""

    def __init__(self) -> None:
        self.start = time.monotonic()

    def __call__(self, what: str) -> None:
        note(f"{what} ({time.monotonic() - self.start:.1f} s)")
