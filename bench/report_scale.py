"""How the cohort report scales: build seconds and sizes at 100 and 1,000 samples.

The cohorts are copies of one finished sample folder (`agent.testing.cohort_copies.copy_cohort`: new
names, a few numbers changed, final AnnData and plots hard-linked), so the figures measure the
report, not 1,000 analyses. The sample is a reference-policy run of the demo sample pbmc2, made
first (about 30 s) unless `--sample-dir DIR` gives a finished sample folder (with replay.json).

    python -m bench.report_scale [--sizes 100 1000] [--sample-dir DIR]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from bench._report import header, load_line, table


def demo_sample(root: Path) -> Path:
    """A reference analysis of pbmc2 and its replay, as the workflow leaves them."""
    import orjson

    from agent.config import RunConfig
    from agent.data.synthetic import DEMO_COHORT, write_sample
    from agent.replay import replay
    from agent.runner import run_sample

    data = write_sample(DEMO_COHORT["pbmc2"], root / "data" / "pbmc2")
    out = root / "samples" / "pbmc2"
    assert run_sample(RunConfig(input=data, outdir=out, sample="pbmc2")) == "finished"
    (out / "replay.json").write_bytes(orjson.dumps(replay(out / "world_state.json")))
    return out


def size(path: Path) -> int:
    return (
        path.stat().st_size
        if path.is_file()
        else sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    )


def mib(n: int) -> str:
    return f"{n / 2**20:,.1f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", nargs="+", type=int, default=[100, 1000])
    ap.add_argument("--sample-dir", type=Path, help="a finished sample folder to copy")
    args = ap.parse_args()
    header("Cohort report at scale")
    # imported before timing: the tools' import compiles numba kernels once per process
    import agent.report.cohort  # noqa: F401
    from agent.report.build import build_report
    from agent.testing.cohort_copies import copy_cohort

    rows = []
    with tempfile.TemporaryDirectory(prefix="report_scale_") as tmp:
        root = Path(tmp)
        source = args.sample_dir or demo_sample(root / "demo")
        for n in args.sizes:
            states = copy_cohort(source, root / f"c{n}" / "samples", n)
            out = root / f"c{n}" / "report"
            start = time.perf_counter()
            build_report(states, [], out)
            seconds = time.perf_counter() - start
            pages = sorted((out / "samples").glob("*.html"))
            total = sum(size(out / p) for p in ("index.html", "cohort.tsv", "samples", "ro-crate"))
            rows.append(
                [
                    f"{n:,}",
                    f"{seconds:.1f}",
                    f"{1000 * seconds / n:.1f}",
                    f"{size(out / 'index.html') / 1024:,.0f}",
                    f"{size(out / 'samples') / len(pages) / 1024:,.0f}",
                    mib(size(out / "ro-crate")),
                    mib(total),
                ]
            )
            print(f"{n} samples: {seconds:.1f} s", flush=True)
    print()
    print(
        table(
            ["samples", "build s", "ms/sample", "index KiB", "KiB/sample page", "crate MiB",
             "total MiB"],
            rows,
        )
    )  # fmt: skip
    print(load_line("at end"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
