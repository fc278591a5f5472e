"""How `snakemake -n` scales with the cohort: seconds to parse and plan 100 to 10,000 samples.

Writes sample sheets (and empty input files) into a temporary folder and times a dry run of the
repository's Snakefile for each size, with the reference policy (no servers) and with the llm
policy on vLLM servers (8 samples per shard, so 1,000 samples make 125 server groups). The
per-sample work at parse time is linear by design (one pass over the sheet, dict look-ups per
job); a ratio near 10 for 10x the samples says the whole plan is, too.

What is timed is what a user runs, `snakemake -n` (the job list printed; `--quiet rules` to time
`snakemake -n -q rules` instead: Snakemake formats every job's details either way, so the two
differ by little). The 10,000-sample arm runs once per mode (about half a minute each); the
smaller ones `--repeats` times.

    python -m bench.dag_scale [--sizes 100 1000 10000] [--repeats 3] [--quiet rules]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]

MODES = {
    "reference": {"analysis": {"policy": "reference"}, "server": {"mode": "none"}},
    "llm+vllm": {
        "analysis": {"policy": "llm"},
        "server": {"mode": "vllm", "samples_per_server": 8},
    },
}


def write_cohort(folder: Path, n: int, mode: str) -> Path:
    """A sheet of n samples with existing (empty) inputs, and a config for `mode`."""
    inputs = folder / "inputs"
    inputs.mkdir(parents=True, exist_ok=True)
    lines = ["sample\tpath"]
    for i in range(n):
        path = inputs / f"s{i:05d}.h5ad"
        path.touch()
        lines.append(f"s{i:05d}\tinputs/{path.name}")
    (folder / "samples.tsv").write_text("\n".join(lines) + "\n")
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    config["samples"] = "samples.tsv"
    for key, value in MODES[mode].items():
        config[key].update(value)
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    return folder


def dry_run_seconds(folder: Path, quiet: list[str] = ()) -> tuple[float, int]:
    """Wall seconds of `snakemake -n` in `folder`, and the number of jobs it planned."""
    cmd = [
        *(sys.executable, "-m", "snakemake", "-n", *quiet, "--cores", "64"),
        *("-s", str(REPO / "Snakefile"), "-d", str(folder)),
        *("--configfile", str(folder / "config.yaml")),
    ]
    start = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if out.returncode != 0:
        raise SystemExit(f"snakemake -n failed in {folder}:\n{out.stdout}\n{out.stderr}")
    total = [line.split()[-1] for line in out.stdout.splitlines() if line.startswith("total ")]
    return seconds, int(total[0]) if total else -1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[100, 1000, 10000])
    parser.add_argument(
        "--repeats", type=int, default=3, help="runs per point below 10,000 (median taken)"
    )
    parser.add_argument(
        "--quiet", nargs="?", const="rules", default=None,
        help="pass `-q QUIET` to snakemake (default: plain `snakemake -n`)",
    )  # fmt: skip
    args = parser.parse_args()
    quiet = ["-q", args.quiet] if args.quiet else []
    print(f"timed: snakemake -n {' '.join(quiet)}".rstrip())
    with tempfile.TemporaryDirectory(prefix="dag_scale_") as tmp:
        baseline = dry_run_seconds(write_cohort(Path(tmp) / "baseline", 1, "reference"), quiet)[0]
        print(f"snakemake -n with 1 sample (start-up and parse): {baseline:.1f} s")
        print(f"{'mode':<10} {'samples':>8} {'jobs':>6} {'seconds':>8} {'ms/sample':>10}")
        for mode in MODES:
            for n in args.sizes:
                folder = write_cohort(Path(tmp) / f"{mode}_{n}", n, mode)
                repeats = 1 if n >= 10000 else args.repeats
                runs = [dry_run_seconds(folder, quiet) for _ in range(repeats)]
                seconds = statistics.median(s for s, _ in runs)
                per_sample = 1000 * (seconds - baseline) / (n - 1)
                print(f"{mode:<10} {n:>8} {runs[0][1]:>6} {seconds:>8.1f} {per_sample:>10.2f}")
        print("ms/sample: seconds beyond the 1-sample run, per added sample (flat = linear)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
