"""Doublet detection at scale: scanpy's Scrublet on all cells, and detect_doublets' batches with
a threshold per batch (issue 15) vs one threshold for all (issue 24).

For each size a synthetic sample with planted doublets (``agent.data.synthetic``) is written once;
its empty barcodes are dropped and genes in fewer than 3 cells filtered (what the recipe's
filters do before doublet calling). Each arm then runs in a fresh process on the same cells:

  whole    (only with --whole: 280 s at 50,000 cells) ``sc.pp.scrublet`` on all cells at once,
           as detect_doublets called it until issue 15: 30 PCs, two simulated doublets per cell,
           exact kNN up to 20,000 cells and pynndescent above;
  batched  the detect_doublets tool through the registry (random batches of about 10,000 cells,
           exact kNN in each). Its one call gives two rows: "per batch", each batch's cells called
           at the automatic threshold of that batch's own simulated doublets (the tool until issue
           24: the result's batch_thresholds), and "pooled", the tool's calls now (one automatic
           threshold from all batches' simulated doublets). The scores are the same in both.

All use the reference recipe's expected doublet rate for the sample's size and seed 0.
Reported per arm: seconds of the doublet call, peak resident memory during the call (the
process's peak reset after loading) and its increase over the loaded data, the threshold(s), and
recall and precision of the called doublets against the planted ones.

    python -m bench.doublets_scale [--cells 10000 50000] [--whole]
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
from typing import Any

from bench import _report

ARMS = ("whole", "batched")


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


def _whole(adata: Any, rate: float) -> Callable[[], dict[str, Any]]:
    import scanpy as sc

    def call() -> dict[str, Any]:
        sc.pp.scrublet(
            adata,
            expected_doublet_rate=rate,
            n_prin_comps=30,
            random_state=0,
            use_approx_neighbors=adata.n_obs > 20000,
            verbose=False,
        )
        return {}

    return call


def _batched(adata: Any, rate: float, outdir: Path) -> Callable[[], dict[str, Any]]:
    from agent.tools import build_registry
    from agent.tools.session import Session

    registry, session = build_registry(), Session(outdir, seed=0)
    session.adata = adata

    def call() -> dict[str, Any]:
        out = registry.call("detect_doublets", {"expected_doublet_rate": rate}, session)
        if not out.ok:
            raise SystemExit(f"detect_doublets failed: {out.error}")
        return out.result

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


def _accuracy(called: Any, planted: Any) -> dict[str, float]:
    return {
        "recall": float(called[planted].mean()),
        "precision": float(planted[called].mean()) if called.any() else float("nan"),
    }


def _per_batch_calls(adata: Any, thresholds: list[float | None]) -> Any:
    """The calls detect_doublets made until issue 24: each batch's cells at its own threshold
    (the same random batches: agent.tools.doublets._batches with the same seed)."""
    import numpy as np

    from agent.tools.doublets import _batches

    scores = adata.obs["doublet_score"].to_numpy()
    called = np.zeros(adata.n_obs, bool)
    for cells, threshold in zip(_batches(adata.n_obs, 0), thresholds, strict=True):
        if threshold is None:
            raise SystemExit("a batch found no automatic threshold: no per-batch calls to compare")
        called[cells] = scores[cells] > threshold
    return called


def run_arm(arm: str, path: Path) -> list[dict[str, Any]]:
    """One arm in this process: seconds, memory and accuracy of its doublet call (imports, data
    and the tool registry are made before the clock starts); the batched arm gives two rows."""
    adata, truth = _cells(path)
    rate = _rate(adata.n_obs)
    with tempfile.TemporaryDirectory() as tmp:
        call = _whole(adata, rate) if arm == "whole" else _batched(adata, rate, Path(tmp))
        gc.collect()
        loaded = _peak_mib(reset=True)
        start = time.perf_counter()
        result = call()
        seconds = time.perf_counter() - start
    peak = _peak_mib()
    planted = truth["is_doublet"].to_numpy()
    common = {"cells": adata.n_obs, "rate": rate, "seconds": seconds, "peak_mib": peak,
              "added_mib": peak - loaded}  # fmt: skip
    called = adata.obs["predicted_doublet"].astype(bool).to_numpy()
    threshold = float(adata.uns["scrublet"]["threshold"])
    if arm == "whole":
        return [{"arm": "whole", **common, "threshold": f"{threshold:.3f}",
                 **_accuracy(called, planted)}]  # fmt: skip
    # one batch: its own threshold is the pooled one (the tool leaves batch_thresholds out)
    per_batch = result.get("batch_thresholds", [result["threshold"]])
    return [
        {"arm": "per batch (issue 15)", **common,
         "threshold": "/".join(f"{t:.3f}" for t in per_batch if t is not None),
         **_accuracy(_per_batch_calls(adata, per_batch), planted)},
        {"arm": "pooled (now)", **common, "threshold": f"{threshold:.3f}",
         **_accuracy(called, planted)},
    ]  # fmt: skip


def measure(arm: str, path: Path) -> list[dict[str, Any]]:
    """Run one arm in a fresh process (its own peak memory) and return its rows."""
    argv = [sys.executable, "-m", "bench.doublets_scale", "--arm", arm, "--data", str(path)]
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"arm {arm} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cells", type=int, nargs="+", default=[10000, 50000])
    parser.add_argument(
        "--whole", action="store_true", help="also Scrublet on all cells at once (minutes)"
    )
    parser.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)  # a child process
    parser.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.arm:
        print(json.dumps(run_arm(args.arm, args.data)))
        return 0

    from agent.data.synthetic import SampleSpec, write_sample

    _report.header("Doublet detection at scale: thresholds per batch vs one for all batches")
    arms = ARMS if args.whole else ("batched",)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.cells:
            spec = SampleSpec(f"doublets{n}", n, seed=11, format="h5ad")
            path = write_sample(spec, Path(tmp) / spec.name)
            for arm in arms:
                for r in measure(arm, path):
                    rows.append([
                        f"{n:,}", r["arm"], f"{r['cells']:,}", r["rate"], f"{r['seconds']:.1f}",
                        f"{r['peak_mib']:.0f}", f"{r['added_mib']:.0f}", r["threshold"],
                        f"{r['recall']:.3f}", f"{r['precision']:.3f}",
                    ])  # fmt: skip
                    print("  ".join(map(str, rows[-1])), flush=True)
    headers = ["sample", "arm", "cells", "rate", "seconds", "peak MiB", "added MiB", "threshold",
               "recall", "precision"]  # fmt: skip
    print(_report.table(headers, rows, left=2))
    print(_report.load_line("at end"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
