"""What every benchmark prints around its table: the machine, the date, and how loaded it was.

Figures from a shared machine are only comparable within one run, so each benchmark measures its
arms side by side and says when other work was competing for the cores.
"""

from __future__ import annotations

import datetime as dt
import os
import platform
from collections.abc import Sequence
from pathlib import Path

from agent.serve import gpu as gpus

BUSY_LOAD_PER_CORE = 0.75  # load average per core above which other work visibly competes


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def memory_gib() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return float("nan")


def machine() -> str:
    """One line: cores, CPU model, memory, GPU (or none), date."""
    found = gpus.detect()
    gpu = found.label() if found is not None else "no GPU"
    today = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return f"{os.cpu_count()}-core CPU ({cpu_model()}), {memory_gib():.0f} GiB RAM, {gpu}; {today}"


def load_line(when: str) -> str:
    """The 1-minute load average, with a warning when other work competes for the cores."""
    load = os.getloadavg()[0]
    cores = os.cpu_count() or 1
    line = f"load average {when}: {load:.2f} on {cores} cores"
    if load > BUSY_LOAD_PER_CORE * cores:
        line += " (HIGH: other work is running; absolute times are slower than on an idle machine)"
    return line


def header(title: str) -> None:
    print(f"# {title}")
    print(f"machine: {machine()}")
    print(load_line("at start"), flush=True)


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], left: int = 1) -> str:
    """A plain-text table: the first ``left`` columns left-aligned, the others right-aligned."""
    cells = [[str(h) for h in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(row: list[str]) -> str:
        return "  ".join(
            c.ljust(w) if i < left else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule, *(line(r) for r in cells[1:])])


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "n/a"
