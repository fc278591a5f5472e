"""`python -m agent composition`: each sample's share of every label, and, with conditions, a test of
which labels' shares differ between them.

Reads the finished samples (their records pass the integrity check, as `agent integrate`'s
inputs) and each cell's label (agent/cohort/labels.py: the cohort object's when it integrated
them all, else each sample's own obs['cell_type']). Writes into OUTDIR:

- composition.tsv: one row per sample and label: the sample's sheet condition and group, cells,
  share of the sample's cells;
- composition.png: the shares as stacked bars, samples grouped by a sheet column (``--group-by``,
  default the condition column);
- composition.json: the method, its parameters, the design (samples per condition, reference),
  the test per label, every sample left out and why, the inputs by sha256.

The test (with a condition column and at least ``--min-samples`` samples in each of two or more
conditions) is propeller's (Phipson et al. 2022, speckle): the logit of each sample's proportions
(pseudo-count 0.5 per label) fitted per label by limma's linear model, moderated t for two
conditions (the others against the reference) or moderated F across more, BH false discovery
rate over labels; agent/cohort/moderated.py holds limma's statistics. The proportions' means per
condition and their ratio to the reference come from the untransformed proportions, as
propeller reports them. Without a test, composition.json says why (`statement`).
"""

from __future__ import annotations

import argparse
from dataclasses import asdict
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from agent import say
from agent.cohort.conditions import Design, design
from agent.cohort.integrate import InputRecord
from agent.record.layout import RECORD

if TYPE_CHECKING:  # numpy and pandas load in the functions: `--help` answers at once
    import pandas as pd

SUMMARY = "composition.json"
TABLE = "composition.tsv"
PLOT = "composition.png"
PSEUDO_COUNT = 0.5  # speckle's getTransformedProps: logit of (cells + 0.5) / (total + 0.5 labels)
METHOD = (
    "propeller (Phipson et al. 2022): logit-transformed proportions (pseudo-count 0.5), limma "
    "linear model per label with moderated {stat} (eBayes, robust = FALSE), BH FDR over labels"
)
FDR = 0.05  # what the report and the summary call a difference
MAX_NAMED_BARS = 60  # the figure names each sample's bar up to this many samples
NO_VALUE = "no value"  # the figure's group of samples without a value in the grouping column


def logit_proportions(counts: pd.DataFrame) -> pd.DataFrame:
    """speckle's logit transform: log(p / (1 - p)) of (cells + 0.5) / (sample total + 0.5 x
    labels)."""
    import numpy as np

    pseudo = counts + PSEUDO_COUNT
    p = pseudo.div(pseudo.sum(axis=1), axis=0)
    return np.log(p / (1 - p))


def propeller(counts: pd.DataFrame, plan: Design) -> pd.DataFrame:
    """The test of every label (rows of the result, most significant first): the mean share per
    condition, the ratio of each other condition's mean to the reference's, the moderated
    statistic, its p-value and the BH FDR."""
    import numpy as np
    import pandas as pd
    from scipy.stats import false_discovery_control

    from agent.cohort.moderated import moderated_test

    used = counts.loc[list(plan.samples)]
    used = used.loc[:, used.sum() > 0]  # labels only samples left out hold: not among these cells
    condition = pd.Series(plan.samples)[used.index]
    # intercept (the reference) and one indicator per other condition, as treatment coding
    design_matrix = np.column_stack(
        [np.ones(len(used))] + [(condition == level).to_numpy(float) for level in plan.levels[1:]]
    )
    tested = list(range(1, len(plan.levels)))
    fit = moderated_test(logit_proportions(used).to_numpy(), design_matrix, tested)
    shares = used.div(used.sum(axis=1), axis=0)
    out = pd.DataFrame(index=used.columns)
    out.index.name = "label"
    for level in plan.levels:
        out[f"mean_share_{level}"] = shares[(condition == level).to_numpy()].mean().round(5)
    for level in plan.levels[1:]:
        out[f"ratio_{level}"] = (
            out[f"mean_share_{level}"] / out[f"mean_share_{plan.reference}"]
        ).round(4)
    out["t" if len(tested) == 1 else "F"] = np.round(fit.statistic, 4)
    out["p_value"] = fit.p_value
    out["fdr"] = false_discovery_control(fit.p_value, method="bh")
    return out.sort_values("p_value", kind="stable")


def long_table(counts: pd.DataFrame, cells: dict[str, dict[str, str]], plan: Design,
               group_by: str | None) -> pd.DataFrame:  # fmt: skip
    """One row per sample and label: condition, group, cells and share."""
    import pandas as pd

    shares = counts.div(counts.sum(axis=1), axis=0)
    rows = [
        {
            "sample": sample,
            "condition": cells.get(sample, {}).get(plan.column) if plan.column else None,
            "group": cells.get(sample, {}).get(group_by) if group_by else None,
            "label": label,
            "cells": int(counts.at[sample, label]),
            "share": round(float(shares.at[sample, label]), 5),
        }
        for sample in counts.index
        for label in counts.columns
    ]
    table = pd.DataFrame(rows)
    return table.drop(columns=[c for c in ("condition", "group") if table[c].isna().all()])


def draw(counts: pd.DataFrame, groups: dict[str, str], path: Path, title: str) -> None:
    """Stacked bars of each sample's shares, samples ordered by group (sheet order within)."""
    import matplotlib
    import numpy as np

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # groups in the order they first appear (samples without a value last), samples in order
    first = {g: k for k, g in reversed(list(enumerate(groups.get(s) for s in counts.index)))}
    first[NO_VALUE] = len(counts.index)
    order = sorted(counts.index, key=lambda s: first.get(groups.get(s, ""), 0))
    shares = counts.loc[order].div(counts.loc[order].sum(axis=1), axis=0)
    width = min(16.0, 3 + 0.35 * len(order))
    fig, ax = plt.subplots(figsize=(width, 4.5))
    colours = plt.get_cmap("tab20")(np.arange(shares.shape[1]) % 20)
    bottom = np.zeros(len(order))
    x = np.arange(len(order))
    for k, label in enumerate(shares.columns):
        ax.bar(x, shares[label], bottom=bottom, width=0.85, color=colours[k], label=label)
        bottom += shares[label].to_numpy()
    named = len(order) <= MAX_NAMED_BARS
    ax.set_xticks(x if named else [])
    if named:
        ax.set_xticklabels(order, rotation=90, fontsize=8)
    edges = [i for i in range(1, len(order)) if groups.get(order[i]) != groups.get(order[i - 1])]
    for i in edges:
        ax.axvline(i - 0.5, color="black", lw=1)
    if groups:
        starts = [0, *edges]
        for a, b in zip(starts, [*edges, len(order)], strict=True):
            ax.text((a + b - 1) / 2, 1.02, groups.get(order[a], NO_VALUE), ha="center",
                    va="bottom", fontsize=9, transform=ax.get_xaxis_transform())  # fmt: skip
    ax.set_ylim(0, 1)
    ax.set_ylabel("share of the sample's cells")
    ax.set_title(title, pad=18 if groups else 6)
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8, frameon=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


def compose(
    records: list[InputRecord], outdir: Path, cells: dict[str, dict[str, str]],
    column: str | None = "condition", group_by: str | None = None, reference: str | None = None,
    min_samples: int = 2, cohort_dir: Path | None = None, left_out: dict[str, str] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Write composition.tsv, composition.png and composition.json into ``outdir``; returns the
    summary. ``records``: the finished samples (integrate.finished_inputs), ``left_out`` those
    it left out and why; ``cells``: the sheet's cells per sample (samplesheet.sample_cells)."""
    from agent.cohort.labels import read_cells
    from agent.record.durable import atomic_write, atomic_write_json

    found = read_cells(records, cohort_dir)
    left_out = {**(left_out or {}), **found.left_out}
    counts = found.counts()
    plan = design(list(counts.index), cells, column, min_samples, reference, {})
    group_by = group_by or (column if plan.column and plan.samples else None)
    summary: dict[str, Any] = {
        "labels_from": found.source,
        "parameters": {
            "condition_column": column or None,
            "group_by": group_by,
            "reference": reference,
            "min_samples": min_samples,
            "pseudo_count": PSEUDO_COUNT,
            "fdr": FDR,
        },
        "samples": list(counts.index),
        "cells": {s: int(n) for s, n in counts.sum(axis=1).items()},
        "left_out": left_out,
        "design": plan.to_json(),
        "method": None,
        "statement": plan.statement,
        "test": None,
        "inputs": [asdict(r) for r in found.records],
        "table": TABLE,
        "plot": PLOT,
    }
    outdir.mkdir(parents=True, exist_ok=True)
    if counts.empty:
        summary["statement"] = "no finished sample with labels: no composition"
        summary["table"] = summary["plot"] = None
        for stale in (TABLE, PLOT):  # an earlier run's: this summary names none
            (outdir / stale).unlink(missing_ok=True)
    else:
        table = long_table(counts, cells, plan, group_by)
        atomic_write(outdir / TABLE, table.to_csv(sep="\t", index=False).encode())
        groups = {s: cells.get(s, {}).get(group_by, NO_VALUE) for s in counts.index}
        draw(counts, groups if group_by else {}, outdir / PLOT,
             f"cell-type composition of {len(counts)} samples")  # fmt: skip
    if plan.testable and not counts.empty:
        test = propeller(counts, plan)
        stat = "t" if len(plan.levels) == 2 else "F"
        summary["method"] = METHOD.format(stat=stat)
        summary["library"] = {"scipy": metadata.version("scipy")}
        summary["test"] = [
            {"label": label, **{k: _plain(v) for k, v in row.items()}}
            for label, row in test.iterrows()
        ]
    atomic_write_json(outdir / SUMMARY, summary)
    return summary


def _plain(value: Any) -> Any:
    """A JSON number for a numpy one; None for NaN."""
    import numpy as np

    value = float(value)
    return None if np.isnan(value) else value


def read_summary(folder: Path) -> dict[str, Any] | None:
    path = folder / SUMMARY
    return orjson.loads(path.read_bytes()) if path.is_file() else None


def report_view(folder: Path) -> dict[str, Any] | None:
    """What the cohort report shows: the figure (base64 PNG), the test's rows (labels with FDR
    below FDR first), the method, the design and the samples left out; None without a summary."""
    import base64

    summary = read_summary(folder)
    if summary is None:
        return None
    plot = folder / summary["plot"] if summary.get("plot") else None
    test = summary.get("test") or []
    columns = [k for k in (test[0] if test else {}) if k != "label"]
    return {
        "n_samples": len(summary["samples"]),
        "labels_from": summary["labels_from"]["labels"],
        "figure": base64.b64encode(plot.read_bytes()).decode() if plot and plot.is_file() else None,
        "method": summary.get("method"),
        "statement": summary.get("statement"),
        "design": summary["design"],
        "columns": columns,
        "rows": [(r["label"], [r[c] for c in columns], (r.get("fdr") or 1) < FDR) for r in test],
        "fdr": FDR,
        "left_out": {**summary["left_out"], **summary["design"]["left_out"]},
        "table": summary.get("table"),
    }


def copy_into_report(folder: Path | None, outdir: Path) -> list[Path]:
    """composition.tsv copied beside the report's cohort.tsv (the index links it; a report
    folder is shipped alone); [] and no copy when ``folder`` holds none."""
    from agent.record.durable import publish

    source = folder / TABLE if folder is not None else None
    if source is None or not source.is_file():
        (outdir / TABLE).unlink(missing_ok=True)  # an earlier report's copy: another run's
        return []
    publish(outdir / TABLE, source.read_bytes())
    return [outdir / TABLE]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--world-states", nargs="+", required=True, type=Path, metavar="FILE",
        help=f"the samples' {RECORD} files; those of unfinished analyses are left out",
    )  # fmt: skip
    p.add_argument("--outdir", type=Path, default=Path("results/cohort/composition"))
    p.add_argument("--samples", type=Path, help="sample sheet holding the conditions and groups")
    p.add_argument(
        "--condition", default="condition", metavar="COLUMN",
        help="sheet column of each sample's condition ('' = no test)",
    )  # fmt: skip
    p.add_argument("--group-by", metavar="COLUMN", help="sheet column grouping the figure's bars")
    p.add_argument("--reference", help="condition the others are compared with (default: the "
                   "first in sheet order)")  # fmt: skip
    p.add_argument("--min-samples", type=int, default=2, help="samples per condition for a test")
    p.add_argument(
        "--cohort", type=Path, metavar="DIR",
        help="the cohort object's folder (`agent integrate --outdir`): its labels, when it "
        "integrated every sample given",
    )  # fmt: skip


def main(args: argparse.Namespace) -> int:
    from agent.cohort.integrate import command_inputs, finished_inputs

    if args.min_samples < 2:
        say.error(
            f"--min-samples {args.min_samples}: expected at least 2 (a variance per condition)"
        )
        return 2
    cells = command_inputs(args.world_states, args.samples)
    if cells is None:
        return 2
    if args.group_by and not any(args.group_by in c for c in cells.values()):
        say.error(f"--group-by {args.group_by}: no sample of {args.samples} has a value there")
        return 2
    try:
        records, left_out = finished_inputs(args.world_states)
        summary = compose(
            records, args.outdir, cells, args.condition or None, args.group_by, args.reference,
            args.min_samples, args.cohort, left_out,
        )  # fmt: skip
    except OSError as e:  # a fault of the machine (I/O error, full disk): a rerun may pass
        say.error(f"the composition: {e}")
        return 1
    for sample, why in {**summary["left_out"], **summary["design"]["left_out"]}.items():
        say.note(f"{sample} left out: {why}")
    found = [t["label"] for t in summary["test"] or [] if (t["fdr"] or 1) < FDR]
    tested = (
        f"{summary['method'].split(':')[0]}: {len(found)} label(s) at FDR < {FDR}"
        f"{' (' + ', '.join(found) + ')' if found else ''}"
        if summary["method"]
        else f"no test: {summary['statement']}"
    )
    print(f"composition of {len(summary['samples'])} samples; {tested}; {args.outdir / SUMMARY}")
    return 0
