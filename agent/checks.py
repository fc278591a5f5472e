"""The checks of a model's decisions: each decision held against the data, with its evidence.

A check is a claim about one step (or the record) with the numbers behind it and a verdict:
``pass``, ``warn`` (the step ran; a reader should look) or ``refused`` (the tool would not run
the step, or the loop would not run it after ``finish``). Tools put the checks of their own
decisions in their result under ``checks`` (a refused call keeps its check in the error entry's
result), so the model reads them as it goes; ``collect`` gathers them from a record, adds the
checks of the record as a whole, and the runner keeps the list in ``meta.checks`` (the report,
the RO-Crate read it there).

Every rule is named in ``RULES`` with what it checks; docs/methods.md cites them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from agent.tool_declarations import DECLARED, LOAD

Verdict = Literal["pass", "warn", "refused"]
Rule = Literal[
    "complete", "after_finish", "removed_share", "qc_bound", "filter_repeated",
    "evidence_settings", "clustering_unswept", "ambiguous_labels", "conclusion", "ambient_estimate",
]  # fmt: skip

# Above these shares of the cells (or genes) a filter removes, it warns / is refused unless the
# call gives an override_reason (then it runs, with a warning that keeps the reason).
WARN_REMOVED = 0.5
REFUSE_REMOVED = 0.9
# A QC threshold this many times stricter or looser than the bound qc_metrics derived from the
# data (and acting on at least MIN_AFFECTED of the cells differently) is a warning.
QC_FACTOR = 2.0
MIN_AFFECTED = 0.01
# A clustering chosen without cluster_sweep where the silhouette is below this: weak structure.
UNSWEPT_SILHOUETTE = 0.1
# Labels of which most cells are Unknown: the marker sets fit the sample too badly to label it.
UNKNOWN_SHARE = 0.5

RULES: dict[Rule, str] = {
    "complete": "finish succeeds only when every stage of an analysis was reached on the current "
    "data; a finish with partial=REASON ends the run 'partial' (warn) with the stages missing",
    "after_finish": "nothing runs after a successful finish: later calls of its reply are refused",
    "removed_share": f"a filter removing over {WARN_REMOVED:.0%} of the cells or of the detected "
    f"genes (in one call, or since the data were first filtered) warns; over {REFUSE_REMOVED:.0%} "
    "it is refused unless the call gives an override_reason (kept here)",
    "qc_bound": f"a QC threshold over {QC_FACTOR:g}x stricter or looser than the bound qc_metrics "
    f"derived from the data, changing the fate of at least {MIN_AFFECTED:.0%} of the cells, warns; "
    f"so does a filter that leaves {MIN_AFFECTED:.0%} or more cells outside the derived genes or "
    "mitochondrial bounds",
    "filter_repeated": "a filter applied again composes with the earlier ones: the effective "
    "(strictest) thresholds are those in force, and the repetition is flagged",
    "evidence_settings": "annotation thresholds loosened below their defaults warn, naming both",
    "clustering_unswept": f"a clustering chosen without cluster_sweep where the silhouette is below "
    f"{UNSWEPT_SILHOUETTE:g} (weak structure) warns",
    "ambiguous_labels": "clusters whose best label has a runner-up within the ambiguity margin, "
    f"or whose evidence is weak, are flagged, and labels leaving over {UNKNOWN_SHARE:.0%} of the "
    "cells Unknown",
    "conclusion": "finish's conclusion is compared with the object written: cluster counts and "
    "cell types it names that the object does not hold are flagged",
    "ambient_estimate": "an ambient RNA estimate resting on few estimates (SoupX: under 10 "
    "cluster x marker pairs), a high fraction (over 0.3) or an EM that did not converge warns; "
    "SoupX with no usable marker, or a fraction over 0.5, is refused (decontX instead)",
}


class Check(BaseModel):
    """One check of the record (``meta.checks``), also in the result of the step it concerns."""

    model_config = ConfigDict(extra="forbid")

    rule: Rule = Field(description="What was checked (agent.checks.RULES says each).")
    verdict: Verdict = Field(
        description="pass; warn: the step ran and a reader should look; refused: it did not run"
    )
    message: str = Field(description="One sentence that names the numbers.")
    evidence: dict[str, Any] = Field(description="The numbers behind the verdict.")
    step: int | None = Field(None, description="The step it concerns; null: the whole record.")
    tool: str | None = Field(None, description="The tool of that step.")


def check(rule: str, verdict: Verdict, message: str, **evidence: Any) -> dict[str, Any]:
    """A check as a tool's result carries it (the step is the entry's own)."""
    if rule not in RULES:
        raise ValueError(f"unknown check rule {rule!r}")
    return {"rule": rule, "verdict": verdict, "message": message, "evidence": evidence}


def removed_share(
    tool: str, what: str, before: int, after: int, first: int, override: str | None
) -> dict[str, Any]:
    """The removed_share check of a filter keeping ``after`` of ``before`` cells or genes, of
    ``first`` when the data were first filtered (so a cut split over several calls counts whole);
    refused above REFUSE_REMOVED of either without an override reason."""
    share = (before - after) / before if before else 0.0
    total = (first - after) / first if first else 0.0
    evidence = {
        "removed": before - after, "before": before, "share": round(share, 4),
        "first_filtered_from": first, "share_since_first": round(total, 4),
    }  # fmt: skip
    said = f"{tool} removes {before - after:,} of {before:,} {what} ({share:.1%})"
    if total > share:
        said += f"; {first - after:,} of {first:,} since the first filter ({total:.1%})"
    worst_share = max(share, total)
    if worst_share > REFUSE_REMOVED and not override:
        return check(
            "removed_share", "refused",
            f"{said}, over {REFUSE_REMOVED:.0%}: refused; nothing was changed. Choose thresholds "
            "the data support, or give override_reason='why' to remove them knowingly",
            **evidence, limit=REFUSE_REMOVED,
        )  # fmt: skip
    if worst_share > WARN_REMOVED:
        why = f"; override reason: {override}" if override else ""
        return check(
            "removed_share", "warn", f"{said}, over {WARN_REMOVED:.0%}{why}",
            **evidence, limit=WARN_REMOVED, **({"override_reason": override} if override else {}),
        )  # fmt: skip
    return check("removed_share", "pass", said, **evidence, limit=WARN_REMOVED)


def worst(checks: Iterable[dict[str, Any] | Check]) -> Verdict:
    """The most severe verdict among ``checks`` (pass when there are none)."""
    verdicts = {c.verdict if isinstance(c, Check) else c["verdict"] for c in checks}
    return next((v for v in ("refused", "warn") if v in verdicts), "pass")


def of_entry(entry: Any) -> list[Check]:
    """The checks a step's result carries, with its step and tool."""
    found = (entry.result or {}).get("checks") if isinstance(entry.result, dict) else None
    return [
        Check(**{**c, "step": entry.step, "tool": entry.tool})
        for c in found or ()
        if isinstance(c, dict)
    ]


def collect(entries: Iterable[Any]) -> list[Check]:
    """Every check of a record: those its steps carry, in step order, and those of the record as
    a whole (filters repeated: the effective thresholds)."""
    entries = list(entries)
    found = []
    for e in entries:
        found += of_entry(e)
        if e.tool in ANNOTATIONS and e.status == "ok":
            found.append(_ambiguity(e))
    return found + _repeated_filters(entries)


# The annotation tools, and the keys of their results that name doubtful clusters.
ANNOTATIONS = {"annotate_clusters": "ambiguous", "annotate_celltypist": "weak_clusters"}


def _ambiguity(entry: Any) -> Check:
    """The ambiguous_labels check of an annotation: the clusters its result names as ambiguous
    (a runner-up within the margin) or weak, with their labels, and the share of cells left
    Unknown where that is most of them."""
    result = entry.result or {}
    doubtful = result.get(ANNOTATIONS[entry.tool]) or {}
    if isinstance(doubtful, list):
        doubtful = dict.fromkeys(map(str, doubtful), "weak evidence")
    sizes = result.get("label_sizes") or {}
    cells = sum(v for v in sizes.values() if isinstance(v, int | float))
    unknown = (sizes.get("Unknown") or 0) / cells if cells else 0.0
    said = [f"cluster {k}: {v}" for k, v in doubtful.items()]
    if unknown > UNKNOWN_SHARE:
        said.append(f"{unknown:.0%} of the cells Unknown")
    return Check(
        rule="ambiguous_labels",
        verdict="warn" if said else "pass",
        step=entry.step,
        tool=entry.tool,
        message="labelled with doubt: " + ", ".join(said) if said else "no label in doubt",
        evidence={"clusters": doubtful, "unknown_share": round(unknown, 4)},
    )


def _repeated_filters(entries: list[Any]) -> list[Check]:
    """A filter tool applied more than once to the same data (between two loads): its effective
    thresholds are the strictest of its applications."""
    checks: list[Check] = []
    applied: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    for e in [*entries, None]:  # None: the end, like a load, closes the data's applications
        if e is None or (e.tool == LOAD and e.status == "ok"):
            checks += [_repeated(tool, calls) for tool, calls in applied.items() if len(calls) > 1]
            applied = {}
            continue
        thresholds = (e.result or {}).get("thresholds") if e.status == "ok" else None
        if e.tool in FILTERS and isinstance(thresholds, dict):
            applied.setdefault(e.tool, []).append((e.step, thresholds))
    return sorted(checks, key=lambda c: c.step or 0)


def _repeated(tool: str, calls: list[tuple[int, dict[str, Any]]]) -> Check:
    steps = [s for s, _ in calls]
    effective = strictest([t for _, t in calls])
    return Check(
        rule="filter_repeated",
        verdict="warn",
        step=steps[-1],
        tool=tool,
        message=f"{tool} applied {len(calls)} times (steps {', '.join(map(str, steps))}); "
        f"in force: {effective}",
        evidence={"steps": steps, "effective": effective},
    )


# The filters whose thresholds compose when applied again (agent/tools/filters.py).
FILTERS = tuple(name for name, d in DECLARED.items() if d.kind in ("cell_filter", "gene_filter"))


def strictest(applications: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """The thresholds in force after several applications of a filter: the highest of each
    min_*, the lowest of each max_*."""
    effective: dict[str, Any] = {}
    for thresholds in applications:
        for key, value in thresholds.items():
            if value is None:
                continue
            if key not in effective:
                effective[key] = value
            elif key.startswith("min_"):
                effective[key] = max(effective[key], value)
            else:
                effective[key] = min(effective[key], value)
    return effective


def schema() -> dict[str, Any]:
    """The JSON schema of a check, as the record's schema embeds it (a test keeps them equal)."""
    return Check.model_json_schema()
