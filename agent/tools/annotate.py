"""Cell-type labels for clusters, given only on evidence: marker detection, agreement with the
cluster's own ranked genes, and a score that is high enough and clear of the runner-up."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import pandas as pd
import scanpy as sc
from pydantic import Field

from agent.registry import ToolError, tool
from agent.tools.common import Key, Limit, all_genes, left_out, obs_column, sizes
from agent.tools.session import Session
from agent.tools.species import HUMAN, MOUSE, detect_species, symbol_rules

UNKNOWN = "Unknown"
MIN_GENES_PER_SET = 2
# The evidence a label needs (all three): (a) a cell detects a set when MIN_GENES_DETECTED of its
# genes have a count > 0, and MIN_DETECTION of the cluster's cells must detect it; (b) one of the
# set's own genes (in no other set in use) is among the cluster's TOP_RANKED genes of
# rank_genes_groups (CD4 alone, shared by the CD4 T sets, gave Treg to naive CD4 T); (c) the mean
# score_genes score is at least MIN_SCORE. Chosen on the real sets of tests/fixtures_realdata.py
# (reference recipe, 2026-12): clusters whose label the published labels or their own top genes
# confirm had detection >= 46%, except CellTypist's shallow tissue T cells (28%: CD4, IL7R, ITGB1
# are all it has of CD4 memory T), and scores >= 0.10 (0.104: the CD4 T cells of pbmc68k_reduced
# alone); the wrong 'Macrophage' on pure CD4 T scored 0.028 and pbmc68k_reduced's
# proliferating T cells, with no proliferation gene among its 765, 0.055 (now Unknown). The B
# cells of CellTypist's sample have MS4A1 8th of their ranked genes, and a tissue T cluster IL7R
# about 25th once ribosomal genes are left out.
MIN_GENES_DETECTED = 2
MIN_DETECTION = 0.25
TOP_RANKED = 50
MIN_SCORE = 0.1
# A label is ambiguous when the runner-up among the types with evidence scores within this share
# of the best (margin < AMBIGUOUS_SHARE * best): the two sets fit about equally well.
AMBIGUOUS_SHARE = 0.2
AMBIGUITY_RULE = (
    f"ambiguous: the runner-up type with evidence has a mean score within {AMBIGUOUS_SHARE:.0%} "
    f"of the best (margin < {AMBIGUOUS_SHARE} * best score)"
)
MARKER_FILES = {MOUSE: "markers_mouse.json"}  # every other species: the human sets
TOP_TYPES = 3  # types listed per cluster in the result; uns keeps the whole table


def evidence_rule(min_detection: float, min_score: float, top_ranked: int) -> str:
    """The rule a label follows, in words, as the result and uns state it."""
    return (
        f"a cluster gets the best-scoring type that has (a) {MIN_GENES_DETECTED}+ of its genes "
        f"detected (count > 0) in at least {min_detection:.0%} of the cluster's cells, (b) at "
        f"least one of its own genes (in no other set) among the cluster's top {top_ranked} "
        f"genes of rank_genes_groups, (c) a mean score_genes score of at least {min_score:g}; "
        f"'{UNKNOWN}' when no type has all three"
    )


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
        if "/" in name:  # names become keys of uns, which an .h5ad file cannot hold with '/'
            raise ToolError(f"{where}: cell type {name!r} contains '/'; name it without one")
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


def _cluster_scores(
    adata: Any, usable: dict[str, list[str]], clusters: Any, seed: int
) -> pd.DataFrame:
    """Mean score_genes score per cluster (rows) and marker set (columns), on log-normalised
    values: .raw where normalize kept them there, else X."""
    scores = {}
    for i, (name, genes) in enumerate(usable.items()):
        column = f"_annotate_score_{i}"
        sc.tl.score_genes(
            adata, genes, score_name=column, use_raw=adata.raw is not None,
            random_state=seed,
        )  # fmt: skip
        scores[name] = adata.obs.pop(column).groupby(clusters.to_numpy()).mean()
    return pd.DataFrame(scores)


def _detection(adata: Any, usable: dict[str, list[str]], clusters: Any) -> pd.DataFrame:
    """Share of each cluster's cells (rows) with MIN_GENES_DETECTED of a set's genes (columns)
    above zero. Zero is zero in counts and in log-normalised values alike; the values are those
    the sets were matched in (.raw where there is one, else the counts layer, else X)."""
    if adata.raw is not None:
        values, names = adata.raw.X, adata.raw.var_names
    else:
        values, names = adata.layers.get("counts", adata.X), adata.var_names
    column = pd.Index(names.astype(str)).get_indexer
    detected = {}
    for name, genes in usable.items():
        hits = (values[:, column(genes)] > 0).sum(axis=1)
        enough = np.asarray(hits).ravel() >= min(MIN_GENES_DETECTED, len(genes))
        detected[name] = pd.Series(enough).groupby(clusters.to_numpy()).mean()
    return pd.DataFrame(detected)


def _ranked_genes(
    adata: Any, groupby: str, clusters: Any, top: int, species: str
) -> tuple[dict[str, list[str]], str]:
    """Each cluster's top genes of rank_genes_groups: the step's result in uns when it ranked
    these clusters, else ranked here the same way (Wilcoxon, cluster against the rest).
    Mitochondrial and ribosomal genes are left out: they follow cell size and quality, not type
    (they fill the top 50 of a tissue sample's T-cell cluster)."""
    stored = adata.uns.get("rank_genes_groups")
    groups = set(clusters.unique())
    if len(groups) < 2:
        raise ToolError(
            f"annotate_clusters: {groupby!r} has one cluster; a label needs the cluster's own "
            "genes ranked against other clusters (give a groupby with 2 or more)"
        )
    if (
        stored is not None
        and stored["params"]["groupby"] == groupby
        and set(stored["names"].dtype.names) == groups
    ):
        names, source = stored["names"], f"rank_genes_groups ({stored['params']['method']})"
    else:
        key = "_annotate_ranked"
        if adata.obs[groupby].dtype.name != "category":  # as rank_genes_groups (the tool) does
            adata.obs[groupby] = clusters.astype("category")
        try:
            sc.tl.rank_genes_groups(
                adata, groupby, method="wilcoxon", use_raw=adata.raw is not None, key_added=key,
            )  # fmt: skip
        except (ValueError, ZeroDivisionError) as e:
            raise ToolError(
                f"annotate_clusters: ranking the genes of {groupby!r} failed: {e}"
            ) from None
        names = adata.uns.pop(key)["names"]
        source = "ranked here (wilcoxon; no rank_genes_groups result for these clusters)"
    rules = symbol_rules(species)
    housekeeping = (rules.mt_prefix.upper(), *(p.upper() for p in rules.ribo_prefixes))
    kept = {
        g: [n for n in names[g] if not str(n).upper().startswith(housekeeping)][:top]
        for g in names.dtype.names
    }
    return kept, source


def evidence_table(
    adata: Any,
    usable: dict[str, list[str]],
    clusters: Any,
    groupby: str,
    species: str,
    seed: int,
    thresholds: tuple[float, float, int],
) -> tuple[pd.DataFrame, str]:
    """One row per cluster and marker set: mean score, detection, the set's genes among the
    cluster's top ranked, and whether all three reach ``thresholds`` (min_score, min_detection,
    top_ranked); and where the ranking came from."""
    min_score, min_detection, top_ranked = thresholds
    top_genes, ranked_from = _ranked_genes(adata, groupby, clusters, top_ranked, species)
    scores = _cluster_scores(adata, usable, clusters, seed)
    detection = _detection(adata, usable, clusters)
    table = pd.DataFrame(
        [
            {
                "cluster": cluster, "cell_type": name, "score": float(scores.at[cluster, name]),
                "detection": float(detection.at[cluster, name]),
                "ranked": [g for g in top_genes[cluster] if g in set(genes)],
            }
            for cluster in sorted(scores.index, key=_natural)
            for name, genes in usable.items()
        ]
    )  # fmt: skip
    # a gene of two sets cannot tell them apart: the ranked evidence must include one of the
    # set's own genes
    in_sets = pd.Series([g for genes in usable.values() for g in genes]).value_counts()
    shared = set(in_sets[in_sets > 1].index)
    table["own_ranked"] = table["ranked"].map(lambda genes: sum(g not in shared for g in genes))
    table["qualified"] = (
        (table["detection"] >= min_detection)
        & (table["own_ranked"] > 0)
        & (table["score"] >= min_score)
    )
    return table, ranked_from


def _decide(evidence: pd.DataFrame, thresholds: tuple[float, float, int]) -> dict[str, Any]:
    """A cluster's label from its evidence table (one row per type: score, detection, ranked,
    qualified); ``thresholds`` as in evidence_table, to say which test an Unknown failed."""
    min_score, min_detection, top_ranked = thresholds
    ranked = evidence.sort_values("score", ascending=False)
    qualified = ranked[ranked["qualified"]]
    if qualified.empty:
        best = ranked.iloc[0]
        failed = []
        if best["detection"] < min_detection:
            failed.append(f"detection {best['detection']:.0%} < {min_detection:.0%}")
        if not best["own_ranked"]:
            failed.append(
                f"none of its own genes (in no other set) in the cluster's top {top_ranked} ranked"
            )
        if best["score"] < min_score:
            failed.append(f"score {best['score']:.3f} < {min_score:g}")
        return {
            "label": UNKNOWN, "score": round(float(best["score"]), 3), "runner_up": None,
            "margin": None, "ambiguous": False,
            "reason": f"best {ranked.index[0]}: " + "; ".join(failed),
        }  # fmt: skip
    top = qualified.iloc[0]
    entry = {
        "label": qualified.index[0],
        "score": round(float(top["score"]), 3),
        "detection": round(float(top["detection"]), 2),
        "ranked_markers": top["ranked"][:5],
        "runner_up": None,
        "margin": None,
        "ambiguous": False,
    }
    if len(qualified) > 1:
        margin = float(top["score"] - qualified.iloc[1]["score"])
        entry.update(
            runner_up=qualified.index[1],
            margin=round(margin, 3),
            ambiguous=margin < AMBIGUOUS_SHARE * float(top["score"]),
        )
    return entry


@tool("annotate", needs=("normalize",), expensive=True)
def annotate_clusters(
    session: Session,
    groupby: Key = "leiden",
    markers_file: str | None = None,
    key_added: Key = "cell_type",
    min_score: Annotated[float, Field(ge=-5, le=5)] = MIN_SCORE,
    min_detection: Annotated[float, Field(ge=0, le=1)] = MIN_DETECTION,
    top_ranked: Annotated[int, Field(ge=5, le=100)] = TOP_RANKED,
    limit: Limit = 40,
) -> dict[str, Any]:
    """Label each cluster with the cell type whose marker genes give evidence for it, or 'Unknown'.

    For every marker set and cluster: the mean score_genes score (mean expression of the set
    minus that of matched control genes, log-normalised data), the share of the cluster's cells
    that detect 2+ of the set's genes, and the set's genes among the cluster's own top genes of
    rank_genes_groups (call it first; else they are ranked here). A cluster gets the
    best-scoring type whose detection and score reach the thresholds and one of whose own genes
    (in no other set) is among the ranked ones, else 'Unknown' with the reason. It is flagged ambiguous when the runner-up type with evidence
    scores within 20% of the best (obs column '<key_added>_ambiguous', listed as 'A|B').
    Default marker sets: human or mouse immune and blood types (naive and memory T, Treg, NK, B,
    plasma, monocytes, DC, pDC, mature DC, platelets, macrophages, HSPC, mast cells, erythroid,
    proliferating, neutrophils), chosen by the species the gene symbols show, matched ignoring
    case; a JSON file in the output folder ({"cell_types": {"name": ["GENE", ...]}}) can
    replace them. The whole cluster x type table is kept in uns['annotation']['table'].

    Args:
        groupby: Cell annotation (obs column) with the clusters.
        markers_file: JSON file of marker sets inside the output folder; leave out for the
            built-in sets of the detected species.
        key_added: Cell annotation (obs column) to store the labels in.
        min_score: Lowest mean score a type needs in a cluster.
        min_detection: Lowest share of a cluster's cells that must detect 2+ of the type's genes.
        top_ranked: How many of the cluster's top ranked genes are searched for the type's genes.
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
    thresholds = (min_score, min_detection, top_ranked)
    table, ranked_from = evidence_table(
        adata, usable, clusters, groupby, species["species"], session.seed, thresholds
    )
    cluster_sizes = clusters.value_counts()
    result = {}
    for cluster, evidence in table.groupby("cluster", sort=False):
        entry = _decide(evidence.set_index("cell_type"), thresholds)
        best = evidence.nlargest(TOP_TYPES, "score")
        entry["top_types"] = [
            f"{r.cell_type}: score {r.score:.2f}, detected {r.detection:.0%}, {len(r.ranked)} ranked"
            for r in best.itertuples()
        ]
        entry["n_cells"] = int(cluster_sizes[cluster])
        result[cluster] = entry
    mapping = {cluster: entry["label"] for cluster, entry in result.items()}
    ambiguous = {c: f"{e['label']}|{e['runner_up']}" for c, e in result.items() if e["ambiguous"]}
    unknown = {c: e["reason"] for c, e in result.items() if e["label"] == UNKNOWN}
    rule = evidence_rule(min_detection, min_score, top_ranked)
    adata.obs[key_added] = clusters.map(mapping).astype("category")
    adata.obs[f"{key_added}_ambiguous"] = clusters.isin(list(ambiguous)).to_numpy()
    stored = table.assign(
        n_ranked=table["ranked"].str.len(), ranked=table["ranked"].str.join(" "),
        label=table["cluster"].map(mapping),
    )  # fmt: skip
    adata.uns["annotation"] = {
        "groupby": groupby, "key_added": key_added, "source": source,
        "species": species["species"], "markers": usable, "cluster_labels": mapping,
        "margins": {c: e["margin"] for c, e in result.items() if e["margin"] is not None},
        "ambiguous": ambiguous, "ambiguity_rule": AMBIGUITY_RULE, "rule": rule,
        "unknown_reasons": unknown, "ranked_from": ranked_from,
        "thresholds": {
            "min_score": min_score, "min_detection": min_detection, "top_ranked": top_ranked,
            "min_genes_detected": MIN_GENES_DETECTED, "ambiguous_share": AMBIGUOUS_SHARE,
        },
        "table": stored,
    }  # fmt: skip
    listed = dict(list(result.items())[:limit])
    return {
        "groupby": groupby,
        "key_added": key_added,
        "species": species["species"],
        "species_evidence": species["evidence"],
        "marker_sets": source,
        "sets_used": {name: len(genes) for name, genes in usable.items()},
        "sets_skipped": sorted(set(sets) - set(usable)),
        "genes_missing": {name: genes[:10] for name, genes in missing.items()},
        "rule": rule,
        "ranked_from": ranked_from,
        "clusters": listed,
        "left_out": left_out(len(result), limit, "clusters"),
        "ambiguous": ambiguous,
        "ambiguity_rule": AMBIGUITY_RULE,
        "unknown": unknown,
        "label_sizes": sizes(adata.obs[key_added]),
    }


def _natural(label: str) -> tuple[int, str]:
    """Cluster '10' after '9'."""
    return (int(label), "") if label.isdigit() else (1 << 30, label)
