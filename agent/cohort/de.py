"""`python -m agent de`: differential expression between conditions per cell type, by pseudobulk
counts and PyDESeq2 (DESeq2's method in Python).

Reads the finished samples (records that pass the integrity check, as `agent integrate`'s inputs),
each cell's label (agent/cohort/labels.py: the cohort object's when it integrated them all, else
each sample's own obs['cell_type']) and the samples' conditions from the sheet. Per label, the
samples with at least ``--min-cells`` cells of it, at least ``--min-samples`` of them in each of
two or more conditions (agent/cohort/pseudobulk.py): their raw counts (layers['counts']) summed
per sample (the genes every sample kept), then PyDESeq2 with design ``~condition``: size factors
by median of ratios, parametric dispersion trend, Wald test of each condition against the
reference, Cooks outliers refitted, independent filtering, BH adjusted p-values at ``--alpha``.

Writes into OUTDIR: de.json (the record of the step: method and version, design, reference,
minimum cells per pseudobulk and samples per condition, per label the samples used with their
cells and conditions and the genes found, every label not tested with why, the samples left
out, the inputs by sha256), pseudobulk.h5ad (every pseudobulk: X the summed counts; obs sample,
label, condition, cells), tables/LABEL__CONDITION.tsv (PyDESeq2's results, every gene) and
plots/volcano_LABEL__CONDITION.png. Without a comparison (no condition column, too few samples)
de.json says why and nothing else is written.
"""

from __future__ import annotations

import argparse
import re
import shutil
from dataclasses import asdict
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from agent import say
from agent.cohort.integrate import InputRecord
from agent.record.layout import RECORD

if TYPE_CHECKING:  # numpy and pandas load in the functions: `--help` answers at once
    import pandas as pd

SUMMARY = "de.json"
PSEUDOBULK = "pseudobulk.h5ad"
TABLES = "tables"
PLOTS = "plots"
DESIGN = "~condition"
METHOD = (
    "pseudobulk (raw counts summed per sample and label) and PyDESeq2 {version}: DESeq2's "
    "negative binomial GLM, median-of-ratios size factors, parametric dispersion trend, Wald "
    "test, Cooks refit, independent filtering, BH adjustment"
)
SHOWN_GENES = 10  # per comparison in the report and the volcano's names
# DESeq2 vignette's pre-filter: a gene is tested where at least the smallest condition's number
# of pseudobulks hold MIN_COUNT counts of it (the others cannot reach significance, and each
# gene costs PyDESeq2 milliseconds of per-gene optimisation)
MIN_COUNT = 10
RESULT_COLUMNS = ("baseMean", "log2FoldChange", "lfcSE", "stat", "pvalue", "padj")


def file_stem(label: str, level: str, taken: set[str]) -> str:
    """A file name for one comparison: safe characters, unique among those ``taken``."""
    base = re.sub(r"[^A-Za-z0-9_-]+", "_", f"{label}__{level}").strip("_") or "label"
    stem, k = base, 1
    while stem.lower() in taken:  # case-insensitive file systems too
        k += 1
        stem = f"{base}-{k}"
    taken.add(stem.lower())
    return stem


def expressed(counts: pd.DataFrame, conditions: pd.Series) -> pd.Series:
    """The genes (columns of ``counts``, samples x genes) the pre-filter keeps: MIN_COUNT
    counts in at least as many pseudobulks as the smallest condition has."""
    smallest = int(conditions.value_counts().min())
    return (counts >= MIN_COUNT).sum() >= smallest


def deseq2(
    counts: pd.DataFrame, conditions: pd.Series, reference: str, alpha: float, threads: int
) -> tuple[dict[str, pd.DataFrame], list[str]]:
    """PyDESeq2 on ``counts`` (samples x genes) with design ~condition: each other condition
    against ``reference`` -> its results (one row per gene, RESULT_COLUMNS); and PyDESeq2's
    warnings (e.g. too few residual degrees of freedom for its dispersion prior), which the
    summary keeps as the evidence's caveats instead of printing them."""
    import warnings

    import pandas as pd
    from pydeseq2.dds import DeseqDataSet
    from pydeseq2.default_inference import DefaultInference
    from pydeseq2.ds import DeseqStats

    inference = DefaultInference(n_cpus=threads)
    metadata_ = pd.DataFrame({"condition": conditions.astype(str)}, index=counts.index)
    out = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dds = DeseqDataSet(
            counts=counts, metadata=metadata_, design=DESIGN, refit_cooks=True,
            inference=inference, quiet=True,
        )  # fmt: skip
        dds.deseq2()
        for level in dict.fromkeys(conditions):
            if level == reference:
                continue
            stats = DeseqStats(
                dds, contrast=["condition", level, reference], alpha=alpha, inference=inference,
                quiet=True,
            )  # fmt: skip
            stats.summary()
            out[level] = stats.results_df.loc[:, list(RESULT_COLUMNS)]
    said = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    return out, list(dict.fromkeys(said))


def volcano(result: pd.DataFrame, alpha: float, title: str, path: Path) -> None:
    """log2 fold change against -log10 adjusted p; genes at padj < alpha coloured, the
    SHOWN_GENES most significant named."""
    import matplotlib
    import numpy as np

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = result.dropna(subset=["padj"])
    y = -np.log10(shown["padj"].clip(lower=1e-300))
    hit = (shown["padj"] < alpha).to_numpy()
    fig, ax = plt.subplots(figsize=(5, 4))
    ax.scatter(shown["log2FoldChange"][~hit], y[~hit], s=4, c="#bbbbbb", lw=0)
    ax.scatter(shown["log2FoldChange"][hit], y[hit], s=6, c="#c0392b", lw=0)
    for gene in shown.index[hit][np.argsort(-y[hit].to_numpy())][:SHOWN_GENES]:
        ax.annotate(gene, (shown.at[gene, "log2FoldChange"], y[gene]), fontsize=7)
    ax.axhline(-np.log10(alpha), color="black", lw=0.5, ls="--")
    ax.set_xlabel("log2 fold change")
    ax.set_ylabel("-log10 adjusted p")
    ax.set_title(title, fontsize=9)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


def write_pseudobulk(bulk: pd.DataFrame, obs: pd.DataFrame, path: Path) -> None:
    import anndata as ad
    import numpy as np
    import pandas as pd
    from scipy import sparse

    from agent.record.durable import atomic_write_h5ad

    adata = ad.AnnData(
        sparse.csr_matrix(bulk.to_numpy(dtype=np.float32)),
        obs=obs.loc[bulk.index].astype({"cells": int}),
        var=pd.DataFrame(index=bulk.columns.astype(str)),
    )
    atomic_write_h5ad(adata, path)


def _entry(
    plan: Any, level: str, result: pd.DataFrame, alpha: float, table: str, plot: str
) -> dict[str, Any]:
    """One comparison in de.json: its samples and cells, the genes found, its files."""

    hits = result[result["padj"] < alpha]
    top = [
        {"gene": str(g), "log2FoldChange": round(float(r["log2FoldChange"]), 4),
         "padj": float(r["padj"])}
        for g, r in hits.head(SHOWN_GENES).iterrows()
    ]  # fmt: skip
    return {
        "label": plan.label,
        "condition": level,
        "reference": plan.design.reference,
        "samples": {
            s: {"condition": c, "cells": plan.cells[s]} for s, c in plan.design.samples.items()
        },
        "below_min_cells": plan.too_few,
        "genes_tested": len(result),
        "significant": len(hits),
        "up": int((hits["log2FoldChange"] > 0).sum()),
        "down": int((hits["log2FoldChange"] < 0).sum()),
        "top": top,
        "table": table,
        "plot": plot,
    }


def differential_expression(
    records: list[InputRecord], outdir: Path, sheet: dict[str, dict[str, str]],
    column: str | None = "condition", reference: str | None = None, min_cells: int = 10,
    min_samples: int = 2, alpha: float = 0.05, threads: int = 1, cohort_dir: Path | None = None,
    left_out: dict[str, str] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Pseudobulk and PyDESeq2 per label; writes the files named above; returns the summary.
    ``records``: the finished samples (integrate.finished_inputs), ``left_out`` those it left
    out and why; ``sheet``: the sheet's cells per sample (samplesheet.sample_cells)."""
    import pandas as pd

    from agent.cohort.conditions import design
    from agent.cohort.labels import read_cells
    from agent.cohort.pseudobulk import plan_labels
    from agent.record.durable import atomic_write, atomic_write_json

    found = read_cells(records, cohort_dir)
    left_out = {**(left_out or {}), **found.left_out}
    counts = found.counts()
    overall = design(list(counts.index), sheet, column, min_samples, reference)
    summary: dict[str, Any] = {
        "method": None,
        "design": DESIGN,
        "condition_column": column or None,
        "reference": overall.reference,
        "levels": overall.levels,
        "min_cells": min_cells,
        "min_samples": min_samples,
        "gene_filter": f"at least {MIN_COUNT} counts in as many pseudobulks as the smallest "
        "condition has (DESeq2 vignette)",
        "alpha": alpha,
        "labels_from": found.source,
        "statement": overall.statement,
        "samples": overall.samples,
        "left_out": {**left_out, **overall.left_out},
        "tested": [],
        "not_tested": {},
        "inputs": [asdict(r) for r in found.records],
    }
    outdir.mkdir(parents=True, exist_ok=True)
    for stale in (TABLES, PLOTS):  # an earlier run's comparisons: this summary names its own
        shutil.rmtree(outdir / stale, ignore_errors=True)
    (outdir / PSEUDOBULK).unlink(missing_ok=True)
    if not overall.testable:
        atomic_write_json(outdir / SUMMARY, summary)
        return summary
    plans = plan_labels(counts, sheet, column, min_cells, min_samples, reference, overall)
    tested = [p for p in plans if p.tested]
    summary["not_tested"] = {p.label: p.why_not(min_cells) for p in plans if not p.tested}
    pairs = [(s, p.label) for p in tested for s in p.design.samples]
    bulk = found.pseudobulk(pairs)
    obs = pd.DataFrame(
        [{"sample": s, "label": p.label, "condition": p.design.samples[s], "cells": p.cells[s]}
         for p in tested for s in p.design.samples],
        index=[f"{s}|{p.label}" for p in tested for s in p.design.samples],
    )  # fmt: skip
    if pairs:
        write_pseudobulk(bulk, obs, outdir / PSEUDOBULK)
    summary["method"] = METHOD.format(version=metadata.version("pydeseq2"))
    summary["library"] = {"pydeseq2": metadata.version("pydeseq2")}
    summary["pseudobulk"] = PSEUDOBULK if pairs else None
    taken: set[str] = set()
    for plan in tested:
        rows = [f"{s}|{plan.label}" for s in plan.design.samples]
        label_counts = bulk.loc[rows]
        label_counts.index = list(plan.design.samples)
        conditions = pd.Series(plan.design.samples)
        label_counts = label_counts.loc[:, expressed(label_counts, conditions)]
        results, caveats = deseq2(label_counts, conditions, plan.design.reference, alpha, threads)
        for level, result in results.items():
            stem = file_stem(plan.label, level, taken)
            table, plot = f"{TABLES}/{stem}.tsv", f"{PLOTS}/volcano_{stem}.png"
            (outdir / TABLES).mkdir(exist_ok=True)
            ordered = result.sort_values("pvalue", kind="stable")
            atomic_write(outdir / table, ordered.to_csv(sep="\t", index_label="gene").encode())
            title = f"{plan.label}: {level} vs {plan.design.reference}"
            volcano(result, alpha, title, outdir / plot)
            entry = _entry(plan, level, ordered, alpha, table, plot)
            summary["tested"].append({**entry, "caveats": caveats})
    atomic_write_json(outdir / SUMMARY, summary)
    return summary


def read_summary(folder: Path) -> dict[str, Any] | None:
    path = folder / SUMMARY
    return orjson.loads(path.read_bytes()) if path.is_file() else None


def report_view(folder: Path) -> dict[str, Any] | None:
    """What the cohort report shows: the method and design, per comparison its samples, genes
    found and top genes with its volcano (base64 PNG), the labels not tested with why; None
    without a summary."""
    import base64

    summary = read_summary(folder)
    if summary is None:
        return None
    comparisons = []
    for t in summary["tested"]:
        plot = folder / t["plot"]
        comparisons.append(
            {
                **t,
                "volcano": base64.b64encode(plot.read_bytes()).decode() if plot.is_file() else None,
                "report_table": f"{REPORT_FOLDER}/{Path(t['table']).name}",
            }
        )
    return {
        "statement": summary["statement"],
        "method": summary["method"],
        "design": f"{summary['design']} ({summary['condition_column']}), reference "
        f"{summary['reference']}, at least {summary['min_cells']} cells per pseudobulk and "
        f"{summary['min_samples']} samples per condition, adjusted p < {summary['alpha']}",
        "alpha": summary["alpha"],
        "comparisons": comparisons,
        "not_tested": summary["not_tested"],
        "left_out": summary["left_out"],
    }


REPORT_FOLDER = "de"  # the report's copies of the tables: OUTDIR/de/STEM.tsv


def copy_into_report(folder: Path | None, outdir: Path) -> list[Path]:
    """Every comparison's table copied into the report folder's de/ (the index links them; a
    report folder is shipped alone); an earlier report's copies go first."""
    from agent.record.durable import publish

    target = outdir / REPORT_FOLDER
    shutil.rmtree(target, ignore_errors=True)
    summary = read_summary(folder) if folder is not None else None
    copies = []
    for t in (summary or {}).get("tested", []):
        source = folder / t["table"]
        if source.is_file():
            target.mkdir(exist_ok=True)
            publish(target / source.name, source.read_bytes())
            copies.append(target / source.name)
    return copies


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--world-states", nargs="+", required=True, type=Path, metavar="FILE",
        help=f"the samples' {RECORD} files; those of unfinished analyses are left out",
    )  # fmt: skip
    p.add_argument("--outdir", type=Path, default=Path("results/cohort/de"))
    p.add_argument("--samples", type=Path, required=True, help="sample sheet with the conditions")
    p.add_argument("--condition", default="condition", metavar="COLUMN",
                   help="sheet column of each sample's condition")  # fmt: skip
    p.add_argument("--reference", help="condition the others are compared with (default: the "
                   "first in sheet order)")  # fmt: skip
    p.add_argument("--min-cells", type=int, default=10, help="cells of a label per pseudobulk")
    p.add_argument("--min-samples", type=int, default=2, help="samples per condition")
    p.add_argument("--alpha", type=float, default=0.05, help="adjusted p-value cut-off")
    p.add_argument("--threads", type=int, default=1, help="PyDESeq2's processes")
    p.add_argument(
        "--cohort", type=Path, metavar="DIR",
        help="the cohort object's folder (`agent integrate --outdir`): its labels and counts, "
        "when it integrated every sample given",
    )  # fmt: skip


def main(args: argparse.Namespace) -> int:
    from agent.cohort.integrate import command_inputs, finished_inputs

    bounds = (("--min-cells", args.min_cells, 1), ("--min-samples", args.min_samples, 2),
              ("--threads", args.threads, 1))  # fmt: skip
    for flag, value, low in bounds:
        if value < low:
            say.error(f"{flag} {value}: expected at least {low}")
            return 2
    if not 0 < args.alpha < 1:
        say.error(f"--alpha {args.alpha}: expected between 0 and 1")
        return 2
    sheet = command_inputs(args.world_states, args.samples)
    if sheet is None:
        return 2
    try:
        records, left_out = finished_inputs(args.world_states)
        summary = differential_expression(
            records, args.outdir, sheet, args.condition, args.reference, args.min_cells,
            args.min_samples, args.alpha, args.threads, args.cohort, left_out,
        )  # fmt: skip
    except OSError as e:  # a fault of the machine (I/O error, full disk): a rerun may pass
        say.error(f"the differential expression: {e}")
        return 1
    for sample, why in summary["left_out"].items():
        say.note(f"{sample} left out: {why}")
    if summary["statement"]:
        say.note(f"no test: {summary['statement']}; wrote {args.outdir / SUMMARY}")
        return 0
    for label, why in summary["not_tested"].items():
        say.note(f"{label} not tested: {why}")
    found = ", ".join(
        f"{t['label']} {t['condition']}: {t['significant']}" for t in summary["tested"]
    )
    print(
        f"differential expression of {len(summary['tested'])} comparison(s) (genes at adjusted p "
        f"< {args.alpha}: {found or 'none tested'}); {args.outdir / SUMMARY}"
    )
    return 0
