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
import time
from pathlib import Path
from typing import TYPE_CHECKING

import orjson

from agent import say
from agent.durable import atomic_write
from agent.layout import RECORD, REPLAY
from agent.report.drift import FLOOR, THRESHOLD, Flag

if TYPE_CHECKING:
    from agent.report.collect import Sample


SAMPLE_PAGES = "samples"  # OUTDIR/samples/NAME.html, one page per sample


def match_replays(world_states: list[Path], replays: list[Path]) -> dict[Path, Path]:
    """world state -> its replay: the one in the same folder, else the one naming it."""
    by_folder = {p.parent.resolve(): p for p in replays}
    by_source: dict[Path, Path] = {}
    for p in replays:
        if p.parent.resolve() in {w.parent.resolve() for w in world_states}:
            continue
        try:
            source = orjson.loads(p.read_bytes()).get("world_state")
        except (OSError, orjson.JSONDecodeError, AttributeError):
            continue
        if source:
            by_source[Path(source).resolve()] = p
    matched = {}
    for w in world_states:
        found = by_folder.get(w.parent.resolve()) or by_source.get(w.resolve())
        if found is not None:
            matched[w] = found
    return matched


def publish(path: Path, data: bytes) -> None:
    """Write atomically, readable by all: a report is for people other than its writer."""
    atomic_write(path, data)
    path.chmod(0o644)


def _flags_text(flags: list[Flag], sample: str) -> str | None:
    return "; ".join(str(f) for f in flags if f.sample == sample) or None


class Progress:
    """One line on stderr per stage with the seconds since the start: a cohort of hundreds takes
    tens of seconds, and a silent job looks hung."""

    def __init__(self) -> None:
        self.start = time.monotonic()

    def __call__(self, what: str) -> None:
        say.note(f"{what} ({time.monotonic() - self.start:.1f} s)")


def build_report(
    world_states: list[Path],
    replays: list[Path],
    outdir: Path,
    truth_dir: Path | None = None,
    threshold: float = THRESHOLD,
    floor: float = FLOOR,
    workflow_root: Path = Path("."),
    server_metrics: list[Path] | None = None,
    cohort_dir: Path | None = None,
    comparison_dir: Path | None = None,
    evaluation: Path | None = None,
    composition_dir: Path | None = None,
    de_dir: Path | None = None,
) -> list[Sample]:
    """Write cohort.tsv, index.html, samples/ and ro-crate/ into ``outdir``; returns the samples."""
    from agent.cohort import composition as composition_step
    from agent.cohort import de as de_step
    from agent.cohort.compare import HTML, copy_into_report
    from agent.cohort.integrate import report_view
    from agent.report import evaluation as model_eval
    from agent.report import performance
    from agent.report.cohort import build_table, parameter_columns
    from agent.report.collect import load_sample
    from agent.report.crate import write_crate
    from agent.report.drift import flag_cohort
    from agent.report.html import context, render_index, render_samples
    from agent.report.plots import cohort_figures, server_over_run

    progress = Progress()
    replay_of = match_replays(world_states, replays)
    samples = [load_sample(w, replay_of.get(w), truth_dir) for w in world_states]
    progress(f"read {len(samples)} samples")
    seen: dict[str, Path] = {}
    for s in samples:
        if s.name in seen:
            raise ValueError(
                f"sample name {s.name!r} appears twice: {seen[s.name]} and {s.world_state}"
            )
        seen[s.name] = s.world_state
    table = build_table(samples)
    parameters = parameter_columns(table)
    drift, outliers = flag_cohort(table, parameters, threshold, floor)
    table["drift"] = [_flags_text(drift, s) for s in table["sample"]]
    table["outliers"] = [_flags_text(outliers, s) for s in table["sample"]]
    outdir.mkdir(parents=True, exist_ok=True)
    publish(outdir / "cohort.tsv", table.to_csv(sep="\t", index=False).encode())
    ctx = context(table, samples, parameters, drift, outliers)
    pages = outdir / SAMPLE_PAGES
    pages.mkdir(exist_ok=True)
    current = set(ctx.pages.values())
    for old in pages.glob("*.html"):  # pages of samples no longer in the cohort
        if old.name not in current:
            old.unlink()
    for name, page in render_samples(ctx, samples):
        publish(pages / name, page.encode())
    progress(f"wrote cohort.tsv and {len(samples)} sample pages")
    figures = cohort_figures(table, samples, parameters, drift)
    perf = performance.build(samples, server_metrics or [])
    perf_view = {**performance.view(perf), "figure": server_over_run(perf.shards)}
    cohort = report_view(cohort_dir) if cohort_dir is not None else None  # agent integrate's
    comparison = copy_into_report(comparison_dir, outdir)  # agent compare's, when there is one
    evaluated = model_eval.include(evaluation, samples, outdir)  # agent eval's, when given
    # agent composition's and agent de's: their tables copied, their views in the index
    steps = composition_step.copy_into_report(composition_dir, outdir)
    steps += de_step.copy_into_report(de_dir, outdir)
    index = render_index(
        ctx, samples, figures, threshold, floor, perf_view, cohort=cohort,
        comparison=HTML if comparison else None, evaluation=model_eval.view(evaluated),
        composition=composition_step.report_view(composition_dir) if composition_dir else None,
        de=de_step.report_view(de_dir) if de_dir else None,
    )  # fmt: skip
    publish(outdir / "index.html", index.encode())
    progress("drew the figures and wrote index.html")
    write_crate(
        outdir, samples, [outdir / "cohort.tsv", outdir / "index.html"], workflow_root, pages,
        cohort_dir=cohort_dir, comparison=comparison, evaluation=evaluated,
        composition_dir=composition_dir, de_dir=de_dir,
    )  # fmt: skip
    progress("wrote the RO-Crate")
    return samples


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
