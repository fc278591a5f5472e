"""``build_report``: the cohort report (agent/report/__init__.py says what it writes) from the
samples' world states and replays; each page and table is written by its own module."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from agent.record.durable import publish
from agent.report.drift import FLOOR, THRESHOLD, Flag
from agent.say import Progress

if TYPE_CHECKING:
    from agent.record.collect import Sample


SAMPLE_PAGES = "samples"  # OUTDIR/samples/NAME.html, one page per sample


def _flags_text(flags: list[Flag], sample: str) -> str | None:
    return "; ".join(str(f) for f in flags if f.sample == sample) or None


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
    from agent.record.collect import load_sample, match_replays
    from agent.report import evaluation as model_eval
    from agent.report import performance
    from agent.report.cohort import build_table, parameter_columns
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
