"""The cohort object at scale: seconds and peak memory of `agent integrate` at 10, 100 and 400
samples of the demo's size.

The cohorts are copies of one finished sample folder (`agent.testing.cohort_copies.finished_copy`,
records re-chained and sealed so that the integrity check passes,
final AnnData hard-linked): a reference analysis of the demo sample pbmc2 made first (about 30 s)
unless `--sample-dir DIR` gives a finished one. Each size runs `python -m agent integrate` as a
child process; its peak memory is the child's own ru_maxrss (os.wait4), which covers the native
libraries (BLAS, harmonypy's C++, numba) that tracemalloc does not see. A size whose memory,
extrapolated per cell from the size before, would not fit in the memory available now is
skipped with that figure, so the benchmark never drives a shared machine out of memory.

    python -m bench.cohort_integration [--sizes 10 100 400] [--method harmony] [--sample-dir DIR]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench._report import header, load_line, table

HEADROOM = 0.8  # share of the available memory a size may be projected to use


def demo_sample(root: Path) -> Path:
    """A reference analysis of pbmc2, as the workflow leaves it."""
    from agent.config import RunConfig
    from agent.data.synthetic import DEMO_COHORT, write_sample
    from agent.runner import run_sample

    data = write_sample(DEMO_COHORT["pbmc2"], root / "data" / "pbmc2")
    out = root / "samples" / "pbmc2"
    assert run_sample(RunConfig(input=data, outdir=out, sample="pbmc2")) == "finished"
    return out


def available_kib() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1])
    return 0


def integrate(states: list[Path], outdir: Path, method: str) -> tuple[float, int, str]:
    """Seconds, the child's peak RSS (KiB) and its last line."""
    argv = [sys.executable, "-m", "agent", "integrate", "--outdir", str(outdir)]
    argv += ["--method", method, "--world-states", *map(str, states)]
    start = time.perf_counter()
    child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = child.stdout.read()
    _, status, usage = os.wait4(child.pid, 0)
    seconds = time.perf_counter() - start
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        raise SystemExit(f"agent integrate failed (exit {child.returncode}):\n{output[-3000:]}")
    return seconds, usage.ru_maxrss, output.strip().splitlines()[-1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", nargs="+", type=int, default=[10, 100, 400])
    ap.add_argument("--method", default="harmony", choices=["harmony", "none"])
    ap.add_argument("--sample-dir", type=Path, help="a finished sample folder to copy")
    args = ap.parse_args()
    header(f"Cohort integration ({args.method}) at scale")
    import anndata as ad

    from agent.digest import digest_adata
    from agent.testing.cohort_copies import finished_copy

    rows, per_cell = [], None
    with tempfile.TemporaryDirectory(prefix="cohort_integration_") as tmp:
        root = Path(tmp)
        source = args.sample_dir or demo_sample(root / "demo")
        cells_per_sample = ad.read_h5ad(source / "adata.h5ad", backed="r").n_obs
        digest = digest_adata(ad.read_h5ad(source / "adata.h5ad"))
        for n in sorted(args.sizes):
            cells = n * cells_per_sample
            if per_cell is not None and per_cell * cells > HEADROOM * available_kib():
                need = per_cell * cells / 2**20
                print(f"{n} samples: skipped, ~{need:.1f} GiB projected", flush=True)
                rows.append([n, f"{cells:,}", "skipped", f"~{need:.1f} (projected)", ""])
                continue
            folder = root / f"c{n}" / "samples"  # sound records (integrate reads no other)
            states = [
                finished_copy(source, folder, f"s{i:04d}", source / "adata.h5ad", digest)
                for i in range(n)
            ]
            seconds, peak, line = integrate(states, root / f"c{n}" / "cohort", args.method)
            per_cell = peak / cells
            print(f"{n} samples: {seconds:.0f} s, {peak / 2**20:.2f} GiB; {line}", flush=True)
            rows.append(
                [n, f"{cells:,}", f"{seconds:.0f}", f"{peak / 2**20:.2f}", f"{per_cell:.1f}"]
            )
    print()
    print(table(["samples", "cells", "seconds", "peak RSS GiB", "KiB/cell"], rows))
    print(load_line("at end"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
