"""``finish``: the final object, written only for a complete analysis (or one said to be partial),
and its conclusion held against the object."""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import Field

from agent.checks import check
from agent.record.durable import atomic_write_h5ad
from agent.registry import Refusal, tool
from agent.tool_declarations import DECLARED
from agent.tools.common import sizes
from agent.tools.session import Session

# A count of clusters the conclusion states: "12 clusters", "8 Leiden clusters", "9 distinct
# cell clusters".
CLUSTER_COUNT = re.compile(r"\b(\d+)\s+(?:[A-Za-z-]+\s+){0,2}clusters?\b", re.IGNORECASE)


@tool("finish", mutates=False)
def finish(
    session: Session,
    conclusion: Annotated[str, Field(max_length=4000)] = "",
    partial: Annotated[str, Field(min_length=1, max_length=1000)] | None = None,
) -> dict[str, Any]:
    """Finish the analysis: write the final adata.h5ad and return a summary.

    Refused until every stage is done on the current data; its error lists what is missing. If
    the analysis cannot be completed, give partial: the run then ends 'partial'. The conclusion
    is checked against the object. Nothing runs after finish. Writes uns['analysis'] (status,
    stages reached and missing, the partial reason).

    Args:
        conclusion: What the analysis found, for the record.
        partial: Why the analysis cannot be completed (missing stages are then accepted).
    """
    adata = session.adata
    missing = session.missing_stages()
    needed = {stage: f"{why} ({' or '.join(reaching(stage))})" for stage, why in missing.items()}
    if missing and partial is None:
        raise Refusal(
            check(
                "complete",
                "refused",
                "finish refused: the analysis is not complete; missing: "
                + "; ".join(f"{stage}: {why}" for stage, why in needed.items())
                + ". Do these first, or call finish with partial='why' if it cannot be completed",
                missing=needed,
                reached=_reached(session),
            )
        )
    # partial only where something is missing: a complete analysis is finished, whatever was said
    status = "partial" if missing else "finished"
    if missing:
        complete = check(
            "complete", "warn", f"partial: {partial}; missing: {', '.join(needed)}",
            missing=needed, reached=_reached(session), reason=partial,
        )  # fmt: skip
    elif partial is not None:
        complete = check(
            "complete", "warn", f"every stage was reached, yet partial was given ({partial}): "
            "finished; a reader should see why the model thought otherwise",
            reached=_reached(session), reason=partial,
        )  # fmt: skip
    else:
        complete = check(
            "complete", "pass", f"every stage reached: {', '.join(_reached(session))}",
            reached=_reached(session),
        )  # fmt: skip
    adata.uns["analysis"] = {
        "status": status,
        "stages": _reached(session),
        "missing": needed,
        **({"partial_reason": partial} if missing else {}),
    }
    target = session.layout.final
    atomic_write_h5ad(adata, target)
    summary: dict[str, Any] = {
        "status": status,
        "path": str(target.relative_to(session.outdir)),
        "n_cells": adata.n_obs,
        "n_genes": adata.n_vars,
        "steps_done": sorted(session.done),
        "missing": needed,
        "conclusion": conclusion,
    }
    clustering = _current_clustering(session)
    for key in dict.fromkeys(k for k in (clustering, "leiden", "cell_type") if k):
        if key in adata.obs.columns:
            summary[f"{key}_sizes"] = sizes(adata.obs[key])
    clusters = summary.get(f"{clustering}_sizes") if clustering else None
    summary["n_clusters"] = len(clusters) if clusters is not None else 0
    summary["checks"] = [complete, conclusion_check(conclusion, summary["n_clusters"], adata)]
    return summary


def reaching(stage: str) -> list[str]:
    """The agent's tools declared (``@tool(stage=...)``) to reach ``stage``."""
    return [name for name, declared in DECLARED.items() if declared.stage == stage]


def _reached(session: Session) -> dict[str, str]:
    """Stage -> the tool that reached it on the current data."""
    return {stage: got["tool"] for stage, got in session.stages.items()}


def _current_clustering(session: Session) -> str | None:
    return (session.stages.get("clusters") or {}).get("clustering")


def label_columns(adata: Any) -> list[str]:
    """The obs columns that hold cell-type labels, as the annotation tools recorded them."""
    keys = [
        (adata.uns.get(key) or {}).get("key_added")
        for key in ("annotation", "annotation_celltypist")
    ]
    return [k for k in dict.fromkeys([*keys, "cell_type"]) if k and k in adata.obs.columns]


def _vocabulary(adata: Any) -> set[str]:
    """Every cell-type name the conclusion could mean: the marker sets' names (of the data's
    species), the labels the object holds and the reference model's predictions."""
    from agent.tools.annotate import default_marker_sets  # the sets' names only
    from agent.tools.species import detect_species

    names = set(default_marker_sets(detect_species(adata.var_names)["species"]))
    markers = (adata.uns.get("annotation") or {}).get("markers")
    if isinstance(markers, dict):
        names |= set(markers)
    for key in [*label_columns(adata), "cell_type_predicted"]:
        if key in adata.obs.columns:
            names |= {str(v) for v in adata.obs[key].unique()}
    return {n for n in names if n and n != "Unknown"}


def _named_types(conclusion: str, vocabulary: set[str]) -> set[str]:
    """The cell types a conclusion names: whole names of the vocabulary, and '<word> cells'
    where the word is a word of those names ('T cells', 'NK cells')."""
    found = set()
    for name in vocabulary:
        short = len(name) <= 2  # 'B', 'NK', 'DC': a type only as 'B cells'
        suffix = r"s?\s+cells?" if short else ""
        pattern = rf"(?<![\w-]){re.escape(name)}{suffix}(?![\w-])"
        if re.search(pattern, conclusion, re.IGNORECASE):
            found.add(name)
    words = {w for name in vocabulary for w in name.split()}
    for word in re.findall(r"([\w+-]+)\s+cells?\b", conclusion):
        match = next((w for w in words if w.lower() == word.lower().rstrip("s")), None)
        if match is None:
            match = next((w for w in words if w.lower() == word.lower()), None)
        if match is not None:
            found.add(match)
    return found


def conclusion_check(conclusion: str, n_clusters: int, adata: Any) -> dict[str, Any]:
    """The conclusion's cluster counts and cell types held against the object: a warning names
    what it states that the object does not hold."""
    counts = sorted({int(n) for n in CLUSTER_COUNT.findall(conclusion)})
    labels = {
        str(v) for key in label_columns(adata) for v in adata.obs[key].unique() if v != "Unknown"
    }
    # the runner-ups of ambiguous clusters ('A|B'), which the object keeps as flagged alternatives
    ambiguous = (adata.uns.get("annotation") or {}).get("ambiguous") or {}
    labels |= {name for pair in ambiguous.values() for name in str(pair).split("|")}
    label_words = {w.lower() for label in labels for w in re.split(r"[\s|]+", label)}
    named = _named_types(conclusion, _vocabulary(adata))
    lowered = {label.lower() for label in labels}
    absent = sorted(n for n in named if n.lower() not in lowered and n.lower() not in label_words)
    # a count of clusters of one kind ("3 T cell clusters") is no total: only where no stated
    # count is the object's is the total wrong
    wrong_counts = counts if counts and n_clusters not in counts else []
    evidence = {
        "clusters_stated": counts,
        "clusters_in_object": n_clusters,
        "types_stated": sorted(named),
        "types_not_in_object": absent,
        "labels_in_object": sorted(labels),
    }
    if wrong_counts or absent:
        said = []
        if wrong_counts:
            said.append(
                f"it states {', '.join(map(str, wrong_counts))} clusters, the object holds "
                f"{n_clusters}"
            )
        if absent:
            said.append(f"it names {', '.join(absent)}, which no label of the object is")
        return check(
            "conclusion",
            "warn",
            "the conclusion disagrees with the object: " + "; ".join(said),
            **evidence,
        )
    return check(
        "conclusion",
        "pass",
        "the conclusion's cluster counts and cell types agree with the object"
        if counts or named
        else "the conclusion states no cluster count or cell type",
        **evidence,
    )
