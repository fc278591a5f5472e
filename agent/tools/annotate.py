"""Cell-type labels for clusters, given only on evidence: marker detection, agreement with the
cluster's own ranked genes, and a score that is high enough and clear of the runner-up."""

from __future__ import annotations

from typing import Annotated, Any

import anndata as ad
import numpy as np
import pandas as pd
import scanpy as sc
from pydantic import Field

from agent.registry import ToolError, tool
from agent.tools.common import Key, Limit, all_genes, left_out, obs_column, sizes
from agent.tools.doublets import flagged
from agent.tools.lineage import gate_rule, lineage_table
from agent.tools.marker_sets import (
    MIN_GENES_PER_SET,
    Matched,
    default_marker_sets,
    load_markers,
    match,
)
from agent.tools.markers import rank_singlets
from agent.tools.session import Session
from agent.tools.species import detect_species, symbol_rules

__all__ = ["UNKNOWN", "annotate_clusters", "default_marker_sets", "evidence_table"]

UNKNOWN = "Unknown"
# The evidence a type needs (all four): (a) a cell detects a set when MIN_GENES_DETECTED of its
# genes have a count > 0, and MIN_DETECTION of the cluster's cells must detect it; (b) as many
# must detect one of its defining genes, where it declares them; (c) one of the set's own genes
# (in no other set in use) is among the cluster's TOP_RANKED genes of rank_genes_groups (CD4
# alone, shared by the CD4 T sets, gave Treg to naive CD4 T); (d) the mean score_genes score is
# at least MIN_SCORE. Chosen on all three real sets of tests/fixtures_realdata.py
# (pbmc68k_reduced, pbmc_small, CellTypist's sample; reference recipe, 2026-12), before the
# lineage gate: clusters whose label the published labels or their own top genes confirm had
# detection >= 46%, except CellTypist's shallow tissue T cells (28%: CD4, IL7R, ITGB1 are all it
# has of CD4 memory T), and scores >= 0.10 (0.104: the CD4 T cells of pbmc68k_reduced alone); the
# issue's wrong 'Macrophage' on pure CD4 T scored 0.028 and pbmc68k_reduced's proliferating T
# cells, with no proliferation gene among its 765, 0.055 (now Unknown). The B cells of
# CellTypist's sample have MS4A1 8th of their ranked genes, and a tissue T cluster IL7R about
# 25th once ribosomal genes are left out. So these four are not held out anywhere: the tests of
# tests/test_tools_lineage.py check them only on subsets, a thinned copy and a panel of the
# same data (stated there); a new tissue or depth is not covered.
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
# Another lineage may share a cluster where its genes are present there and the genes it lacks
# are detected in fewer than this share of the cells (part of the cluster lacks them). Chosen on
# CellTypist's sample: its T cluster, pure by its own genes, detects CD3 in 70% (a shallow
# tissue), its T and NK cells merged into one cluster on the 765-gene panel in 51%.
MIXED_DETECTION = 0.6
TOP_TYPES = 3  # types listed per cluster in the result; uns keeps the whole table
ONE_CLUSTER = "one cluster: no other cluster to rank its genes against, so no type is told"


def evidence_rule(min_detection: float, min_score: float, top_ranked: int) -> str:
    """The rule a label follows, in words, as the result and uns state it."""
    return (
        "a cluster's lineage is the one whose gate passed (its genes present, the genes it "
        "lacks absent; lineage_rule); within it, the best-scoring type that has (a) "
        f"{MIN_GENES_DETECTED}+ of its genes detected (count > 0) in at least {min_detection:.0%} "
        f"of the cluster's cells, (b) one of its defining genes detected in as many, where it "
        f"declares them, (c) at least one of its own genes (in no other set) among the "
        f"cluster's top {top_ranked} genes of rank_genes_groups, (d) a mean score_genes score of "
        f"at least {min_score:g}; the lineage's group (e.g. 'CD8 T') or name where no type has "
        f"all four; '{UNKNOWN}' where no lineage gate passed"
    )


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


def _detection(
    adata: Any, usable: dict[str, list[str]], clusters: Any, at_least: int = MIN_GENES_DETECTED
) -> pd.DataFrame:
    """Share of each cluster's cells (rows) with ``at_least`` of a set's genes (columns) above
    zero. Zero is zero in counts and in log-normalised values alike; the values are those
    the sets were matched in (.raw where there is one, else the counts layer, else X)."""
    if adata.raw is not None:
        values, names = adata.raw.X, adata.raw.var_names
    else:
        values, names = adata.layers.get("counts", adata.X), adata.var_names
    column = pd.Index(names.astype(str)).get_indexer
    detected = {}
    for name, genes in usable.items():
        hits = (values[:, column(genes)] > 0).sum(axis=1)
        enough = np.asarray(hits).ravel() >= min(at_least, len(genes))
        detected[name] = pd.Series(enough).groupby(clusters.to_numpy()).mean()
    return pd.DataFrame(detected)


def _ranked_genes(
    adata: Any, groupby: str, clusters: Any, top: int, species: str
) -> tuple[dict[str, list[str]], str]:
    """Each cluster's top genes of rank_genes_groups: the step's result in uns when it ranked
    these clusters, else ranked here the same way (Wilcoxon, cluster against the rest); none
    for a single cluster.
    Mitochondrial and ribosomal genes are left out: they follow cell size and quality, not type
    (they fill the top 50 of a tissue sample's T-cell cluster)."""
    stored = adata.uns.get("rank_genes_groups")
    groups = set(clusters.dropna().unique())
    if len(groups) < 2:  # nothing to rank against: the lineage gate labels it
        return {g: [] for g in groups}, ONE_CLUSTER
    if (
        stored is not None
        and stored["params"]["groupby"] == groupby
        and set(stored["names"].dtype.names) == groups
    ):
        names, source = stored["names"], f"rank_genes_groups ({stored['params']['method']})"
    else:
        key = "_annotate_ranked"
        if adata.obs[groupby].dtype.name != "category":  # as rank_genes_groups (the tool) does
            adata.obs[groupby] = adata.obs[groupby].astype(str).astype("category")
        try:
            rank_singlets(adata, groupby, key_added=key, method="wilcoxon")
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
    matched: Matched,
    clusters: Any,
    groupby: str,
    species: str,
    seed: int,
    thresholds: tuple[float, float, int],
) -> tuple[pd.DataFrame, str]:
    """One row per cluster and marker set: its lineage, mean score, detection, detection of its
    defining genes (any one; NaN where it declares none), the set's genes among the cluster's
    top ranked, and whether all reach ``thresholds`` (min_score, min_detection, top_ranked):
    column ``evidence``; and where the ranking came from."""
    min_score, min_detection, top_ranked = thresholds
    usable = matched.sets
    top_genes, ranked_from = _ranked_genes(adata, groupby, clusters, top_ranked, species)
    scores = _cluster_scores(adata, usable, clusters, seed)
    detection = _detection(adata, usable, clusters)
    defining = _detection(adata, matched.defining, clusters, at_least=1)
    table = pd.DataFrame(
        [
            {
                "cluster": cluster, "cell_type": name, "lineage": matched.lineage_of[name],
                "score": float(scores.at[cluster, name]),
                "detection": float(detection.at[cluster, name]),
                "defining_detection": (
                    float(defining.at[cluster, name]) if name in defining else np.nan
                ),
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
    table["ranked_from_others"] = ranked_from != ONE_CLUSTER
    table["evidence"] = (
        (table["detection"] >= min_detection)
        & (table["own_ranked"] > 0)
        & (table["score"] >= min_score)
        & ~(table["defining_detection"] < min_detection)  # NaN: no defining genes declared
    )
    return table, ranked_from


def _failed_tests(best: pd.Series, thresholds: tuple[float, float, int]) -> list[str]:
    """Which of the evidence tests a set's row failed, in words."""
    min_score, min_detection, top_ranked = thresholds
    failed = []
    if best["detection"] < min_detection:
        failed.append(f"detection {best['detection']:.0%} < {min_detection:.0%}")
    if best["defining_detection"] < min_detection:
        failed.append(
            f"its defining genes detected in {best['defining_detection']:.0%} < {min_detection:.0%}"
        )
    if not best["ranked_from_others"]:
        failed.append(ONE_CLUSTER)
    elif not best["own_ranked"]:
        failed.append(
            f"none of its own genes (in no other set) in the cluster's top {top_ranked} ranked"
        )
    if best["score"] < min_score:
        failed.append(f"score {best['score']:.3f} < {min_score:g}")
    return failed


def _decide(evidence: pd.DataFrame, thresholds: tuple[float, float, int]) -> dict[str, Any]:
    """A cluster's type from its evidence rows (one per type: score, detection, ranked,
    ``evidence``); ``thresholds`` as in evidence_table, to say which test an Unknown failed."""
    ranked = evidence.sort_values("score", ascending=False)
    qualified = ranked[ranked["evidence"]]
    if ranked.empty:  # a lineage none of whose sets the data can use
        return {"label": UNKNOWN, "score": None, "runner_up": None, "margin": None,
                "ambiguous": False, "reason": "none of its marker sets is usable in these data"}  # fmt: skip
    if qualified.empty:
        best = ranked.iloc[0]
        return {
            "label": UNKNOWN, "score": round(float(best["score"]), 3), "runner_up": None,
            "margin": None, "ambiguous": False,
            "reason": f"best {ranked.index[0]}: " + "; ".join(_failed_tests(best, thresholds)),
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


def _choose_lineage(gates: pd.DataFrame, typed: pd.Series) -> dict[str, Any]:
    """A cluster's lineage from its gate rows (one per lineage) and ``typed`` (lineage -> the
    score of its best type with evidence): of the lineages that passed, those at a level
    within AMBIGUOUS_SHARE of the highest are near-tied (LYZ and CST3 of cDCs pass the myeloid
    gate as high as the DC gate); among them the one whose best type scores highest wins, and
    a runner-up whose type scores within AMBIGUOUS_SHARE of it (or with no type on either side)
    makes the choice ambiguous. So does a possible mix: the chosen gate passed its absent genes
    by level only (their lineage may share the cluster), or another lineage's genes are
    present while the genes it lacks are detected in fewer than MIXED_DETECTION of the cells
    (the strongest such lineage is named). None, with the closest gates and why they failed,
    where none passed."""
    passed = gates[gates["passed"]]
    if passed.empty:
        closeness = gates["present_detection"] * gates["present_level"]
        closest = gates.loc[closeness.sort_values(ascending=False).index[:2], "gate"]
        return {"lineage": None, "reason": "no lineage gate passed: " + "; ".join(closest)}
    level = passed["present_level"]
    near = passed[level >= (1 - AMBIGUOUS_SHARE) * level.max()]
    order = near.assign(typed=near["lineage"].map(typed).fillna(-np.inf)).sort_values(
        ["typed", "present_level", "present_detection"], ascending=False
    )
    best = order.iloc[0]
    chosen = {"lineage": best["lineage"], "gate": best["gate"], "runner_up": None}
    others = passed[passed["lineage"] != best["lineage"]]
    if not others.empty:
        chosen["runner_up"] = others.sort_values("present_level").iloc[-1]["lineage"]
    if len(order) > 1:
        second = order.iloc[1]
        chosen["runner_up"] = second["lineage"]
        untyped = np.isinf(best["typed"]) or np.isinf(second["typed"])
        close = second["typed"] >= best["typed"] - AMBIGUOUS_SHARE * abs(best["typed"])
        chosen["ambiguous"] = bool(untyped or close)
    if chosen.get("ambiguous"):
        return chosen
    sharing = gates[
        gates["present_ok"] & ~gates["absent_ok"]
        & (gates["absent_detection"] < MIXED_DETECTION) & (gates["lineage"] != best["lineage"])
    ]  # fmt: skip
    if best["mixed"]:
        owner = best["lacked_of"] or chosen["runner_up"] or "the lineage of its absent genes"
        chosen.update(runner_up=owner, ambiguous=True)
    elif not sharing.empty:
        strongest = sharing.sort_values(["present_level", "present_detection"]).iloc[-1]
        chosen.update(runner_up=strongest["lineage"], ambiguous=True)
    return chosen


def _group(detection: pd.Series, min_detection: float) -> dict[str, Any] | None:
    """The lineage's group (e.g. 'CD8 T') whose defining genes the most cells detect, where at
    least ``min_detection`` do; ambiguous when another reaches it within AMBIGUOUS_SHARE."""
    reached = detection[detection >= min_detection].sort_values(ascending=False)
    if reached.empty:
        return None
    best = float(reached.iloc[0])
    group = {"label": reached.index[0], "group_detection": round(best, 2), "ambiguous": False}
    if len(reached) > 1:
        second = float(reached.iloc[1])
        group.update(runner_up=reached.index[1], ambiguous=second >= (1 - AMBIGUOUS_SHARE) * best)
    return group


def _label(
    evidence: pd.DataFrame,
    gates: pd.DataFrame | None,
    groups: dict[str, pd.Series],
    thresholds: tuple[float, float, int],
) -> dict[str, Any]:
    """A cluster's label: its lineage first (where the markers have lineages), then the type
    with evidence inside it; where no type has, the lineage's group whose defining genes are
    detected (``groups``: lineage -> detection per group label), else the lineage's name;
    Unknown, naming the failed gates, where no lineage passed."""
    if gates is None:
        return _decide(evidence, thresholds)
    typed = evidence[evidence["evidence"]].groupby("lineage")["score"].max()
    chosen = _choose_lineage(gates, typed)
    lineage = chosen["lineage"]
    if lineage is None:
        best = evidence.sort_values("score", ascending=False)
        return {
            "label": UNKNOWN, "lineage": None, "score": round(float(best["score"].iloc[0]), 3),
            "runner_up": None, "margin": None, "ambiguous": False, "reason": chosen["reason"],
        }  # fmt: skip
    entry = _decide(evidence[evidence["lineage"] == lineage], thresholds)
    if entry["label"] == UNKNOWN:  # the lineage is certain, its subtype is not
        entry.update(label=lineage, subtype_unknown=entry.pop("reason"))
        group = _group(groups.get(lineage, pd.Series(dtype=float)), thresholds[1])
        if group is not None:
            entry.update(group)
    entry.update(lineage=lineage, lineage_gate=chosen["gate"])
    if chosen["runner_up"] is not None:
        entry["runner_up_lineage"] = chosen["runner_up"]
    if chosen.get("ambiguous"):  # a near-tie across lineages outweighs one inside a lineage
        entry.update(ambiguous=True, runner_up=chosen["runner_up"], margin=None)
    return entry


def gate(
    adata: ad.AnnData,
    genes: ad.AnnData,
    matched: Matched,
    evidence_of: pd.Series,
    table: pd.DataFrame,
) -> tuple[pd.DataFrame | None, dict[str, pd.DataFrame]]:
    """The lineage gates of each cluster (agent/tools/lineage.py) and the detection of each
    lineage's groups; marks `table` (the cluster x type evidence) with `lineage_passed` and
    `qualified` (evidence and a passed gate). Without lineages, evidence alone qualifies."""
    if not matched.lineages:
        table["qualified"] = table["evidence"]
        return None, {}
    gates = lineage_table(genes.X, genes.var_names.astype(str), evidence_of, matched.lineages)
    defined = {
        (lineage, label): members
        for lineage, spec in matched.lineages.items()
        for label, members in spec["groups"].items()
    }
    detected = _detection(adata, defined, evidence_of, at_least=1)
    groups = {
        lineage: detected[[k for k in defined if k[0] == lineage]].T.droplevel(0)
        for lineage in {k[0] for k in defined}
    }
    passed = gates.set_index(["cluster", "lineage"])["passed"]
    table["lineage_passed"] = [
        bool(passed.get((c, lineage), False))
        for c, lineage in zip(table["cluster"], table["lineage"], strict=True)
    ]
    table["qualified"] = table["evidence"] & table["lineage_passed"]
    return gates, groups


@tool(
    "annotate", needs=("normalize",), expensive=True, stage="labels", clustering="groupby",
    loosens={"min_score": "lower", "min_detection": "lower", "top_ranked": "higher"},
)  # fmt: skip
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
    """Label each cluster with its lineage and, where marker genes give evidence, its cell type.

    The lineage (T, NK, B, plasma, myeloid, DC, HSPC, erythroid, platelet, mast,
    proliferating) needs its genes present and the genes it lacks absent (NK: no CD3); no
    lineage: 'Unknown', naming the failed gates. Within it, the best-scoring type whose genes
    and a defining gene (CD8A/B for CD8 T) are detected in enough cells, with a high enough
    score and one of its own genes among the cluster's top ranked genes (call
    rank_genes_groups first); else the lineage's group (e.g. 'CD8 T') or name. Flagged
    ambiguous ('A|B') on a near-tie of lineages or types, or where another lineage may share
    the cluster. Marker sets: human or mouse immune types by the genes' species, or a JSON
    file ({"cell_types": {...}}, optionally "lineages" and "defining_genes" as in the
    built-in files). Writes obs[key_added], obs[key_added + '_ambiguous'] and
    uns['annotation'].

    Args:
        groupby: Cell annotation (obs column) with the clusters.
        markers_file: JSON file of marker sets inside the output folder; leave out for the
            built-in sets.
        key_added: Cell annotation (obs column) to store the labels in.
        min_score: Lowest mean score a type needs in a cluster.
        min_detection: Lowest share of a cluster's cells that must detect the type's genes.
        top_ranked: How many of the cluster's top ranked genes are searched for the type's genes.
        limit: Clusters listed at most in the result.
    """
    # How the evidence is measured (comments, not sent to the model): the lineage gate is
    # agent/tools/lineage.py's; a type's score is score_genes' mean (the set's mean minus that
    # of matched control genes, log-normalised values), its detection the share of cells with
    # MIN_GENES_DETECTED of its genes and one defining gene; a set without any defining gene in
    # the data is not used, nor a lineage whose genes are not (sets_skipped, lineages_skipped).
    # uns['annotation'] keeps the cluster x type table ('table') and the cluster x lineage gates
    # ('lineage_table'). Predicted doublets kept by a run that flags them give no evidence and
    # take their cluster's label. One cluster: no ranking, so the gate labels it.
    adata = session.adata
    clusters = obs_column(
        adata, groupby, "annotate_clusters", "call leiden first (or give another groupby)"
    ).astype(str)
    genes = all_genes(adata)
    names = genes.var_names.astype(str)
    species = detect_species(names)
    markers = load_markers(session, markers_file, species["species"])
    # genes a gene filter removed as detected in too few cells were measured: absent, not unknown
    undetected = (adata.uns.get("filter_genes") or {}).get("undetected_genes", [])
    matched = match(markers, names, undetected)
    if not matched.sets:
        raise ToolError(_none_usable(matched, names))
    thresholds = (min_score, min_detection, top_ranked)
    # the evidence comes from the cells not flagged as doublets; the label goes to all
    doublets = flagged(adata)
    evidence_of = clusters.where(~doublets)
    table, ranked_from = evidence_table(
        adata, matched, evidence_of, groupby, species["species"], session.seed, thresholds
    )
    gates, groups = gate(adata, genes, matched, evidence_of, table)
    cluster_sizes = clusters.value_counts()
    result = {}
    for cluster, evidence in table.groupby("cluster", sort=False):
        cluster_gates = None if gates is None else gates[gates["cluster"] == cluster]
        cluster_groups = {lineage: by_group[cluster] for lineage, by_group in groups.items()}
        entry = _label(evidence.set_index("cell_type"), cluster_gates, cluster_groups, thresholds)
        best = evidence.nlargest(TOP_TYPES, "score")
        entry["top_types"] = [
            f"{r.cell_type}: score {r.score:.2f}, detected {r.detection:.0%}, {len(r.ranked)} ranked"
            for r in best.itertuples()
        ]
        entry["n_cells"] = int(cluster_sizes[cluster])
        result[cluster] = entry
    for cluster in sorted(set(clusters) - set(result), key=_natural):  # doublets only
        result[cluster] = {
            "label": UNKNOWN, "ambiguous": False, "margin": None, "lineage": None,
            "reason": "every cell is a flagged doublet: no evidence",
            "n_cells": int(cluster_sizes[cluster]),
        }  # fmt: skip
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
    lineages = {
        "lineages": {n: {k: s[k] for k in ("present", "absent")} for n, s in matched.lineages.items()},
        "lineage_rule": gate_rule() if gates is not None else "no lineages in the marker file",
    }  # fmt: skip
    adata.uns["annotation"] = {
        "groupby": groupby, "key_added": key_added, "source": markers.where,
        "species": species["species"], "markers": matched.sets, "cluster_labels": mapping,
        "cluster_lineages": {c: e.get("lineage") or UNKNOWN for c, e in result.items()},
        "margins": {c: e["margin"] for c, e in result.items() if e["margin"] is not None},
        "ambiguous": ambiguous, "ambiguity_rule": AMBIGUITY_RULE, "rule": rule,
        "unknown_reasons": unknown, "ranked_from": ranked_from, **lineages,
        "sets_skipped": matched.sets_skipped, "lineages_skipped": matched.lineages_skipped,
        "thresholds": {
            "min_score": min_score, "min_detection": min_detection, "top_ranked": top_ranked,
            "min_genes_detected": MIN_GENES_DETECTED, "ambiguous_share": AMBIGUOUS_SHARE,
        },
        "table": stored,
    }  # fmt: skip
    if gates is not None:
        adata.uns["annotation"]["lineage_table"] = gates
    listed = dict(list(result.items())[:limit])
    return {
        "groupby": groupby,
        "key_added": key_added,
        "species": species["species"],
        "species_evidence": species["evidence"],
        "marker_sets": markers.where,
        "sets_used": {name: len(genes) for name, genes in matched.sets.items()},
        "sets_skipped": matched.sets_skipped,
        "genes_missing": {name: genes[:10] for name, genes in matched.missing.items()},
        **lineages,
        "lineages_skipped": matched.lineages_skipped,
        "rule": rule,
        "ranked_from": ranked_from,
        "clusters": listed,
        "left_out": left_out(len(result), limit, "clusters"),
        "ambiguous": ambiguous,
        "ambiguity_rule": AMBIGUITY_RULE,
        "unknown": unknown,
        "label_sizes": sizes(adata.obs[key_added]),
        "doublets_excluded": int(doublets.sum()),
    }


def _none_usable(matched: Matched, names: Any) -> str:
    """Why no marker set can be used, naming the lineages that could not be judged."""
    example = ", ".join(sorted(names)[:3])
    said = (
        f"annotate_clusters: no marker set has {MIN_GENES_PER_SET} or more of its genes (and one "
        f"of its defining genes) in the data and a lineage that can be judged (data gene names "
        f"look like: {example})"
    )
    if matched.lineages_skipped:
        said += "; lineages not judged: " + "; ".join(
            f"{name}: {why}" for name, why in list(matched.lineages_skipped.items())[:4]
        )
    return said + "; give a markers_file with symbols the data use"


def _natural(label: str) -> tuple[int, str]:
    """Cluster '10' after '9'."""
    return (int(label), "") if label.isdigit() else (1 << 30, label)
