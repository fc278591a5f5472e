"""Figures to PNG in the sample's plots/ folder: QC violins, UMAP, marker dot plot, PCA variance."""

from __future__ import annotations

from typing import Any, Literal

import matplotlib
import numpy as np

matplotlib.use("Agg")  # batch jobs have no display; set before pyplot loads a backend
import matplotlib.pyplot as plt
import scanpy as sc

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
        if lines[key]:
            ax.legend(loc="upper right", fontsize="small", title=source, title_fontsize="small")
    fig.suptitle(f"{adata.n_obs} cells")
    return fig


def _figure(session: Session, kind: str, color: str | None, groupby: str) -> Any:
    adata = session.adata
    if kind == "qc_violin":
        return qc_violin(adata, session.seed)
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
_NEEDS = {"qc_violin": ("qc_metrics",), "pca_variance": ("pca",), "umap": ("umap",)}


def _plot_needs(params: dict[str, Any]) -> tuple[str, ...]:
    return _NEEDS.get(params.get("kind"), ())


@tool("plot", needs=_plot_needs, mutates=False)
def plot(
    session: Session,
    kind: Literal["qc_violin", "umap", "dotplot", "pca_variance"],
    color: str | None = None,
    groupby: Key = "leiden",
    filename: str | None = None,
) -> dict[str, Any]:
    """Draw a figure to a PNG file in the sample's plots/ folder.

    Kinds: 'qc_violin' (genes, counts, percent mitochondrial per cell, with the QC thresholds
    as dashed lines: those filter_by_qc applied, else those qc_metrics suggested; draw it after
    qc_metrics and before filter_by_qc to see the cells the thresholds remove),
    'umap' (coloured by a cell annotation or gene; after umap), 'dotplot' (marker genes per
    group; after annotate_clusters or rank_genes_groups), 'pca_variance' (after pca).

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
    result = {
        "kind": kind,
        "path": str(target.relative_to(session.outdir)),
        "bytes": target.stat().st_size,
    }
    if kind == "qc_violin":
        source, lines = qc_lines(session.adata)
        drawn = {name: value for panel in lines.values() for name, value in panel.items()}
        result["thresholds_drawn"] = {"from": source, **drawn} if drawn else {}
    return result
