"""The scanpy tools the agent can call, in the order of a standard analysis."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from agent.registry import ToolRegistry
from agent.tools.annotate import annotate_clusters
from agent.tools.cluster import cluster_sweep, leiden
from agent.tools.doublets import detect_doublets, remove_doublets
from agent.tools.embed import neighbors, pca, umap
from agent.tools.io import finish, load_data, save
from agent.tools.markers import rank_genes_groups
from agent.tools.plots import plot
from agent.tools.preprocess import highly_variable_genes, normalize, regress_out, scale
from agent.tools.qc import filter_by_qc, filter_cells, filter_genes, qc_metrics
from agent.tools.session import Session


def _records_success(fn: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    """A tool that adds its name to ``session.done`` when it returns, whoever calls it (the loop,
    a resume re-running recorded steps, a replay, a test), so prerequisites always see the truth."""

    @functools.wraps(fn)
    def tool(session: Session, **params: Any) -> dict[str, Any]:
        result = fn(session, **params)
        session.done.add(fn.__name__)
        return result

    return tool


TOOLS: list[Callable[..., dict[str, Any]]] = [_records_success(fn) for fn in (
    load_data,
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
    rank_genes_groups,
    annotate_clusters,
    plot,
    save,
    finish,
)]  # fmt: skip


def build_registry() -> ToolRegistry:
    return ToolRegistry(TOOLS)


__all__ = ["TOOLS", "Session", "build_registry"]
