"""Each tool's kind and whether it changes the data, by name, in the order of
``agent.tools.TOOLS``: what readers of records (the report, ``agent compare``) need to know of the
tools, without importing them (they pull scanpy and umap: seconds). The tools' own ``@tool``
declarations are the truth; tests/test_tool_kinds.py fails when this table differs from them."""

from __future__ import annotations

from typing import NamedTuple


class ToolKind(NamedTuple):
    kind: str  # agent.registry.Kind
    mutates: bool  # changes the data: its parameters are analysis choices


TOOL_KINDS: dict[str, ToolKind] = {
    "load_data": ToolKind("io", mutates=True),
    "call_cells": ToolKind("cell_calling", mutates=True),
    "qc_metrics": ToolKind("qc", mutates=True),
    "filter_cells": ToolKind("cell_filter", mutates=True),
    "filter_genes": ToolKind("gene_filter", mutates=True),
    "filter_by_qc": ToolKind("cell_filter", mutates=True),
    "detect_doublets": ToolKind("doublets", mutates=True),
    "remove_doublets": ToolKind("doublets", mutates=True),
    "normalize": ToolKind("preprocess", mutates=True),
    "highly_variable_genes": ToolKind("preprocess", mutates=True),
    "regress_out": ToolKind("preprocess", mutates=True),
    "scale": ToolKind("preprocess", mutates=True),
    "pca": ToolKind("embed", mutates=True),
    "neighbors": ToolKind("embed", mutates=True),
    "umap": ToolKind("embed", mutates=True),
    "leiden": ToolKind("cluster", mutates=True),
    "cluster_sweep": ToolKind("cluster", mutates=True),
    "remove_ambient": ToolKind("ambient", mutates=True),
    "rank_genes_groups": ToolKind("markers", mutates=True),
    "annotate_clusters": ToolKind("annotate", mutates=True),
    "annotate_celltypist": ToolKind("annotate", mutates=True),
    "plot": ToolKind("plot", mutates=False),
    "save": ToolKind("io", mutates=False),
    "finish": ToolKind("finish", mutates=False),
}
