"""call_cells against DropletUtils' own emptyDrops and barcodeRanks (issue 37).

Unfiltered matrices made from the real cells packages ship (agent/testing/droplets.py: the cells'
own counts, thinned or cut to a panel of genes, among empty droplets of their own ambient RNA):
the seven the tests compare (ORACLE_CASES, among them a 2,000-gene panel of issue 37's kind) and,
unless --quick, issue 37's matrix itself (CellTypist's 559 cells among 20,000 empties of 5-300
UMIs, all 32,786 genes: HEAVY_CASES). call_cells runs through the registry after load_data;
DropletUtils (Bioconductor, Debian's r-bioc-dropletutils) through Rscript on the same counts, both
seeded, both raising the Monte-Carlo iterations tenfold while barcodes at the floor miss FDR 0.001.

Reported per matrix: knee, inflection, alpha and iterations of each; cells called by each and how
many of them are the planted real cells; the Jaccard index of the two called sets; the empty
barcodes call_cells kept (share of what it kept); the barcodes above the inflection it left
uncalled; the seconds of each (DropletUtils' without R's start-up).

    python -m bench.call_cells_dropletutils [--quick]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from bench import _report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only the matrices the tests use")
    args = parser.parse_args()
    _report.header("call_cells vs DropletUtils on unfiltered matrices of real cells")
    from agent.data.real import REAL_SETS, shipped_file
    from agent.testing.droplets import HEAVY_CASES, ORACLE_CASES, dropletutils, is_cell, rscript
    from agent.tools import build_registry
    from agent.tools.session import Session

    if rscript() is None:
        sys.exit("R with DropletUtils is not installed: bash tests/realdata/install.sh")
    registry = build_registry()
    cases = ORACLE_CASES | ({} if args.quick else HEAVY_CASES)
    inputs, ours, cells = {}, {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, case in cases.items():
            real = REAL_SETS[case.real_set]
            source = shipped_file(real)
            if source is None:
                sys.exit(f"{real.file} of {real.package} is not installed")
            if case.real_set not in cells:
                cells[case.real_set] = real.read(source)[0]
            path = Path(tmp) / f"{name}.h5ad"
            case.build(cells[case.real_set]).write_h5ad(path)
            session = Session(Path(tmp) / name, input_path=path)
            assert registry.call("load_data", {}, session).ok
            inputs[name] = session.adata.copy()
            start = time.perf_counter()
            out = registry.call("call_cells", {}, session)
            if not out.ok:
                sys.exit(f"{name}: call_cells failed: {out.error}")
            ours[name] = (out.result, session.adata.obs_names, time.perf_counter() - start)
        theirs = dropletutils(inputs)
    rows = []
    for name, (result, kept_names, seconds) in ours.items():
        oracle, adata = theirs[name], inputs[name]
        kept = adata.obs_names.isin(kept_names)
        called = oracle["calls"]["cell"].to_numpy()
        real = is_cell(adata.obs_names)
        jaccard = (kept & called).sum() / (kept | called).sum()
        empties = int((kept & ~real).sum())
        rows.append([
            name, f"{adata.n_obs:,} x {adata.n_vars:,}", int(real.sum()),
            f"{result['evidence']['knee']} / {oracle['knee']:.0f}",
            f"{result['evidence']['inflection']} / {oracle['inflection']:.0f}",
            f"{result['alpha']:.0f} / {oracle['alpha']:.0f}",
            f"{result['iterations']:,} / {oracle['niters']:,}",
            f"{int(kept.sum())} / {int(called.sum())}",
            f"{int((kept & real).sum())} / {int((called & real).sum())}",
            f"{jaccard:.3f}", f"{empties} ({empties / max(int(kept.sum()), 1):.1%})",
            result["not_called"]["barcodes"], f"{seconds:.1f} / {oracle['seconds']:.1f}",
        ])  # fmt: skip
    headers = ["matrix", "barcodes x genes", "real cells", "knee", "inflection", "alpha",
               "iterations", "cells called", "real called", "Jaccard", "empties kept",
               "left above infl.", "seconds"]  # fmt: skip
    print("(each pair: call_cells / DropletUtils " + next(iter(theirs.values()))["version"] + ")")
    print(_report.table(headers, rows, left=1))
    print(_report.load_line("at end"))


if __name__ == "__main__":
    main()
