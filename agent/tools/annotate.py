"""Cell-type labels for clusters from marker-gene set scores."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Annotated, Any

import pandas as pd
import scanpy as sc
from pydantic import Field

from agent.registry import ToolError, tool
from agent.tools.common import Key, Limit, all_genes, obs_column, sizes
from agent.tools.session import Session
from agent.tools.species import HUMAN, MOUSE, detect_species

UNKNOWN = "Unknown"
MIN_GENES_PER_SET = 2
# A cluster is ambiguous when its runner-up type scores within this share of its best score
# (margin < AMBIGUOUS_SHARE * best): the two sets fit about equally well.
AMBIGUOUS_SHARE = 0.2
AMBIGUITY_RULE = (
    f"ambiguous: the runner-up type's mean score is within {AMBIGUOUS_SHARE:.0%} of the best "
    f"(margin < {AMBIGUOUS_SHARE} * best score)"
)
MARKER_FILES = {MOUSE: "markers_mouse.json"}  # every other species: the human sets


def marker_file(species: str) -> str:
    """The package's marker file for a species: mouse sets for mouse, human sets otherwise."""
    return f"agent/data/{MARKER_FILES.get(species, 'markers.json')}"


def default_marker_sets(species: str = HUMAN) -> dict[str, list[str]]:
    """The package's marker sets for a species (agent/data/markers*.json)."""
    where = marker_file(species)
    text = resources.files("agent.data").joinpath(where.rsplit("/", 1)[1]).read_text()
    return _parse_marker_sets(json.loads(text), where)


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
    session: Session, markers_file: str | None, species: str
) -> tuple[dict[str, list[str]], str]:
    if markers_file is None:
        return default_marker_sets(species), marker_file(species)
    path: Path = session.readable_path(markers_file)
    if not path.is_file():
        raise ToolError(f"markers file {markers_file!r} does not exist ({path})")
    try:
        doc = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ToolError(f"markers file {path}: not valid JSON ({e})") from None
    return _parse_marker_sets(doc, str(path)), str(path)


def _match_genes(
    sets: dict[str, list[str]], names: Any
) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """Each set's genes as the data spell them (exact, else ignoring case), and those missing."""
    exact = set(names)
    by_upper: dict[str, str] = {}
    for name in names:
        by_upper.setdefault(name.upper(), name)
    usable: dict[str, list[str]] = {}
    missing: dict[str, list[str]] = {}
    for set_name, genes in sets.items():
        found = {g: g if g in exact else by_upper.get(g.upper()) for g in genes}
        present = list(dict.fromkeys(v for v in found.values() if v is not None))
        if len(present) < len(genes):
            missing[set_name] = [g for g, v in found.items() if v is None]
        if len(present) >= MIN_GENES_PER_SET:
            usable[set_name] = present
    return usable, missing


def _cluster_scores(session: Session, usable: dict[str, list[str]], clusters: Any) -> pd.DataFrame:
    """Mean score_genes score per cluster (rows) and marker set (columns), on log-normalised
    values: .raw where normalize kept them there, else X."""
    adata = session.adata
    scores = {}
    for i, (name, genes) in enumerate(usable.items()):
        column = f"_annotate_score_{i}"
        sc.tl.score_genes(
            adata, genes, score_name=column, use_raw=adata.raw is not None,
            random_state=session.seed,
        )  # fmt: skip
        scores[name] = adata.obs.pop(column).groupby(clusters.to_numpy()).mean()
    return pd.DataFrame(scores)


def _label(row: pd.Series, min_score: float) -> dict[str, Any]:
    """A cluster's label, its score, the runner-up, the margin and whether it is ambiguous."""
    ranked = row.sort_values(ascending=False)
    best = float(ranked.iloc[0])
    labelled = best > min_score
    entry = {"label": ranked.index[0] if labelled else UNKNOWN, "score": round(best, 3)}
    if len(ranked) > 1:
        margin = best - float(ranked.iloc[1])
        entry["runner_up"] = ranked.index[1]
        entry["margin"] = round(margin, 3)
        entry["ambiguous"] = labelled and margin < AMBIGUOUS_SHARE * best
    else:
        entry.update(runner_up=None, margin=None, ambiguous=False)
    return entry


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
    min_score. Marker genes match the data's symbols ignoring case. Default marker sets: human
    or mouse immune types (PBMC types, plasma cells, pDC, mature DC), chosen by the species the
    gene symbols show; a JSON file in the output folder ({"cell_types": {"name": ["GENE", ...]}})
    can replace them. A cluster is flagged ambiguous when the runner-up scores within 20% of its
    best score (margin < 0.2 * score): obs column '<key_added>_ambiguous', listed as 'A|B'.

    Args:
        groupby: Cell annotation (obs column) with the clusters.
        markers_file: JSON file of marker sets inside the output folder; leave out for the
            built-in sets of the detected species.
        key_added: Cell annotation (obs column) to store the labels in.
        min_score: A cluster whose best mean score is not above this is labelled 'Unknown'.
        limit: Clusters listed at most in the result.
    """
    adata = session.adata
    clusters = obs_column(
        adata, groupby, "annotate_clusters", "call leiden first (or give another groupby)"
    ).astype(str)
    names = all_genes(adata).var_names.astype(str)
    species = detect_species(names)
    sets, source = _load_marker_sets(session, markers_file, species["species"])
    usable, missing = _match_genes(sets, names)
    if not usable:
        example = ", ".join(sorted(names)[:3])
        raise ToolError(
            f"annotate_clusters: no marker set has {MIN_GENES_PER_SET} or more of its genes in the data "
            f"(data gene names look like: {example}); give a markers_file with symbols the data use"
        )
    result = {
        str(cluster): _label(row, min_score)
        for cluster, row in _cluster_scores(session, usable, clusters).iterrows()
    }
    cluster_sizes = clusters.value_counts()
    for cluster, entry in result.items():
        entry["n_cells"] = int(cluster_sizes[cluster])
    mapping = {cluster: entry["label"] for cluster, entry in result.items()}
    ambiguous = {
        cluster: f"{entry['label']}|{entry['runner_up']}"
        for cluster, entry in sorted(result.items(), key=lambda item: _natural(item[0]))
        if entry["ambiguous"]
    }
    adata.obs[key_added] = clusters.map(mapping).astype("category")
    adata.obs[f"{key_added}_ambiguous"] = clusters.isin(list(ambiguous)).to_numpy()
    adata.uns["annotation"] = {
        "groupby": groupby, "key_added": key_added, "source": source, "min_score": min_score,
        "species": species["species"], "markers": usable, "cluster_labels": mapping,
        "margins": {c: e["margin"] for c, e in result.items() if e["margin"] is not None},
        "ambiguous": ambiguous, "ambiguity_rule": AMBIGUITY_RULE,
    }  # fmt: skip
    listed = dict(sorted(result.items(), key=lambda item: _natural(item[0]))[:limit])
    return {
        "groupby": groupby,
        "key_added": key_added,
        "species": species["species"],
        "species_evidence": species["evidence"],
        "marker_sets": source,
        "sets_used": {name: len(genes) for name, genes in usable.items()},
        "sets_skipped": sorted(set(sets) - set(usable)),
        "genes_missing": {name: genes[:10] for name, genes in missing.items()},
        "clusters": listed,
        "left_out": f"{len(result) - limit} clusters not listed" if len(result) > limit else None,
        "ambiguous": ambiguous,
        "ambiguity_rule": AMBIGUITY_RULE,
        "label_sizes": sizes(adata.obs[key_added]),
    }


def _natural(label: str) -> tuple[int, str]:
    """Cluster '10' after '9'."""
    return (int(label), "") if label.isdigit() else (1 << 30, label)
