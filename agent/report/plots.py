"""The cohort's figures, drawn with matplotlib and embedded in the page as base64 PNG.

Up to ``PER_SAMPLE_FIGURES`` samples the figures have a row per sample; a larger cohort gets
distributions instead (a figure with a row per sample is unreadable, and megabytes, at 1,000):
the sample pages and the sortable table of the index show each sample's numbers.
"""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display on cluster nodes; must precede pyplot
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from agent.record.collect import Sample
from agent.report.drift import Flag, numeric
from agent.report.performance import Shard
from agent.tool_declarations import DECLARED

KEPT, REMOVED, FAILED, FLAGGED, MEDIAN = "#2b6cb0", "#cbd5e0", "#c53030", "#dd6b20", "#718096"
PARTIAL = "#b7791f"  # amber: neither finished nor failed
# the filters' thresholds: QC parameters in the cohort figures
QC_TOOLS = tuple(
    name for name, declared in DECLARED.items() if declared.kind in ("cell_filter", "gene_filter")
)
# The report's look, applied only while its figures are drawn: a global change would also restyle
# the sample plots of any analysis run in the same process (and change their recorded bytes).
STYLE = {
    "font.size": 9,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.titlesize": 10,
    "axes.titleweight": "bold",
    "figure.dpi": 110,
    "svg.fonttype": "none",
}


# beside the axes, never over the bars and their labels (the saved figure's tight box keeps it)
LEGEND_OUTSIDE = {"loc": "upper left", "bbox_to_anchor": (1.01, 1.0), "frameon": False}
PER_SAMPLE_FIGURES = 40  # samples; above it, histograms
MANY_LINES = 40  # series per panel above which lines are drawn thin and without markers


@dataclass(frozen=True)
class Figure:
    title: str
    caption: str
    png: str  # base64


def encode(fig: plt.Figure) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", bbox_inches="tight")
    plt.close(fig)
    return base64.b64encode(buffer.getvalue()).decode()


def png_file(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def _height(n: int) -> float:
    return 1.2 + 0.32 * max(n, 3)


def _values(table: pd.DataFrame, col: str) -> np.ndarray:
    return pd.to_numeric(table[col], errors="coerce").to_numpy(dtype=float)


def _hist(ax: plt.Axes, x: np.ndarray, label: str, integer: bool = False) -> None:
    """A histogram of the finite values with the median dashed, or a note that there are none."""
    x = x[np.isfinite(x)]
    if not len(x):
        ax.text(0.5, 0.5, "no values", ha="center", va="center", transform=ax.transAxes)
        ax.set_xlabel(label)
        return
    if integer:
        bins = np.arange(np.floor(x.min()) - 0.5, np.ceil(x.max()) + 1.5)
    else:
        bins = min(40, max(10, len(x) // 10))
    ax.hist(x, bins=bins, color=KEPT)
    ax.axvline(float(np.median(x)), color=MEDIAN, ls="--", lw=1)
    ax.set_xlabel(label)
    ax.set_ylabel("samples")


def _status_colour(status: str) -> str:
    return PARTIAL if status == "partial" else FAILED


def _failed_note(table: pd.DataFrame) -> str:
    failed = int((~table["status"].isin(["finished", "partial"])).sum())
    return f" ({failed} failed samples not shown)" if failed else ""


def _two_histograms(
    table: pd.DataFrame, title: str, panels: list[tuple[str, str, str, bool]], note: str = ""
) -> Figure:
    """Two distributions over the cohort side by side; a panel: (column, x label, title, integer)."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.2))
    for ax, (column, label, panel_title, integer) in zip(axes, panels, strict=True):
        _hist(ax, _values(table, column), label, integer=integer)
        ax.set_title(panel_title)
    fig.tight_layout()
    return Figure(
        title,
        f"Distribution over the {len(table)} samples; dashed: median{_failed_note(table)}.{note}",
        encode(fig),
    )


def cells_kept_distribution(table: pd.DataFrame) -> Figure:
    return _two_histograms(
        table,
        "Cells kept per sample",
        [
            ("cells_kept_fraction", "fraction of loaded barcodes kept", "Cells kept", False),
            (
                "cells_after",
                "cells in the final object",
                "Cells after QC and doublet removal",
                False,
            ),
        ],
        " Each sample's numbers: the samples table (sortable) and its page.",
    )


def clusters_distribution(table: pd.DataFrame) -> Figure:
    return _two_histograms(
        table,
        "Clusters per sample",
        [
            ("clusters", "Leiden clusters in the final object", "Clusters per sample", True),
            (
                "ari",
                "adjusted Rand index against the planted types",
                "Agreement with the planted truth",
                False,
            ),
        ],
    )


def cells_kept(table: pd.DataFrame) -> Figure:
    if len(table) > PER_SAMPLE_FIGURES:
        return cells_kept_distribution(table)
    names = list(table["sample"])
    before, after = _values(table, "cells_before"), _values(table, "cells_after")
    fig, ax = plt.subplots(figsize=(7, _height(len(names))))
    y = np.arange(len(names))[::-1]
    ax.barh(y, np.nan_to_num(before), color=REMOVED, label="removed")
    ax.barh(y, np.nan_to_num(after), color=KEPT, label="kept")
    for yi, b, a, status in zip(y, before, after, table["status"], strict=True):
        if status != "finished":
            ax.text(
                max(np.nan_to_num(b), 0), yi, f"  {status}", va="center",
                color=_status_colour(status),
            )  # fmt: skip
        elif b > 0 and not np.isnan(a):
            ax.text(b, yi, f"  {a:.0f} of {b:.0f} ({a / b:.0%})", va="center")
    ax.set_yticks(y, names)
    ax.set_xlabel("cells (loaded, or called in an unfiltered matrix, and kept in the final object)")
    ax.set_xlim(0, np.nanmax(np.r_[before, 1]) * 1.35)
    ax.legend(**LEGEND_OUTSIDE)
    ax.set_title("Cells kept per sample")
    return Figure(
        "Cells kept per sample",
        "Cells in the sample (grey: loaded, or called by call_cells in an unfiltered droplet "
        "matrix) and cells left after QC and doublet removal (blue).",
        encode(fig),
    )


def qc_thresholds(table: pd.DataFrame, parameters: list[str], drift: list[Flag]) -> Figure | None:
    cols = [c for c in parameters if c.split(".")[0] in QC_TOOLS and numeric(table[c]) is not None]
    if not cols:
        return None
    flagged = {(f.sample, f.column) for f in drift}
    names = list(table["sample"])
    if len(names) > PER_SAMPLE_FIGURES:
        return qc_threshold_distributions(table, cols, drift)
    ncol = min(3, len(cols))
    nrow = -(-len(cols) // ncol)
    fig, axes = plt.subplots(
        nrow, ncol, figsize=(3.2 * ncol, 0.6 + nrow * (0.9 + 0.22 * len(names))), squeeze=False
    )
    y = np.arange(len(names))[::-1]
    for ax, col in zip(axes.flat, cols, strict=False):
        x = _values(table, col)
        colors = [FLAGGED if (s, col) in flagged else KEPT for s in names]
        ax.scatter(x, y, c=colors, s=28, zorder=3)
        if np.isfinite(x).any():
            ax.axvline(np.nanmedian(x), color=MEDIAN, ls="--", lw=1, zorder=1)
        ax.set_yticks(y, names)
        ax.set_title(col, fontsize=9)
        ax.grid(axis="x", color="#edf2f7")
    for ax in list(axes.flat)[len(cols) :]:
        ax.remove()
    fig.tight_layout()
    return Figure(
        "QC thresholds across the cohort",
        "Each threshold chosen per sample; dashed: cohort median; orange: drift flag.",
        encode(fig),
    )


def qc_threshold_distributions(table: pd.DataFrame, cols: list[str], drift: list[Flag]) -> Figure:
    ncol = min(3, len(cols))
    nrow = -(-len(cols) // ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(3.4 * ncol, 0.4 + 2.4 * nrow), squeeze=False)
    for ax, col in zip(axes.flat, cols, strict=False):
        _hist(ax, _values(table, col), "")
        n = sum(f.column == col for f in drift)
        ax.set_title(col + (f"  ({n} flagged)" if n else ""), fontsize=9)
    for ax in list(axes.flat)[len(cols) :]:
        ax.remove()
    fig.tight_layout()
    return Figure(
        "QC thresholds across the cohort",
        "Distribution of each threshold over the samples; dashed: cohort median; the flagged "
        "samples are listed under 'Samples to look at'.",
        encode(fig),
    )


def clusters(table: pd.DataFrame) -> Figure:
    if len(table) > PER_SAMPLE_FIGURES:
        return clusters_distribution(table)
    names = list(table["sample"])
    n, ari = _values(table, "clusters"), _values(table, "ari")
    planted = _values(table, "planted_types")
    fig, ax = plt.subplots(figsize=(7, _height(len(names))))
    y = np.arange(len(names))[::-1]
    ax.barh(y, np.nan_to_num(n), color=KEPT, label="clusters found")
    if np.isfinite(planted).any():
        ax.scatter(planted, y, marker="|", s=300, color=FAILED, zorder=3, label="planted types")
    for yi, k, a, status in zip(y, n, ari, table["status"], strict=True):
        if status != "finished":
            ax.text(0, yi, f"  {status}", va="center", color=_status_colour(status))
        elif not np.isnan(k):
            ax.text(
                k, yi, f"  {k:.0f}" + (f"  (ARI {a:.2f})" if not np.isnan(a) else ""), va="center"
            )
    ax.set_yticks(y, names)
    ax.set_xlabel("clusters")
    ax.set_xlim(0, np.nanmax(np.r_[n, planted, 1]) * 1.45)
    ax.legend(**LEGEND_OUTSIDE)
    ax.set_title("Clusters per sample")
    return Figure(
        "Clusters per sample",
        "Leiden clusters in the final object; where a truth table exists, the number of planted "
        "cell types and the adjusted Rand index of clusters against them.",
        encode(fig),
    )


def _per_iteration(samples: list[Sample], key: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    series = {}
    for s in samples:
        pairs = [(i + 1, r.get(key)) for i, r in enumerate(s.metrics)]
        pairs = [(i, v) for i, v in pairs if v is not None]
        if pairs:
            x, v = zip(*pairs, strict=True)
            series[s.name] = (np.asarray(x), np.asarray(v, dtype=float))
    return series


def _lines(ax: plt.Axes, series: dict[str, tuple[np.ndarray, np.ndarray]], empty: str) -> None:
    if not series:
        ax.text(0.5, 0.5, empty, ha="center", va="center", transform=ax.transAxes, color=MEDIAN)
        ax.axis("off")
        return
    many = len(series) > MANY_LINES
    for name, (x, v) in series.items():
        if many:  # one faint line per sample: the spread shows, no legend could
            ax.plot(x, v, lw=0.5, alpha=0.3, color=KEPT)
        else:
            ax.plot(x, v, lw=1.2, marker="o" if len(x) < 40 else None, ms=2.5, label=name)
    ax.set_xlabel("iteration")
    if len(series) <= 12:
        ax.legend(frameon=False, fontsize=7, ncol=2)


def iterations(samples: list[Sample]) -> Figure:
    no_model = "no model tokens: every run used\nthe reference or replay policy"
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.3))
    seconds = {}
    for s in samples:
        pairs = [
            (i + 1, (r.get("decide_seconds") or 0) + (r.get("tool_seconds") or 0))
            for i, r in enumerate(s.metrics)
        ]
        if pairs:
            x, v = zip(*pairs, strict=True)
            seconds[s.name] = (np.asarray(x), np.asarray(v, dtype=float))
    _lines(a, _per_iteration(samples, "prompt_tokens"), no_model)
    a.set_title("Prompt tokens per iteration")
    _lines(b, seconds, "no metrics recorded")
    b.set_title("Seconds per iteration (decide + tool)")
    if seconds:
        b.set_yscale("log")
    fig.tight_layout()
    return Figure(
        "Tokens and seconds per iteration",
        "Prompt tokens sent to the model, and wall time of each iteration (the policy's decision "
        "plus the tool calls).",
        encode(fig),
    )


def cached_ratio(samples: list[Sample]) -> Figure:
    series = {}
    for s in samples:
        pairs = [
            (i + 1, r["cached_tokens"] / r["prompt_tokens"])
            for i, r in enumerate(s.metrics)
            if r.get("prompt_tokens") and r.get("cached_tokens") is not None
        ]
        if pairs:
            x, v = zip(*pairs, strict=True)
            series[s.name] = (np.asarray(x), np.asarray(v, dtype=float))
    fig, ax = plt.subplots(figsize=(10, 3 if series else 1.2))
    _lines(ax, series, "no cached-token counts: no run talked to a model server")
    if series:
        ax.set_ylim(0, 1.05)
        ax.set_ylabel("cached / prompt tokens")
    ax.set_title("Cached-token ratio per iteration")
    return Figure(
        "Cached-token ratio per iteration",
        "Share of each prompt that the server's prefix cache served; the cache-aware prompt "
        "layout keeps it high.",
        encode(fig),
    )


def cohort_figures(
    table: pd.DataFrame, samples: list[Sample], parameters: list[str], drift: list[Flag]
) -> list[Figure]:
    with plt.rc_context(STYLE):
        figures = [
            cells_kept(table),
            qc_thresholds(table, parameters, drift),
            clusters(table),
            iterations(samples),
            cached_ratio(samples),
        ]
    return [f for f in figures if f is not None]


def server_over_run(shards: list[Shard]) -> Figure | None:
    """Each shard's server figures per sampling interval: where a layer stopped delivering."""
    if not shards:
        return None
    panels = (
        ("prefix_cache_hit_rate", "Prefix-cache hit rate", (0, 1.05)),
        ("spec_acceptance_rate", "MTP acceptance rate", (0, 1.05)),
        ("generation_tokens_per_s", "Generated tokens per second", None),
        ("kv_cache_usage", "KV-cache usage (at the sample)", (0, 1.05)),
    )
    with plt.rc_context(STYLE):
        fig, axes = plt.subplots(2, 2, figsize=(10, 5.6))
        for ax, (key, title, ylim) in zip(axes.flat, panels, strict=True):
            series = {}
            for s in shards:
                if any(p.get(key) is not None for p in s.series):  # gaps (None) break the line
                    x = np.asarray([p["minutes"] for p in s.series])
                    v = np.asarray([p.get(key) for p in s.series], dtype=float)
                    series[s.name] = (x, v)
            _lines(ax, series, "not measured (no request, or\nthe layer is off)")
            if series:
                ax.set_xlabel("minutes since the first sample")
                if ylim:
                    ax.set_ylim(*ylim)
            ax.set_title(title)
        fig.tight_layout()
        return Figure(
            "Model servers over the run",
            "Each shard's server, per sampling interval of its launcher: the share of prompt "
            "tokens its prefix cache served, the share of MTP draft tokens accepted, the tokens "
            "it generated per second (all its agents together) and its KV-cache usage.",
            encode(fig),
        )
