"""Ambient RNA (remove_ambient, issue 40): the estimate's error on planted contamination, and the
tool's time at a few sizes.

Error: each sample is analysed by the reference recipe up to leiden, then remove_ambient runs
with SoupX and with DecontX on the same session. Two kinds of planted load:

  synthetic  a demo-like sample (``agent.data.synthetic``, ``ambient_fraction``): each cell's
             expected counts mixed with the empty droplets' profile at its own share (Beta
             around the mean); planted = the share of the cells' counts that is ambient. Its
             input is filtered (few empties), so SoupX is given the planted empties' soup in
             ``var['ambient_counts']``, as call_cells keeps it for an unfiltered input.
  real       shipped real cells among 20,000 empty droplets of their own pooled RNA
             (``agent.testing.droplets``, ``soup``): each cell gains soup x its UMIs from that
             pool, planted = soup / (1 + soup); the input is unfiltered, so call_cells keeps
             the soup itself.

Time: synthetic samples of 2,000 to 30,000 cells (empties dropped, genes in fewer than 3 cells
filtered), normalised, with the planted cell types standing in for the Leiden clusters (the
tool reads only the clusters; the recipe before it is not what is timed); one remove_ambient
call per method through the registry, seed 0.

    python -m bench.ambient_scale [--sizes 2000 10000 30000] [--quick]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import _report

SYNTHETIC_LOADS = (0.05, 0.1, 0.2)
REAL_LOADS = (("pbmc68k_reduced", 0.05), ("pbmc68k_reduced", 0.15),
              ("celltypist_sample", 0.02), ("celltypist_sample", 0.05))  # fmt: skip


def _estimate(session: Any, method: str) -> tuple[float | None, str, float]:
    from agent.testing.reference_run import call_tool

    started = time.perf_counter()
    outcome = call_tool(session, "remove_ambient", method=method)
    seconds = time.perf_counter() - started
    if not outcome.ok:
        return None, outcome.result["checks"][0]["verdict"] if outcome.result else "error", seconds
    return outcome.result["contamination"], outcome.result["checks"][0]["verdict"], seconds


def _synthetic_error(load: float, folder: Path) -> dict[str, Any]:
    import anndata as ad
    import numpy as np

    from agent.data.synthetic import SampleSpec, load_truth, write_sample
    from agent.testing.reference_run import run_reference

    spec = SampleSpec(f"amb{load}", 3000, seed=21, format="h5ad", ambient_fraction=load)
    path = write_sample(spec, folder / spec.name)
    truth = load_truth(path)
    session, _ = run_reference(path, folder / f"{spec.name}_out", stop_after="leiden")
    adata = session.adata
    totals = np.asarray(adata.layers["counts"].sum(axis=1)).ravel()
    share = truth.loc[adata.obs_names, "ambient_fraction"].to_numpy()
    planted = float((share * totals).sum() / totals.sum())
    raw = ad.read_h5ad(path)
    empty = truth.loc[raw.obs_names, "is_empty"].to_numpy()
    soup = np.asarray(raw[empty][:, adata.var_names].X.sum(axis=0)).ravel()
    adata.var["ambient_counts"] = soup
    return {"sample": f"synthetic {load:g}", "planted": planted, "session": session}


def _real_error(name: str, soup: float, folder: Path) -> dict[str, Any] | None:
    from agent.data.real import REAL_SETS, shipped_file
    from agent.testing.droplets import Droplets, unfiltered
    from agent.testing.reference_run import run_reference

    real = REAL_SETS[name]
    source = shipped_file(real)
    if source is None:
        print(f"({name} not installed: skipped)")
        return None
    matrix = unfiltered(real.read(source)[0], Droplets(20_000, (1, 100), soup=soup, seed=3))
    path = folder / f"{name}_{soup}.h5ad"
    matrix.write_h5ad(path)
    session, _ = run_reference(path, folder / f"{name}_{soup}_out", stop_after="leiden")
    return {"sample": f"{name} soup {soup:g}", "planted": soup / (1 + soup), "session": session}


def errors(folder: Path, quick: bool) -> None:
    cases = [lambda load=load: _synthetic_error(load, folder) for load in SYNTHETIC_LOADS]
    cases += [lambda n=n, s=s: _real_error(n, s, folder) for n, s in REAL_LOADS]
    rows = []
    for make in cases[:1] + cases[3:5] if quick else cases:
        case = make()
        if case is None:
            continue
        for method in ("soupx", "decontx"):
            found, verdict, _ = _estimate(case["session"], method)
            error = None if found is None else found - case["planted"]
            rows.append((case["sample"], method, f"{case['planted']:.3f}",
                         "-" if found is None else f"{found:.3f}",
                         "-" if error is None else f"{error:+.3f}", verdict))  # fmt: skip
    print(_report.table(("sample", "method", "planted", "estimate", "error", "check"), rows, 2))


def _timed_session(n_cells: int, folder: Path) -> Any:
    import anndata as ad
    import numpy as np
    import scanpy as sc

    from agent.data.synthetic import SampleSpec, load_truth, write_sample
    from agent.tools.session import Session

    spec = SampleSpec(f"t{n_cells}", n_cells, seed=1, format="h5ad", ambient_fraction=0.1)
    path = write_sample(spec, folder / spec.name)
    raw = ad.read_h5ad(path)
    truth = load_truth(path).loc[raw.obs_names]
    empty = truth["is_empty"].to_numpy()
    adata = raw[~empty].copy()
    sc.pp.filter_genes(adata, min_cells=3)
    adata.var["ambient_counts"] = np.asarray(raw[empty][:, adata.var_names].X.sum(axis=0)).ravel()
    adata.layers["counts"] = adata.X.copy()
    adata.obs["leiden"] = truth.loc[adata.obs_names, "cell_type"].astype("category")
    session = Session(folder / f"{spec.name}_out", seed=0)
    session.adata = adata
    session.done.add("load_data")
    return session


def timings(sizes: list[int], folder: Path) -> None:
    rows = []
    for n_cells in sizes:
        session = _timed_session(n_cells, folder)
        for method in ("soupx", "decontx"):
            found, verdict, seconds = _estimate(session, method)
            rows.append((f"{n_cells:,}", f"{session.adata.n_vars:,}", method, f"{seconds:.1f}",
                         "-" if found is None else f"{found:.3f}", verdict))  # fmt: skip
    headers = ("cells", "genes", "method", "seconds", "estimate (0.1 planted)", "check")
    print(_report.table(headers, rows, 3))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2000, 10000, 30000])
    parser.add_argument("--quick", action="store_true", help="three error cases, sizes 2,000")
    args = parser.parse_args()
    _report.header("Ambient RNA: error on planted contamination and time")
    with tempfile.TemporaryDirectory() as tmp:
        errors(Path(tmp), args.quick)
        timings([2000] if args.quick else args.sizes, Path(tmp))
    print(_report.load_line("at end"))


if __name__ == "__main__":
    main()
