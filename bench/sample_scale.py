"""A whole reference analysis of one large sample: the code before issue 15 vs this checkout.

One synthetic sample of N cells with planted types, doublets and damaged cells
(``agent.data.synthetic``, .h5ad) is analysed twice, each time by ``python -m agent run --policy
reference`` in a fresh process:

  before  a git worktree of the commit before issue 15 (``--before``): Scrublet on all cells at
          once, resolution by best silhouette, an HVG-only object with a scaled X;
  after   this checkout: batched doublet calling, resolution by separation and stability, the
          all-gene object.

Reported per arm: wall seconds, peak resident memory, the seconds of detect_doublets and
cluster_sweep as the record has them, clusters, and the scores of the final object against the
planted truth (ARI of the clusters on kept singlets, share of planted doublets and damaged cells
removed).

    python -m bench.sample_scale [--cells 50000] [--before REF]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from bench import _report

ROOT = Path(__file__).resolve().parents[1]
BEFORE_ISSUE_15 = "3049457"  # main just before the issue-15 changes


def run_arm(code: Path, data: Path, outdir: Path) -> dict:
    """`agent run` from ``code`` (its `agent` package first on the path), timed by GNU time."""
    cmd = ["/usr/bin/time", "-f", "%e %M", sys.executable, "-m", "agent", "run", "--input",
           str(data), "--outdir", str(outdir), "--policy", "reference", "--sample", "large"]  # fmt: skip
    done = subprocess.run(cmd, cwd=code, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{code}: agent run failed ({done.returncode}):\n{done.stderr[-3000:]}")
    seconds, kib = done.stderr.strip().splitlines()[-1].split()
    record = json.loads((outdir / "world_state.json").read_text())
    step_seconds: dict[str, float] = {}
    for e in record["entries"]:
        step_seconds[e["tool"]] = step_seconds.get(e["tool"], 0.0) + e.get("seconds", 0.0)
    leiden = next(e for e in reversed(record["entries"]) if e["tool"] == "leiden")
    return {
        "seconds": float(seconds),
        "peak_gib": int(kib) / 2**20,
        "doublets_s": step_seconds.get("detect_doublets", 0.0),
        "sweep_s": step_seconds.get("cluster_sweep", 0.0),
        "clusters": leiden["result"]["n_clusters"],
        "resolution": leiden["params"]["resolution"],
        "status": record["meta"]["status"],
    }


def scores(outdir: Path, truth_file: Path) -> dict:
    import anndata as ad

    from agent.record.truth import read_truth, score

    obs = ad.read_h5ad(outdir / "adata.h5ad", backed="r").obs
    return score(obs, read_truth(truth_file))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cells", type=int, default=50000)
    parser.add_argument("--before", default=BEFORE_ISSUE_15, help="git ref of the 'before' arm")
    args = parser.parse_args()

    from agent.data.synthetic import TRUTH_FILE, SampleSpec, write_sample

    _report.header(f"Whole reference analysis of {args.cells:,} cells: before vs after issue 15")
    rows, found = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        spec = SampleSpec("large", args.cells, seed=11, format="h5ad")
        data = write_sample(spec, tmp / "data")
        before = tmp / "before-code"
        subprocess.run(["git", "worktree", "add", "--detach", str(before), args.before],
                       cwd=ROOT, check=True, capture_output=True)  # fmt: skip
        try:
            for arm, code in (("before", before), ("after", ROOT)):
                r = run_arm(code, data, tmp / arm)
                r |= scores(tmp / arm, data.parent / TRUTH_FILE)
                found[arm] = r
                rows.append([
                    arm, r["status"], f"{r['seconds']:.0f}", f"{r['peak_gib']:.2f}",
                    f"{r['doublets_s']:.0f}", f"{r['sweep_s']:.0f}", r["clusters"],
                    r["resolution"], r.get("ari"), r.get("doublet_recall"),
                    r.get("damaged_removed"),
                ])  # fmt: skip
                print(f"{arm}: {r['seconds']:.0f} s", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(before)], cwd=ROOT,
                           check=False, capture_output=True)  # fmt: skip
    headers = ["arm", "status", "seconds", "peak GiB", "doublets s", "sweep s", "clusters",
               "resolution", "ARI", "doublets removed", "damaged removed"]  # fmt: skip
    print(_report.table(headers, rows, left=2))
    print(
        "before/after seconds:",
        _report.ratio(found["before"]["seconds"], found["after"]["seconds"]),
    )
    print(_report.load_line("at end"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
