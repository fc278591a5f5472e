"""Figures to PNG in the sample's plots/ folder: QC violins, UMAP, marker dot plot, PCA variance."""

from __future__ import annotations

from typing import Any, Literal

import matplotlib
import numpy as np

matplotlib.use("Agg")  # batch jobs have no display; set before pyplot loads a backend
import matplotlib.pyplot as plt
import scanpy as sc

from agent.record.durable import link_atomically
from agent.registry import ToolError, tool
from agent.tools.common import Key, all_genes
from agent.tools.session import Session

QC_KEYS = ("n_genes_by_counts", "total_counts", "pct_counts_mt")
QC_THRESHOLDS = {  # panel -> the thresholds drawn on it
    "n_genes_by_counts": ("min_genes", "max_genes"),
    "total_counts": ("min_counts", "max_counts"),
    "pct_counts_mt": ("max_pct_mt",),
}
GENES_PER_SET = 4


def qc_lines(adata: Any) -> tuple[str, dict[str, dict[str, float]]]:
    """The QC thresholds to draw, per panel: those applied by filter_by_qc, else those
    qc_metrics suggested (uns['qc_thresholds'])."""
    stored = adata.uns.get("qc_thresholds", {})
    source = "applied" if "applied" in stored else "suggested"
    thresholds = stored.get(source, {})
    lines = {
        key: {name: float(thresholds[name]) for name in names if name in thresholds}
        for key, names in QC_THRESHOLDS.items()
    }
    return source, lines


def qc_violin(adata: Any, seed: int) -> Any:
    """Genes, counts and percent mitochondrial per cell, one panel each, with the thresholds."""
    source, lines = qc_lines(adata)
    fig, axes = plt.subplots(1, len(QC_KEYS), figsize=(4 * len(QC_KEYS), 4))
    np.random.seed(seed)  # the violin's point jitter draws from numpy's global RNG
    for ax, key in zip(axes, QC_KEYS, strict=True):
        sc.pl.violin(adata, key, jitter=0.4, ax=ax, show=False)
        ax.set_ylabel("")
        values = adata.obs[key].to_numpy()
        for name, value in lines[key].items():
            outside = (values < value) if name.startswith("min") else (values > value)
            label = f"{name} {value:g} ({outside.sum()} cells outside)"
            ax.axhline(value, color="crimson", linestyle="--", linewidth=1, label=label)
        if lines[key]:  # below the panel, off the cells
            ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.08), fontsize="small",
                      title=source, title_fontsize="small")  # fmt: skip
    fig.suptitle(f"{adata.n_obs} cells")
    return fig


def qc_scatter(adata: Any) -> Any:
    """Counts against genes per cell, coloured by percent mitochondrial counts, with the QC
    thresholds (qc_lines) as lines and the cells above max_pct_mt ringed."""
    source, lines = qc_lines(adata)
    obs = adata.obs
    counts, genes = obs["total_counts"].to_numpy(), obs["n_genes_by_counts"].to_numpy()
    pct = obs["pct_counts_mt"].to_numpy()
    order = np.argsort(pct, kind="stable")  # high-MT cells drawn last, on top
    fig, ax = plt.subplots(figsize=(6.5, 5))
    points = ax.scatter(counts[order], genes[order], c=pct[order], s=4, cmap="viridis",
                        rasterized=True)  # fmt: skip
    fig.colorbar(points, ax=ax, label="% mitochondrial counts", pad=0.02)
    for key, values, draw in (("total_counts", counts, ax.axvline),
                              ("n_genes_by_counts", genes, ax.axhline)):  # fmt: skip
        for name, value in lines[key].items():
            outside = (values < value) if name.startswith("min") else (values > value)
            draw(value, color="crimson", linestyle="--", linewidth=1,
                 label=f"{name} {value:g} ({outside.sum()} cells outside)")  # fmt: skip
    for name, value in lines["pct_counts_mt"].items():
        above = pct > value
        ax.scatter(counts[above], genes[above], s=16, facecolors="none", edgecolors="crimson",
                   linewidths=0.6, label=f"{name} {value:g} ({above.sum()} cells above)")  # fmt: skip
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("total counts")
    ax.set_ylabel("genes detected")
    not_applied = adata.uns.get("qc_thresholds", {}).get("not_applied", {})
    note = "; no mitochondrial genes: no MT filter" if "max_pct_mt" in not_applied else ""
    ax.set_title(f"{adata.n_obs} cells{note}")
    if ax.get_legend_handles_labels()[0]:  # below the axes, off the cells
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), fontsize="small",
                  title=f"thresholds ({source})", title_fontsize="small")  # fmt: skip
    return fig


def doublet_scores(adata: Any) -> Any:
    """Scrublet's doublet scores of the cells and of its simulated doublets with the threshold
    (scanpy's scrublet_score_distribution on detect_doublets' uns['scrublet'])."""
    stored = adata.uns.get("scrublet", {})
    if "doublet_scores_sim" not in stored or "doublet_score" not in adata.obs:
        raise ToolError("plot doublet_scores: call detect_doublets first")
    fig = sc.pl.scrublet_score_distribution(adata, return_fig=True, show=False)
    called = int(adata.obs["predicted_doublet"].astype(bool).sum())
    removed = adata.uns.get("remove_doublets", {}).get("removed")
    what = f"{removed} doublets removed" if removed is not None else f"{called} called doublets"
    fig.suptitle(f"threshold {float(stored['threshold']):.3f}: {what} of {adata.n_obs} cells",
                 y=1.04)  # fmt: skip
    return fig


def barcode_rank(adata: Any) -> Any:
    """The ranked UMI curve of every barcode read, with the knee, the inflection, the ambient
    bound and the barcodes kept as cells (call_cells' record in uns['cell_calling'])."""
    record = adata.uns.get("cell_calling")
    if record is None or "curve" not in record:
        raise ToolError("plot barcode_rank: call_cells found no unfiltered droplet matrix to draw")
    ranks = np.asarray(record["curve"]["rank"])
    totals = np.asarray(record["curve"]["total"])
    lowest = record["called_totals"]["min"]
    fig, ax = plt.subplots(figsize=(6, 4.5))
    ax.loglog(ranks, np.maximum(totals, 0.5), color="grey", linewidth=1, label="barcodes")
    kept = np.asarray(record["curve"]["cell"], dtype=bool)  # per plotted rank: not monotone
    ax.scatter(ranks[kept], totals[kept], color="crimson", s=6, zorder=3,
               label=f"{record['n_cells']:,} cells kept (lowest {lowest} UMIs)")  # fmt: skip
    evidence = record["evidence"]
    for name, value, style in (
        ("knee (retain)", evidence["knee"], "--"),
        ("inflection", evidence["inflection"], ":"),
        ("ambient bound", record["lower"], "-."),
    ):
        ax.axhline(value, color="black", linestyle=style, linewidth=1, label=f"{name} {value}")
    ax.set_xlabel("barcode rank")
    ax.set_ylabel("UMIs")
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1), fontsize="small")  # off the curve
    share = evidence["share_low_count"]
    ax.set_title(f"{evidence['barcodes']:,} barcodes, {share:.0%} with <= {record['lower']} UMIs")
    return fig


def annotation_scores(adata: Any) -> Any:
    """Mean marker-set score per cluster (rows) and cell type (columns) from annotate_clusters'
    table, each row named with its label; a box marks the type chosen, a dot each type with all
    the evidence a label needs (annotate_clusters' rule)."""
    annotation = adata.uns.get("annotation")
    if annotation is None or "table" not in annotation:
        raise ToolError("plot annotation_scores: call annotate_clusters first")
    table = annotation["table"]
    clusters = list(dict.fromkeys(table["cluster"]))
    scores = table.pivot(index="cluster", columns="cell_type", values="score")
    scores = scores.loc[clusters, list(dict.fromkeys(table["cell_type"]))]
    fig, ax = plt.subplots(figsize=(1 + 0.45 * scores.shape[1], 1.5 + 0.35 * len(clusters)))
    limit = float(np.nanmax(np.abs(scores.to_numpy()))) or 1.0
    image = ax.imshow(scores.to_numpy(), cmap="RdBu_r", vmin=-limit, vmax=limit, aspect="auto")
    fig.colorbar(image, ax=ax, label="mean score_genes score", shrink=0.6)
    types = list(scores.columns)
    for row, cluster in enumerate(clusters):
        label = annotation["cluster_labels"][cluster]
        if label in types:
            col = types.index(label)
            ax.add_patch(plt.Rectangle((col - 0.5, row - 0.5), 1, 1, fill=False, linewidth=2))
    qualified = table[table["qualified"]]
    ax.scatter(
        [types.index(t) for t in qualified["cell_type"]],
        [clusters.index(c) for c in qualified["cluster"]],
        s=8, color="black", label="evidence for a label",
    )  # fmt: skip
    ax.set_xticks(range(len(types)), types, rotation=90)
    ax.set_yticks(
        range(len(clusters)), [f"{c}: {annotation['cluster_labels'][c]}" for c in clusters]
    )
    ax.set_xlabel("marker set")
    ax.set_ylabel(f"{annotation['groupby']}: label")
    ax.legend(loc="lower left", bbox_to_anchor=(0, 1.01), fontsize="small", frameon=False)
    return fig


def _figure(session: Session, kind: str, color: str | None, groupby: str) -> Any:
    adata = session.adata
    if kind == "annotation_scores":
        return annotation_scores(adata)
    if kind == "barcode_rank":
        return barcode_rank(adata)
    if kind == "qc_violin":
        return qc_violin(adata, session.seed)
    if kind == "qc_scatter":
        return qc_scatter(adata)
    if kind == "doublet_scores":
        return doublet_scores(adata)
    if kind == "pca_variance":
        sc.pl.pca_variance_ratio(
            adata, n_pcs=min(50, adata.obsm["X_pca"].shape[1]), log=True, show=False
        )
        return plt.gcf()
    if kind == "umap":
        key = color or groupby
        genes = all_genes(adata).var_names
        if key not in adata.obs.columns and key not in genes:
            raise ToolError(
                f"plot umap: color {key!r} is neither a cell annotation (obs: {list(adata.obs.columns)[:20]}) nor a gene"
            )
        return sc.pl.umap(adata, color=key, show=False, return_fig=True, frameon=False)
    # dotplot: annotation marker sets when annotated, else the top ranked genes
    if groupby not in adata.obs.columns:
        raise ToolError(f"plot dotplot: no cell annotation {groupby!r}: call leiden first")
    annotation = adata.uns.get("annotation")
    if annotation is not None:
        markers = {
            name: list(genes)[:GENES_PER_SET] for name, genes in annotation["markers"].items()
        }
        dot = sc.pl.dotplot(adata, markers, groupby=groupby, show=False, return_fig=True)
    elif (
        "rank_genes_groups" in adata.uns
        and adata.uns["rank_genes_groups"]["params"]["groupby"] == groupby
    ):
        dot = sc.pl.rank_genes_groups_dotplot(
            adata, n_genes=3, groupby=groupby, show=False, return_fig=True
        )
    else:
        raise ToolError("plot dotplot needs annotate_clusters or rank_genes_groups first")
    dot.make_figure()
    return dot.fig


# What each kind of figure needs; a dotplot needs annotate_clusters or rank_genes_groups, which
# _figure checks (either will do).
_NEEDS = {
    "qc_violin": ("qc_metrics",),
    "qc_scatter": ("qc_metrics",),
    "doublet_scores": ("detect_doublets",),
    "pca_variance": ("pca",),
    "umap": ("umap",),
    "barcode_rank": ("call_cells",),
    "annotation_scores": ("annotate_clusters",),
}


def _plot_needs(params: dict[str, Any]) -> tuple[str, ...]:
    return _NEEDS.get(params.get("kind"), ())


@tool("plot", needs=_plot_needs, mutates=False)
def plot(
    session: Session,
    kind: Literal[
        "qc_violin",
        "umap",
        "dotplot",
        "pca_variance",
        "barcode_rank",
        "annotation_scores",
        "qc_scatter",
        "doublet_scores",
    ],
    color: str | None = None,
    groupby: Key = "leiden",
    filename: str | None = None,
) -> dict[str, Any]:
    """Draw a figure to a PNG file in the sample's plots/ folder.

    Kinds: 'qc_violin' (genes, counts, percent mitochondrial per cell, with the QC thresholds
    as dashed lines: those filter_by_qc applied, else those qc_metrics suggested; draw it after
    qc_metrics and before filter_by_qc to see the cells the thresholds remove), 'qc_scatter'
    (counts vs genes per cell coloured by percent mitochondrial, with the same thresholds),
    'doublet_scores' (Scrublet's scores of the cells and of simulated doublets with the
    threshold; after detect_doublets, before remove_doublets),
    'umap' (coloured by a cell annotation or gene; after umap), 'dotplot' (marker genes per
    group; after annotate_clusters or rank_genes_groups), 'pca_variance' (after pca),
    'barcode_rank' (ranked UMIs per barcode with knee, inflection and the cells kept; after
    call_cells found an unfiltered matrix), 'annotation_scores' (cluster x cell type marker
    scores with the labels chosen and the types with evidence; after annotate_clusters).

    Args:
        kind: Which figure.
        color: For 'umap': cell annotation (e.g. 'leiden', 'cell_type') or gene to colour by;
            defaults to groupby.
        groupby: Cell annotation with the groups (umap default colour, dotplot rows).
        filename: PNG file name inside plots/; defaults to KIND[_COLOR].png.
    """
    name = filename or (f"{kind}_{color or groupby}.png" if kind == "umap" else f"{kind}.png")
    if not name.endswith(".png"):
        raise ToolError(f"plot filename {name!r} must end in .png")
    folder = session.layout.plots
    target = session.path_inside(folder / name)
    if not target.is_relative_to(folder):
        raise ToolError(f"plot filename {name!r} leaves the plots/ folder")
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        fig = _figure(session, kind, color, groupby)
        fig.savefig(target, dpi=100, bbox_inches="tight")
    finally:
        plt.close("all")
    # its copy beside the checkpoints now: Snakemake deletes plots/ of a job killed before the
    # run's end could make one, and a resume redraws only the plots after its checkpoint
    link_atomically(target, session.layout.plots_copy / target.relative_to(folder))
    result = {
        "kind": kind,
        "path": str(target.relative_to(session.outdir)),
        "bytes": target.stat().st_size,
    }
    if kind in ("qc_violin", "qc_scatter"):
        source, lines = qc_lines(session.adata)
        drawn = {name: value for panel in lines.values() for name, value in panel.items()}
        result["thresholds_drawn"] = {"from": source, **drawn} if drawn else {}
    return result
