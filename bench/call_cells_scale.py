"""Cell calling at the size of a raw droplet matrix: call_cells on 100,000 barcodes x 32,786 genes.

The matrix is built from CellTypist's sample (559 real PBMCs, the whole 10x gene list): cells are
multinomial draws from the real cells' profiles at the real cells' depths; empty droplets draw
1-100 UMIs, and debris barcodes 101-300 UMIs, from the pooled profile of the real cells (ambient
RNA); fixed seed. call_cells runs through the registry on the loaded data; reported: its seconds
(wall and CPU: on a shared machine the CPU time says more), the decision, the knee, the cells kept of those planted, and the empty or debris barcodes kept.

    python bench/call_cells_scale.py [--barcodes 100000] [--cells 5000] [--debris 5000]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import _report

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _draw(rng: object, totals: object, genes: object, weights: object) -> object:
    """UMIs of barcodes with the given totals, each UMI a gene drawn from ``weights``: as sparse
    (row, gene) pairs, since 95,000 dense rows of 32,786 genes do not fit in memory."""
    import numpy as np

    cumulative = np.cumsum(weights) / np.sum(weights)
    picked = np.minimum(np.searchsorted(cumulative, rng.random(int(totals.sum()))), len(genes) - 1)
    return np.repeat(np.arange(len(totals)), totals), genes[picked]


def _matrix(barcodes: int, cells: int, debris: int, seed: int = 0) -> object:
    import anndata as ad
    import numpy as np
    from scipy import sparse

    from tests.fixtures_realdata import REAL_SETS, shipped_file

    real = REAL_SETS["celltypist_sample"]
    source = shipped_file(real)
    if source is None:
        sys.exit(f"{real.file} of {real.package} is not installed")
    shipped = real.read(source)[0]
    counts = sparse.csr_matrix(shipped.X)
    rng = np.random.default_rng(seed)
    rows, genes, offset = [], [], 0
    for source_cell in rng.integers(0, shipped.n_obs, cells):  # a real cell's profile and depth
        row = counts[source_cell]
        depth = np.array([int(row.sum())])
        r, g = _draw(rng, depth, row.indices, row.data)
        rows.append(r + offset)
        genes.append(g)
        offset += 1
    pooled = np.asarray(counts.sum(axis=0)).ravel()
    everything = np.arange(shipped.n_vars)
    n_empty = barcodes - cells - debris
    for low, high, n in ((1, 100, n_empty), (101, 300, debris)):
        r, g = _draw(rng, rng.integers(low, high + 1, n), everything, pooled)
        rows.append(r + offset)
        genes.append(g)
        offset += n
    rows, genes = np.concatenate(rows), np.concatenate(genes)
    matrix = sparse.csr_matrix(
        (np.ones(len(rows), np.float32), (rows, genes)), shape=(barcodes, shipped.n_vars)
    )
    matrix.sum_duplicates()
    adata = ad.AnnData(matrix)
    adata.var_names = shipped.var_names
    kinds = (("CELL", cells), ("EMPTY", n_empty), ("DEBRIS", debris))
    adata.obs_names = [f"{kind}{i}" for kind, n in kinds for i in range(n)]
    return adata


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--barcodes", type=int, default=100_000)
    parser.add_argument("--cells", type=int, default=5_000)
    parser.add_argument("--debris", type=int, default=5_000)
    args = parser.parse_args()
    _report.header("call_cells on an unfiltered droplet matrix")
    from agent.tools.session import Session
    from tests.fixtures_data import call_tool

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "raw.h5ad"
        adata = _matrix(args.barcodes, args.cells, args.debris)
        shape = adata.shape
        adata.write_h5ad(path)
        session = Session(Path(tmp) / "out", input_path=path)
        assert call_tool(session, "load_data").ok
        start, cpu = time.perf_counter(), time.process_time()
        out = call_tool(session, "call_cells")
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    if not out.ok:
        sys.exit(f"call_cells failed: {out.error}")
    r, kept = out.result, session.adata.obs_names
    rows = [[
        f"{shape[0]:,} x {shape[1]:,}", f"{seconds:.1f}", f"{cpu:.1f}", r["decision"], r["evidence"]["knee"],
        r["barcodes_tested"], f"{kept.str.startswith('CELL').sum():,} / {args.cells:,}",
        int(kept.str.startswith("EMPTY").sum()), int(kept.str.startswith("DEBRIS").sum()),
    ]]  # fmt: skip
    headers = ["barcodes x genes", "seconds", "CPU seconds", "decision", "knee", "tested", "cells kept",
               "empties kept", "debris kept"]  # fmt: skip
    print(_report.table(headers, rows, left=1))
    print(_report.load_line("at end"))


if __name__ == "__main__":
    main()
