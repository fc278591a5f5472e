"""Cell calling at the size of a raw droplet matrix: call_cells on 100,000 barcodes x 32,786 genes.

The matrix is built from CellTypist's sample (559 real PBMCs, the whole 10x gene list): cells are
multinomial draws from the real cells' profiles at the real cells' depths; empty droplets draw
1-100 UMIs, and debris barcodes 101-300 UMIs, from the pooled profile of the real cells (ambient
RNA; agent/testing/droplets.py draws them); fixed seed. call_cells runs through the registry on
the loaded data; reported: its seconds (wall and CPU: on a shared machine the CPU time says
more), the decision, the knee, the Monte-Carlo iterations it needed, the cells kept of those
planted, and the empty or debris barcodes kept.

    python -m bench.call_cells_scale [--barcodes 100000] [--cells 5000] [--debris 5000]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from bench import _report


def _matrix(barcodes: int, cells: int, debris: int, seed: int = 0) -> object:
    import anndata as ad
    import numpy as np
    from scipy import sparse

    from agent.data.real import REAL_SETS, shipped_file
    from agent.testing.droplets import draw_umis

    real = REAL_SETS["celltypist_sample"]
    source = shipped_file(real)
    if source is None:
        sys.exit(f"{real.file} of {real.package} is not installed")
    shipped = real.read(source)[0]
    counts = sparse.csr_matrix(shipped.X)
    rng = np.random.default_rng(seed)
    picked = counts[rng.integers(0, shipped.n_obs, cells)]  # a real cell's profile and depth
    depths = np.asarray(picked.sum(axis=1)).ravel().astype(np.int64)
    drawn = [draw_umis(rng, depths[i : i + 1], picked[i].toarray().ravel()) for i in range(cells)]
    pooled = np.asarray(counts.sum(axis=0)).ravel()
    n_empty = barcodes - cells - debris
    for low, high, n in ((1, 100, n_empty), (101, 300, debris)):
        drawn.append(draw_umis(rng, rng.integers(low, high + 1, n), pooled))
    adata = ad.AnnData(sparse.vstack(drawn).tocsr())
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
    from agent.tools import build_registry
    from agent.tools.session import Session

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "raw.h5ad"
        adata = _matrix(args.barcodes, args.cells, args.debris)
        shape = adata.shape
        adata.write_h5ad(path)
        session = Session(Path(tmp) / "out", input_path=path)
        registry = build_registry()
        assert registry.call("load_data", {}, session).ok
        start, cpu = time.perf_counter(), time.process_time()
        out = registry.call("call_cells", {}, session)
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    if not out.ok:
        sys.exit(f"call_cells failed: {out.error}")
    r, kept = out.result, session.adata.obs_names
    rows = [[
        f"{shape[0]:,} x {shape[1]:,}", f"{seconds:.1f}", f"{cpu:.1f}", r["decision"], r["evidence"]["knee"],
        r["barcodes_tested"], f"{r['iterations']:,}", f"{kept.str.startswith('CELL').sum():,} / {args.cells:,}",
        int(kept.str.startswith("EMPTY").sum()), int(kept.str.startswith("DEBRIS").sum()),
    ]]  # fmt: skip
    headers = ["barcodes x genes", "seconds", "CPU seconds", "decision", "knee", "tested", "iterations", "cells kept",
               "empties kept", "debris kept"]  # fmt: skip
    print(_report.table(headers, rows, left=1))
    print(_report.load_line("at end"))


if __name__ == "__main__":
    main()
