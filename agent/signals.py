"""Signals that end a run early, turned into an exception: SIGTERM (what Slurm sends at a time limit
or on preemption, and scancel and Snakemake use) and SIGINT. Raised at once, wherever the run is
(or at the next step boundary, where the raise fell into a finalizer that swallows it), so that the record says how it ended, ``finally`` blocks remove temporary files and scratch
folders, and the process exits non-zero for Slurm's requeue or Snakemake's retry to resume it.
A tool call that was cut short is not in the record: the resumed run repeats it."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager

from agent.exit_status import after_signal

HANDLED = (signal.SIGTERM, signal.SIGINT)


class Interrupted(BaseException):  # not an Exception: no tool or retry loop may swallow it
    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")

    @property
    def exit_code(self) -> int:
        return after_signal(self.signum)


_received: list[int] = []  # the signal, kept: a raise inside a finalizer is printed and lost


def check() -> None:
    """Raise Interrupted if a signal arrived whose raise was swallowed (Python runs handlers also
    inside ``__del__`` and weakref callbacks, where an exception goes nowhere): the loop calls
    this at every step boundary, so the run stops there at the latest."""
    if _received:
        raise Interrupted(_received[0])


@contextmanager
def interruptible() -> Iterator[None]:
    """Within the block, the first SIGTERM or SIGINT raises Interrupted; later ones are ignored
    while the run writes its record and cleans up."""

    def handler(signum: int, frame: object) -> None:
        for s in HANDLED:
            signal.signal(s, signal.SIG_IGN)
        _received.append(signum)
        raise Interrupted(signum)

    _received.clear()
    previous = {s: signal.signal(s, handler) for s in HANDLED}
    try:
        yield
    finally:
        _received.clear()
        for s, h in previous.items():
            signal.signal(s, h)
