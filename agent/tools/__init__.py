"""The scanpy tools the agent can call, in the order of a standard analysis."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from agent.registry import ToolRegistry
from agent.tools.ambient import remove_ambient
from agent.tools.annotate import annotate_clusters
from agent.tools.cells import call_cells
from agent.tools.celltypist_annotate import annotate_celltypist
from agent.tools.cluster import cluster_sweep, leiden
from agent.tools.doublets import detect_doublets, remove_doublets
from agent.tools.embed import neighbors, pca, umap
from agent.tools.filters import filter_by_qc, filter_cells, filter_genes
from agent.tools.finish import finish
from agent.tools.io import load_data, save
from agent.tools.markers import rank_genes_groups
from agent.tools.plots import plot
from agent.tools.preprocess import highly_variable_genes, normalize, regress_out, scale
from agent.tools.qc import qc_metrics
from agent.tools.session import Session

TOOLS: list[Callable[..., dict[str, Any]]] = [
    load_data,
    call_cells,
    qc_metrics,
    filter_cells,
    filter_genes,
    filter_by_qc,
    detect_doublets,
    remove_doublets,
    normalize,
    highly_variable_genes,
    regress_out,
    scale,
    pca,
    neighbors,
    umap,
    leiden,
    cluster_sweep,
    remove_ambient,
    rank_genes_groups,
    annotate_clusters,
    annotate_celltypist,
    plot,
    save,
    finish,
]  # fmt: skip


def build_registry() -> ToolRegistry:
    return ToolRegistry(TOOLS)


__all__ = ["TOOLS", "Session", "build_registry"]
