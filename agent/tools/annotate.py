"""Cell-type labels for clusters from marker-gene set scores."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import scanpy as sc
from pydantic import Field

from agent.registry import ToolError, tool
from agent.tools.common import Key, Limit, obs_column, sizes
from agent.tools.session import Session

UNKNOWN = "Unknown"
MIN_GENES_PER_SET = 2


def default_marker_sets() -> dict[str, list[str]]:
    """The package's marker sets (agent/data/markers.json)."""
    text = resources.files("agent.data").joinpath("markers.json").read_text()
    return _parse_marker_sets(json.loads(text), "agent/data/markers.json")


def _parse_marker_sets(doc: Any, where: str) -> dict[str, list[str]]:
    """{"cell_types": {name: [gene, ...]}} (or the inner mapping alone), checked."""
    sets = doc.get("cell_types", doc) if isinstance(doc, dict) else doc
    if not isinstance(sets, dict) or not sets:
        raise ToolError(
            f'{where}: expected a JSON object {{"cell_types": {{name: [genes]}}}} with at least one cell type'
        )
    for name, genes in sets.items():
        if (
            not isinstance(genes, list)
            or not genes
            or not all(isinstance(g, str) and g for g in genes)
        ):
            raise ToolError(
                f"{where}: cell_types[{name!r}] must be a non-empty list of gene symbols, got {genes!r:.100}"
            )
    return {str(k): list(dict.fromkeys(v)) for k, v in sets.items()}


def _load_marker_sets(
    session: Session, markers_file: str | None
) -> tuple[dict[str, list[str]], str]:
    if markers_file is None:
        return default_marker_sets(), "agent/data/markers.json"
    path: Path = session.readable_path(markers_file)
    if not path.is_file():
        raise ToolError(f"markers file {markers_file!r} does not exist ({path})")
    try:
        doc = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ToolError(f"markers file {path}: not valid JSON ({e})") from None
    return _parse_marker_sets(doc, str(path)), str(path)


@tool("annotate", needs=("normalize",), expensive=True)
def annotate_clusters(
    session: Session,
    groupby: Key = "leiden",
    markers_file: str | None = None,
    key_added: Key = "cell_type",
    min_score: Annotated[float, Field(ge=-5, le=5)] = 0.0,
    limit: Limit = 40,
) -> dict[str, Any]:
    """Label each cluster with the cell type whose marker genes score highest in it.

    Scores every cell for every marker set (scanpy's score_genes: mean expression of the set
    minus that of matched control genes, on the log-normalised data), averages the scores per
    cluster and gives each cluster the best-scoring type, or 'Unknown' when no score exceeds
    min_score. Default marker sets: human PBMC types; a JSON file in the output folder
    ({"cell_types": {"name": ["GENE", ...]}}) can replace them.

    Args:
        groupby: Cell annotation (obs column) with the clusters.
        markers_file: JSON file of marker sets inside the output folder; leave out for the
            built-in PBMC sets.
        key_added: Cell annotation (obs column) to store the labels in.
        min_score: A cluster whose best mean score is not above this is labelled 'Unknown'.
        limit: Clusters listed at most in the result.
    """
    adata = session.adata
    clusters = obs_column(
        adata, groupby, "annotate_clusters", "call leiden first (or give another groupby)"
    )
    clusters = clusters.astype(str)
    sets, source = _load_marker_sets(session, markers_file)
    universe = set((adata.raw.var_names if adata.raw is not None else adata.var_names).astype(str))
    usable: dict[str, list[str]] = {}
    missing: dict[str, list[str]] = {}
    for name, genes in sets.items():
        present = [g for g in genes if g in universe]
        if len(present) < len(genes):
            missing[name] = [g for g in genes if g not in universe]
        if len(present) >= MIN_GENES_PER_SET:
            usable[name] = present
    if not usable:
        example = ", ".join(sorted(universe)[:3])
        raise ToolError(
            f"annotate_clusters: no marker set has {MIN_GENES_PER_SET} or more of its genes in the data "
            f"(data gene names look like: {example}); give a markers_file with symbols the data use"
        )
    scores = {}
    for i, (name, genes) in enumerate(usable.items()):
        column = f"_annotate_score_{i}"
        sc.tl.score_genes(
            adata,
            genes,
            score_name=column,
            use_raw=adata.raw is not None,
            random_state=session.seed,
        )
        scores[name] = adata.obs.pop(column).groupby(clusters.to_numpy()).mean()
    table = np.vstack([scores[name].to_numpy() for name in usable]).T  # clusters x types
    names = list(usable)
    cluster_ids = list(scores[names[0]].index)
    result = {}
    mapping = {}
    for row, cluster in zip(table, cluster_ids, strict=True):
        order = np.argsort(row)[::-1]
        best = float(row[order[0]])
        label = names[order[0]] if best > min_score else UNKNOWN
        mapping[cluster] = label
        result[cluster] = {
            "label": label,
            "score": round(best, 3),
            "runner_up": names[order[1]] if len(order) > 1 else None,
            "margin": round(best - float(row[order[1]]), 3) if len(order) > 1 else None,
        }
    adata.obs[key_added] = clusters.map(mapping).astype("category")
    adata.uns["annotation"] = {
        "groupby": groupby, "key_added": key_added, "source": source, "min_score": min_score,
        "markers": usable, "cluster_labels": mapping,
    }  # fmt: skip
    cluster_sizes = clusters.value_counts()
    for cluster, entry in result.items():
        entry["n_cells"] = int(cluster_sizes[cluster])
    listed = dict(sorted(result.items(), key=lambda item: _natural(item[0]))[:limit])
    return {
        "groupby": groupby,
        "key_added": key_added,
        "marker_sets": source,
        "sets_used": {name: len(genes) for name, genes in usable.items()},
        "sets_skipped": sorted(set(sets) - set(usable)),
        "genes_missing": {name: genes[:10] for name, genes in missing.items()},
        "clusters": listed,
        "left_out": f"{len(result) - limit} clusters not listed" if len(result) > limit else None,
        "label_sizes": sizes(adata.obs[key_added]),
    }


def _natural(label: str) -> tuple[int, str]:
    """Cluster '10' after '9'."""
    return (int(label), "") if label.isdigit() else (1 << 30, label)
