"""The exit statuses of `agent run`, one table: the runner returns them, its --help lists them, and
the docs' table is checked against ``MEANING`` (a stop by signal N is 128+N, the shell's way)."""

from __future__ import annotations

import enum


class ExitStatus(enum.IntEnum):
    COMPLETE = 0  # the record is complete, also for a partial or unfinished analysis
    BROKEN = 1  # something outside the analysis broke it: a rerun resumes
    REFUSED = 2  # refused before starting: nothing of the run recorded
    INPUT_REFUSED = 3  # the input's content was refused: the record says why


MEANING: dict[ExitStatus, str] = {
    ExitStatus.COMPLETE: "the analysis ended with a complete record (finished, partial, or"
    " unfinished after repeated failures or at the step limit)",
    ExitStatus.BROKEN: "something outside the analysis broke it (server, I/O, too little memory or"
    " disk for the input, folder in use): a rerun resumes",
    ExitStatus.REFUSED: "refused before starting (options, missing input, an earlier record with"
    " other settings, an output folder without hard links or locks)",
    ExitStatus.INPUT_REFUSED: "the input was refused (load_data could not read counts from it; the"
    " record says why in meta.error)",
}
SIGNALLED = "128+N stopped by signal N (the record says so; a rerun resumes)"


def after_signal(signum: int) -> int:
    """The status of a process that signal ``signum`` stopped."""
    return 128 + signum


def epilog() -> str:
    """The table in one paragraph, as `agent run --help` ends."""
    rows = [f"{status.value} {MEANING[status]}" for status in ExitStatus]
    return "exit status: " + "; ".join([*rows, SIGNALLED])
