"""Tool-layer overhead: the reference analysis through the tools vs the same scanpy calls made directly.

For each size a synthetic sample (``python -m agent synth --cells N``) is analysed twice, each
time in a fresh process:

  tools  ``python -m agent run --policy reference``: validated calls, result summaries, a data
         digest before and after every step, checkpoints, the world state saved after each step;
  plain  bench/_plain_scanpy.py: the scanpy calls of the same steps with the parameters the tools
         run recorded, and nothing else.

Reported: wall and CPU seconds and peak memory (maximum resident set size, from os.wait4) of
each process; the seconds inside the steps (the tools' own timing of each call, validation and
result summary included; the plain script's timing of each step's scanpy calls) and outside them
(start-up and imports; for the tools also the data digests, checkpoints and world-state saves);
and the ratios. CPU seconds are the steadier figure when other work shares the machine.

Default sizes are 5,000 and 20,000 cells (about 5 minutes on two cores): 100,000
(``--sizes 5000 20000 100000``) takes about 20 minutes per arm there and 7.6 GiB of memory, beyond
a routine run.

    python -m bench.tool_overhead [--sizes 5000 20000]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from agent.record.layout import SampleLayout
from agent.record.world_state import WorldState
from bench import _report
from bench._plain_scanpy import TIMINGS_FILE


@dataclass
class Measured:
    wall_s: float
    cpu_s: float
    peak_mib: float
    in_steps_s: float = 0.0  # inside the analysis steps, by the process's own timing


def measure(argv: list[str], log: Path) -> Measured:
    """Run ``argv`` to completion; its wall and CPU seconds and peak resident memory."""
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, so Popen must not wait
    wall = time.perf_counter() - start
    if proc.returncode:
        tail = log.read_text()[-3000:]
        raise RuntimeError(f"`{' '.join(argv)}` exited {proc.returncode}; end of {log}:\n{tail}")
    return Measured(wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024)


def synthesize(cells: int, folder: Path) -> Path:
    argv = [*(sys.executable, "-m", "agent", "synth", "--outdir", str(folder)),
            *("--cells", str(cells), "--name", f"synth{cells}", "--format", "h5ad")]  # fmt: skip
    subprocess.run(argv, check=True, capture_output=True)
    return folder / "counts.h5ad"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[5000, 20000], help="cells per sample")
    p.add_argument("--workdir", type=Path, help="keep data, outputs and logs here")
    args = p.parse_args()
    _report.header("Tool-layer overhead: tools vs plain scanpy")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = args.workdir or Path(tmp)
        for cells in args.sizes:
            rows += compare(cells, work / f"cells{cells}")
    print()
    headers = ["cells", "arm", "wall s", "cpu s", "in steps s", "outside steps s", "peak MiB"]
    print(_report.table(headers, rows, left=2))
    print(_report.load_line("at end"))
    return 0


def compare(cells: int, folder: Path) -> list[list[str]]:
    """Both arms on one synthetic sample of ``cells`` cells; three table rows."""
    data = synthesize(cells, folder / "data")
    tools_out, plain_out = folder / "tools", folder / "plain"
    tools = measure(
        [*(sys.executable, "-m", "agent", "run", "--policy", "reference", "--fresh"),
         *("--input", str(data), "--outdir", str(tools_out))],
        folder / "tools.log",
    )  # fmt: skip
    record = SampleLayout(tools_out).record
    plain = measure(
        [sys.executable, "-m", "bench._plain_scanpy", str(record), str(data), str(plain_out)],
        folder / "plain.log",
    )
    world = WorldState.load(record)
    tools.in_steps_s = sum(e.seconds for e in world.entries)
    timings = json.loads((plain_out / TIMINGS_FILE).read_text())
    plain.in_steps_s = sum(t["seconds"] for t in timings)
    n_cells = next(e.result["n_cells"] for e in world.entries if e.tool == "load_data")
    print(f"{cells} cells: tools {tools.wall_s:.0f} s, plain {plain.wall_s:.0f} s", flush=True)
    label = f"{cells:,} ({n_cells:,} barcodes)"
    rows = [
        [label, arm, f"{m.wall_s:.1f}", f"{m.cpu_s:.1f}", f"{m.in_steps_s:.1f}",
         f"{m.wall_s - m.in_steps_s:.1f}", f"{m.peak_mib:,.0f}"]
        for arm, m in (("plain scanpy", plain), ("tools", tools))
    ]  # fmt: skip
    figures = [(m.wall_s, m.cpu_s, m.in_steps_s, m.wall_s - m.in_steps_s, m.peak_mib)
               for m in (tools, plain)]  # fmt: skip
    rows.append([label, "tools / plain", *map(_report.ratio, *figures)])
    return rows


if __name__ == "__main__":
    sys.exit(main())
