"""`python -m agent report`: the cohort report from the samples' world states and replays.

Writes into OUTDIR: cohort.tsv (one row per sample: provenance, outcomes, the checks of the
model's decisions counted, every parameter chosen (a repeated filter's in force), drift and
outlier flags), index.html (the cohort: summary, figures embedded as PNG, one compact samples
table, sortable and filterable, its columns in views; the samples to look at, with their checks
that warned or were refused; the performance section from the servers' metrics files and the
samples' metrics, agent/report/performance.py), samples/NAME.html (one self-contained page per
sample: checks, details, replay, plots, parameters, steps; linked from the index)
and ro-crate/ (a Workflow Run RO-Crate); with --comparison, a copy of what `agent compare`
wrote (comparison.tsv, comparison.html), linked from the index; with --eval, the model's
evaluation (`agent eval`'s eval.json and eval.html) copied and linked with its score when it
evaluated the samples' model, named as another model's otherwise (agent/report/evaluation.py);
with --composition, each sample's share of every label (`agent composition`: composition.tsv
copied beside cohort.tsv, the stacked bars and the test of conditions in the index); with --de,
the differential expression per label (`agent de`: its tables copied into de/, volcanoes and top
genes in the index).
A sample that failed, or whose world state is missing or unreadable, is shown as failed; it
never stops the report.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from agent import say
from agent.record.layout import RECORD, REPLAY
from agent.report.build import build_report
from agent.report.drift import FLOOR, THRESHOLD


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--world-states", nargs="+", required=True, type=Path, metavar="FILE",
        help=f"the samples' {RECORD} files (missing ones are reported as failed)",
    )  # fmt: skip
    p.add_argument(
        "--replays", nargs="*", default=[], type=Path, metavar="FILE",
        help=f"{REPLAY} files (default: {REPLAY} beside each world state, where present)",
    )  # fmt: skip
    p.add_argument(
        "--truth-dir", type=Path,
        help="folder with DIR/SAMPLE/truth.tsv or DIR/SAMPLE.tsv (default: truth.tsv beside "
        "each sample's input, where present)",
    )  # fmt: skip
    p.add_argument("--outdir", required=True, type=Path, help="e.g. results/report")
    p.add_argument(
        "--drift-mads", type=float, default=THRESHOLD,
        help="flag values further than this many MADs from the cohort median",
    )  # fmt: skip
    p.add_argument(
        "--drift-floor", type=float, default=FLOOR,
        help="the MAD counts as at least this fraction of the median",
    )  # fmt: skip
    p.add_argument(
        "--workflow-root", type=Path, default=Path("."),
        help="folder with the Snakefile, for the RO-Crate (default: the current folder)",
    )  # fmt: skip
    p.add_argument(
        "--server-metrics", nargs="*", default=[], type=Path, metavar="FILE",
        help="the model servers' SHARD.metrics.jsonl, for the performance section (missing "
        "ones are left out)",
    )  # fmt: skip
    p.add_argument(
        "--cohort", type=Path,
        help="the cohort object's folder (`agent integrate --outdir`), shown when it holds one",
    )  # fmt: skip
    p.add_argument(
        "--composition", type=Path, metavar="DIR",
        help="each sample's share of every label (`agent composition --outdir`), shown when it "
        "holds one",
    )  # fmt: skip
    p.add_argument(
        "--de", type=Path, metavar="DIR",
        help="differential expression per label (`agent de --outdir`), shown when it holds one",
    )  # fmt: skip
    p.add_argument(
        "--comparison", type=Path, metavar="DIR",
        help="what reprocessing changed (`agent compare --outdir`): copied into the report and "
        "linked when it holds one",
    )  # fmt: skip
    p.add_argument(
        "--eval", type=Path, metavar="FILE",
        help="the model's evaluation (`agent eval`'s eval.json, eval.html beside it): copied and "
        "linked with its score when it evaluated the samples' model (model id and revision)",
    )  # fmt: skip


def main(args: argparse.Namespace) -> int:
    if args.drift_mads <= 0 or args.drift_floor < 0:
        say.error(
            f"--drift-mads must be > 0 and --drift-floor >= 0 "
            f"(got {args.drift_mads}, {args.drift_floor})"
        )
        return 2
    missing = [str(p) for p in args.replays if not p.is_file()]
    if missing:
        say.note(f"replay files not found (shown as not replayed): {missing}")
    for flag, folder in (("--truth-dir", args.truth_dir), ("--workflow-root", args.workflow_root)):
        if folder is not None and not folder.is_dir():
            say.error(f"{flag} {folder} is not a folder")
            return 2
    if args.outdir.exists() and not args.outdir.is_dir():
        say.error(f"--outdir {args.outdir} is not a folder")
        return 2
    try:
        samples = build_report(
            args.world_states,
            [p for p in args.replays if p.is_file()],
            args.outdir,
            args.truth_dir,
            args.drift_mads,
            args.drift_floor,
            args.workflow_root,
            args.server_metrics,
            args.cohort,
            args.comparison,
            args.eval,
            args.composition,
            args.de,
        )
    except ValueError as e:
        say.error(str(e))
        return 2
    except OSError as e:  # e.g. an --outdir that cannot be written
        say.error(f"cannot write the report into {args.outdir}: {e}")
        return 1
    failed = [s.name for s in samples if s.failed]
    partial = [s.name for s in samples if s.status == "partial"]
    print(
        f"report of {len(samples)} samples ({len(failed)} failed{': ' + ', '.join(failed) if failed else ''}"
        f"{f'; {len(partial)} partial: ' + ', '.join(partial) if partial else ''})"
        f" in {args.outdir}/index.html, cohort.tsv and ro-crate/"
    )
    return 0
