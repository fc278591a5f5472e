"""Doublet detection at scale: scanpy's Scrublet as the tool ran it before vs detect_doublets now.

For each size a synthetic sample with planted doublets (``agent.data.synthetic``) is written once;
its empty barcodes are dropped and genes in fewer than 3 cells filtered (what the recipe's
filters do before doublet calling). Each arm then runs in a fresh process on the same cells:

  before  ``sc.pp.scrublet`` on all cells at once, as detect_doublets called it until issue 15:
          30 PCs, two simulated doublets per cell, exact kNN up to 20,000 cells and pynndescent
          above;
  after   the detect_doublets tool through the registry (random batches of about 10,000 cells,
          exact kNN in each).

Both use the reference recipe's expected doublet rate for the sample's size and seed 0.
Reported per arm: seconds of the doublet call, peak resident memory during the call (the
process's peak reset after loading) and its increase over the loaded data, and recall and precision of the called doublets against the
planted ones.

    python bench/doublets_scale.py [--cells 10000 50000]
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import _report

ARMS = ("before", "after")


def _cells(path: Path) -> tuple[object, object]:
    """The sample's cell barcodes (empties dropped, rare genes filtered) and their truth."""
    import scanpy as sc

    from agent.data.synthetic import load_truth

    adata = sc.read_h5ad(path)
    truth = load_truth(path).loc[adata.obs_names]
    keep = ~truth["is_empty"].to_numpy()
    adata, truth = adata[keep].copy(), truth[keep]
    sc.pp.filter_genes(adata, min_cells=3)
    return adata, truth


def _rate(n_cells: int) -> float:
    from agent.policies.reference import _doublet_rate

    facts = {"filter_by_qc": {"cells_after": n_cells}}
    return _doublet_rate(lambda tool: facts.get(tool, {}))["expected_doublet_rate"]


def _before(adata: object, rate: float) -> Callable[[], None]:
    import scanpy as sc

    return lambda: sc.pp.scrublet(
        adata,
        expected_doublet_rate=rate,
        n_prin_comps=30,
        random_state=0,
        use_approx_neighbors=adata.n_obs > 20000,
        verbose=False,
    )


def _after(adata: object, rate: float, outdir: Path) -> Callable[[], None]:
    from agent.tools import build_registry
    from agent.tools.session import Session

    registry, session = build_registry(), Session(outdir, seed=0)
    session.adata = adata

    def call() -> None:
        out = registry.call("detect_doublets", {"expected_doublet_rate": rate}, session)
        if not out.ok:
            raise SystemExit(f"detect_doublets failed: {out.error}")

    return call


def _peak_mib(reset: bool = False) -> float:
    """This process's peak resident memory (VmHWM); ``reset`` starts a new peak from now
    (Linux clear_refs 5), so the loaded data's own peak does not hide the call's."""
    if reset:
        Path("/proc/self/clear_refs").write_text("5")
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_arm(arm: str, path: Path) -> dict[str, float]:
    """One arm in this process: seconds, memory and recall of its doublet call (imports, data
    and the tool registry are made before the clock starts)."""
    adata, truth = _cells(path)
    rate = _rate(adata.n_obs)
    with tempfile.TemporaryDirectory() as tmp:
        call = _before(adata, rate) if arm == "before" else _after(adata, rate, Path(tmp))
        gc.collect()
        loaded = _peak_mib(reset=True)
        start = time.perf_counter()
        call()
        seconds = time.perf_counter() - start
    peak = _peak_mib()
    called = adata.obs["predicted_doublet"].astype(bool).to_numpy()
    planted = truth["is_doublet"].to_numpy()
    return {
        "cells": adata.n_obs,
        "rate": rate,
        "seconds": seconds,
        "peak_mib": peak,
        "added_mib": peak - loaded,
        "recall": float(called[planted].mean()),
        "precision": float(planted[called].mean()) if called.any() else float("nan"),
    }


def measure(arm: str, path: Path) -> dict[str, float]:
    """Run one arm in a fresh process (its own peak memory) and return its figures."""
    argv = [sys.executable, __file__, "--arm", arm, "--data", str(path)]
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"arm {arm} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cells", type=int, nargs="+", default=[10000, 50000])
    parser.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)  # a child process
    parser.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.arm:
        print(json.dumps(run_arm(args.arm, args.data)))
        return 0

    from agent.data.synthetic import SampleSpec, write_sample

    _report.header("Doublet detection at scale: Scrublet before vs detect_doublets after")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.cells:
            spec = SampleSpec(f"doublets{n}", n, seed=11, format="h5ad")
            path = write_sample(spec, Path(tmp) / spec.name)
            found = {arm: measure(arm, path) for arm in ARMS}
            for arm, r in found.items():
                rows.append([
                    f"{n:,}", arm, f"{r['cells']:,}", r["rate"], f"{r['seconds']:.1f}",
                    f"{r['peak_mib']:.0f}", f"{r['added_mib']:.0f}", f"{r['recall']:.3f}",
                    f"{r['precision']:.3f}",
                ])  # fmt: skip
            speedup = _report.ratio(found["before"]["seconds"], found["after"]["seconds"])
            print(f"{n:,} cells: before/after seconds {speedup}", flush=True)
    headers = ["sample", "arm", "cells", "rate", "seconds", "peak MiB", "added MiB", "recall",
               "precision"]  # fmt: skip
    print(_report.table(headers, rows, left=2))
    print(_report.load_line("at end"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
