"""A sample's checks as the report shows them (agent/checks.py makes them): ordered worst first,
counted, and, where the record holds none, computed from its steps and marked so.

A record keeps its checks in ``meta.checks``, written when its run concludes. A record without
them (made before checks existed, or a run that broke off, or is still running) gets those
``agent.checks.collect`` finds in its steps: the checks its tools put in their results, and the
repeated filters and doubtful labels of the record as a whole; ``source`` says which.
The annotation's own flags (ambiguous clusters with their runner-up, Unknown clusters with the
reason, CellTypist's weak clusters) are read from its results, for the page beside the labels.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import ValidationError

from agent.checks import ANNOTATIONS, Check, collect

Source = Literal["record", "computed", "none"]
# The cohort table's columns: the worst verdict, how many checks were refused and warned, the
# rules that were, and whether the record held the checks or the report computed them.
COLUMNS = ("checks_worst", "checks_refused", "checks_warn", "checks_rules", "checks_from")
ORDER = {"refused": 0, "warn": 1, "pass": 2}  # the order of the page's list: worst first
SOURCES: dict[Source, str] = {
    "record": "the record's own (meta.checks)",
    "computed": "computed by the report from the record's steps: the record holds no checks "
    "(it was made before checks existed, or its run did not conclude); a record made before "
    "checks has only those its steps show (repeated filters, doubtful labels)",
    "none": "no record, no checks",
}


@dataclass(frozen=True)
class SampleChecks:
    """The checks of one sample, worst first (refused, warn, pass; by step within each)."""

    checks: list[Check] = field(default_factory=list)
    source: Source = "none"
    note: str | None = None  # why the record's own checks were not used, where they were not

    @classmethod
    def of(cls, world: Any) -> SampleChecks:
        """From a loaded WorldState (None: no record); never raises for a record's content."""
        if world is None:
            return cls()
        recorded = world.meta.get("checks")
        note = None
        if recorded is not None:
            try:
                return cls(_ordered(Check.model_validate(c) for c in recorded), "record")
            except (ValidationError, TypeError) as e:  # an edited record: say so, still check
                note = f"the record's meta.checks is not a list of checks ({_first_line(e)})"
        try:
            return cls(_ordered(collect(world.entries)), "computed", note)
        except (ValidationError, TypeError) as e:
            return cls([], "computed", f"a step's checks are unreadable ({_first_line(e)})")

    @property
    def flagged(self) -> list[Check]:
        """The checks that warned or were refused, worst first."""
        return [c for c in self.checks if c.verdict != "pass"]

    def count(self, verdict: str) -> int:
        return sum(c.verdict == verdict for c in self.checks)

    @property
    def worst(self) -> str | None:
        """refused, warn or pass; None where there are no checks."""
        return self.checks[0].verdict if self.checks else None

    @property
    def rules_flagged(self) -> list[str]:
        """The rules that warned or were refused, each once, worst first."""
        return list(dict.fromkeys(c.rule for c in self.flagged))

    def repeated_filters(self) -> dict[str, dict[str, Any]]:
        """Filter tool -> the filter_repeated check's evidence (steps, effective thresholds)."""
        return {c.tool: c.evidence for c in self.checks if c.rule == "filter_repeated" and c.tool}

    def columns(self) -> dict[str, Any]:
        """The cohort table's check columns (COLUMNS); blank without a record."""
        if self.source == "none":
            return dict.fromkeys(COLUMNS)
        values = (
            self.worst, self.count("refused"), self.count("warn"),
            "; ".join(self.rules_flagged) or None, self.source,
        )  # fmt: skip
        return dict(zip(COLUMNS, values, strict=True))

    def summary(self) -> str:
        """'1 refused, 2 warn' (the flagged counts), 'pass', 'none', or '' without a record;
        '(computed)' after it where the report computed them."""
        if self.source == "none":
            return ""
        counts = [f"{n} {v}" for v in ("refused", "warn") if (n := self.count(v))]
        text = ", ".join(counts) or ("pass" if self.checks else "none")
        return text + (" (computed)" if self.source == "computed" else "")


def _ordered(checks: Iterable[Check]) -> list[Check]:
    return sorted(checks, key=lambda c: (ORDER[c.verdict], c.step is None, c.step or 0))


def _first_line(e: Exception) -> str:
    return str(e).splitlines()[0]


# The annotation tools whose results flag labels.


def label_flags(entries: list[Any]) -> list[dict[str, Any]]:
    """The flags of the last successful call of each annotation tool, cluster by cluster:
    ``{"tool", "step", "cluster", "label", "flag", "detail"}``, flag one of ``ambiguous``
    (a runner-up within the margin), ``Unknown`` (no type with evidence: the reason),
    ``lineage only`` (the lineage is certain, its subtype is not) and ``weak`` (CellTypist's
    vote share or confidence below its bounds)."""
    out = []
    for tool in ANNOTATIONS:
        entry = next((e for e in reversed(entries) if e.tool == tool and e.status == "ok"), None)
        result = entry.result if entry is not None and isinstance(entry.result, dict) else None
        if result is None:
            continue
        listed = result.get("clusters") if isinstance(result.get("clusters"), dict) else {}
        for cluster, flag, detail in _flags_of(tool, result, listed):
            label = (listed.get(cluster) or {}).get("label")
            out.append({
                "tool": tool, "step": entry.step, "cluster": cluster, "label": label,
                "flag": flag, "detail": detail,
            })  # fmt: skip
    return out


def _flags_of(tool: str, result: dict[str, Any], listed: dict[str, Any]) -> Iterable[tuple]:
    """(cluster, flag, detail) for each flagged cluster of one annotation result."""
    if tool == "annotate_celltypist":
        for cluster in map(str, result.get("weak_clusters") or ()):
            got = listed.get(cluster) or {}
            detail = (
                f"majority {got.get('majority')}, vote share {got.get('vote_share')}, mean "
                f"confidence {got.get('mean_confidence')}; {result.get('rule', '')}"
                if got
                else "weak evidence (the cluster is not listed in the result)"
            )
            yield cluster, "weak", detail
        return
    for cluster, pair in (result.get("ambiguous") or {}).items():
        got = listed.get(str(cluster)) or {}
        best, _, runner_up = str(pair).partition("|")
        yield str(cluster), "ambiguous", f"{best} or the runner-up {runner_up}{_tie(got)}"
    for cluster, reason in (result.get("unknown") or {}).items():
        yield str(cluster), "Unknown", str(reason)
    for cluster, got in listed.items():
        if isinstance(got, dict) and got.get("subtype_unknown"):
            yield str(cluster), "lineage only", str(got["subtype_unknown"])


def _tie(got: dict[str, Any]) -> str:
    """What tied, where the cluster's entry says (annotate.py: a score margin between types, or
    a near-tie of lineages, or of a lineage's groups by detection)."""
    if got.get("margin") is not None:
        return f" (score {got.get('score')}, margin {got['margin']})"
    if got.get("runner_up_lineage") and got.get("runner_up") == got["runner_up_lineage"]:
        return " (lineages near-tied)"
    if "group_detection" in got:
        return f" (the lineage's groups near-tied, detected in {got['group_detection']:.0%})"
    return ""
