"""The cohort's composition and differential expression at scale: seconds and peak memory of
`agent composition` and `agent de` at 10 and 100 samples of the demo's size.

The cohorts are copies of one finished sample folder made sound for the steps, which read only
samples whose records pass the integrity check (`agent.testing.cohort_copies.finished_copy`):
each copy holds a fixed-seed 90% of the source's cells, so that the pseudobulks differ as
replicates do; half the copies are `control`, half `treated` in the sheet. The source is a
reference analysis of the demo sample pbmc2 made first (about 30 s) unless `--sample-dir DIR`
gives a finished one. Each step runs as a child process, as the workflow's job does (`agent de
--threads`, default 2); its peak memory is the child's own ru_maxrss (os.wait4).

    python -m bench.cohort_conditions [--sizes 10 100] [--threads 2] [--sample-dir DIR]
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
from bench.cohort_integration import demo_sample

SHARE = 0.9  # of the source's cells in each copy


def cohort(source: Path, root: Path, n: int) -> tuple[list[Path], Path]:
    """``n`` sound copies of ``source`` (a fixed-seed SHARE of its cells each) and their sheet."""
    import anndata as ad
    import numpy as np

    from agent.testing.cohort_copies import finished_copy

    final = ad.read_h5ad(source / "adata.h5ad")
    states, rows = [], ["sample\tpath\tcondition"]
    for i in range(n):
        name = f"s{i:03d}"
        pick = np.sort(
            np.random.default_rng(i).permutation(final.n_obs)[: int(SHARE * final.n_obs)]
        )
        states.append(finished_copy(source, root / "samples", name, final[pick].copy()))
        rows.append(f"{name}\t{source}\t{'control' if i % 2 == 0 else 'treated'}")
    sheet = root / "samples.tsv"
    sheet.write_text("\n".join(rows) + "\n")
    return states, sheet


def step(command: str, states: list[Path], sheet: Path, outdir: Path, *extra: str) -> tuple:
    """Seconds, the child's peak RSS (KiB) and its last line."""
    argv = [sys.executable, "-m", "agent", command, "--world-states", *map(str, states)]
    argv += ["--samples", str(sheet), "--outdir", str(outdir), *extra]
    start = time.perf_counter()
    child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = child.stdout.read()
    _, status, usage = os.wait4(child.pid, 0)
    seconds = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"agent {command} failed:\n{output[-3000:]}")
    return seconds, usage.ru_maxrss, output.strip().splitlines()[-1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", nargs="+", type=int, default=[10, 100])
    ap.add_argument("--threads", type=int, default=2, help="agent de --threads")
    ap.add_argument("--sample-dir", type=Path, help="a finished sample folder to copy")
    args = ap.parse_args()
    header("Cohort composition and differential expression at scale")
    rows = []
    with tempfile.TemporaryDirectory(prefix="cohort_conditions_") as tmp:
        root = Path(tmp)
        source = args.sample_dir or demo_sample(root / "demo")
        for n in sorted(args.sizes):
            start = time.perf_counter()
            states, sheet = cohort(source, root / f"c{n}", n)
            made = time.perf_counter() - start
            out = root / f"c{n}" / "cohort"
            c_s, c_rss, c_line = step("composition", states, sheet, out / "composition")
            d_s, d_rss, d_line = step(
                "de", states, sheet, out / "de", "--threads", str(args.threads)
            )
            print(f"{n} samples (made in {made:.0f} s): {c_line}\n  {d_line}", flush=True)
            rows.append(
                [n, f"{c_s:.1f}", f"{c_rss / 2**20:.2f}", f"{d_s:.0f}", f"{d_rss / 2**20:.2f}",
                 f"{d_s / n:.2f}"]
            )  # fmt: skip
    print()
    print(
        table(
            ["samples", "composition s", "composition GiB", "de s", "de GiB", "de s/sample"],
            rows,
        )
    )
    print(load_line("at end"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
