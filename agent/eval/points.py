"""Decision points: the moments of a reference analysis where a decision is made, each with the
decisions the data allow and the rule that says so.

A reference analysis of each case (the recipe of agent/policies/reference.py) is walked step by
step; before each of its calls a point is taken: what must be decided there (its ``kind``), the
recipe's own call, and the acceptable set, derived from the data and the session at that moment:

- ``next_step``: the recipe's tool, or one that reaches the earliest stage of an analysis not
  reached yet (agent/registry.py STAGES) with its prerequisites met;
- ``unfiltered``: call_cells before anything counts the barcodes, at an FDR of at most 0.01;
- ``qc_thresholds``: a cell filter whose checks pass: at most half the cells removed, each QC
  threshold within 2x of the bound qc_metrics derived, no QC outliers kept (agent/checks.py);
- ``hvg``: highly variable genes numbering between a quarter of the genes (at most 500) and half
  of them (at most 5,000);
- ``pcs``: neighbours on at least the PCA elbow's components (pca's suggested_n_pcs);
- ``resolution``: a resolution within the range cluster_sweep found every cluster separated and
  stable at (its pick where none was);
- ``annotation``: labels (obs['cell_type']) of the current clustering with evidence thresholds
  not loosened;
- ``finish``: finish, once, when the analysis is complete, with a conclusion the object bears out.

Every decision, the recipe's own included, is executed on the session as it was at its point:
the stage its tool reaches must be reached, and a refusal or a warning of its checks fails it,
except where the recipe's own call is flagged alike (``tolerated``: the data's doing, not the
decision's), so the recipe scores 1 on its own points. A decision of another kind than its point
(leiden where the recipe drew a plot) keeps that kind's bounds. The points of all cases are kept
in agent/eval/points.json (``python -m agent eval --regenerate-points``); an evaluation derives
them again and says where they differ from that file.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from agent.registry import STAGES, ToolRegistry

POINTS_FILE = Path(__file__).with_name("points.json")
Kind = Literal[
    "next_step", "unfiltered", "qc_thresholds", "hvg", "pcs", "resolution", "annotation", "finish"
]  # fmt: skip
KIND_OF_TOOL: dict[str, Kind] = {
    "call_cells": "unfiltered",
    "filter_cells": "qc_thresholds",
    "filter_by_qc": "qc_thresholds",
    "highly_variable_genes": "hvg",
    "neighbors": "pcs",
    "leiden": "resolution",
    "annotate_clusters": "annotation",
    "annotate_celltypist": "annotation",
    "finish": "finish",
}


class Point(BaseModel):
    """One decision point, as agent/eval/points.json keeps it."""

    model_config = ConfigDict(extra="forbid")

    case: str
    step: int  # the step the decision makes (the record before it has step - 1 entries)
    kind: Kind
    reference: dict[str, Any]  # the recipe's call here: {"tool", "arguments"}
    tools: list[str]  # the tools an acceptable decision calls
    bounds: dict[str, list[float]] = {}  # parameter or result -> [low, high], inclusive
    rule: str  # the acceptable set in words
    # check rules the recipe's own call fails here too: the data's, forgiven in every decision
    tolerated: list[str] = []

    @property
    def id(self) -> str:
        return f"{self.case}#{self.step}"


# Each kind's rule in general words (a point's own rule names its numbers).
KIND_RULES: dict[str, str] = {
    "next_step": "the recipe's tool, or one reaching the earliest stage not reached, run cleanly",
    "unfiltered": "call_cells first, at DropletUtils' FDR (at most 0.01)",
    "qc_thresholds": "a cell filter whose checks pass (at most half the cells removed, thresholds "
    "within 2x of qc_metrics' bounds, no QC outliers kept)",
    "hvg": "a quarter (at most 500) to half (at most 5,000) of the genes highly variable",
    "pcs": "at least pca's elbow, at most the components computed",
    "resolution": "within the range cluster_sweep found every cluster separated and stable at",
    "annotation": "cell_type of the current clustering, evidence thresholds not loosened",
    "finish": "finish the complete analysis with a conclusion the object bears out",
}


def bounds_for(kind: str, session: Any, facts: Any, reference: dict[str, Any]) -> dict:
    """The bounds a decision of ``kind`` must keep at this moment (parameter or result name ->
    [low, high]), and their rule in words."""
    if kind == "unfiltered":
        return {"fdr": [0.0, 0.01]}
    if kind == "hvg" and session.has_data:
        genes = session.adata.n_vars
        return {"n_highly_variable": [min(500, genes // 4), min(5000, genes // 2)]}
    if kind == "pcs":
        pca = facts("pca")
        return {"n_pcs": [pca.get("suggested_n_pcs", 1), pca.get("n_comps", 50)]}
    if kind == "resolution":
        sweep = facts("cluster_sweep")
        if not sweep:  # before a sweep nothing bounds it; an unswept weak clustering warns
            return {}
        qualified = [r["resolution"] for r in sweep.get("table", []) if r.get("qualified")]
        best = sweep["best_resolution"]
        return {"resolution": [min(qualified), max(qualified)] if qualified else [best, best]}
    return {}


def derive(
    case: str, step: int, session: Any, registry: ToolRegistry, call: Any, facts: Any
) -> Point:
    """The point before the recipe's ``call`` at ``step``: its kind, tools, bounds and rule,
    from the ``session`` as it is then and ``facts`` (tool -> its latest result)."""
    tool = call.name
    kind = KIND_OF_TOOL.get(tool, "next_step")
    reference = {"tool": tool, "arguments": json.loads(call.arguments or "{}")}
    bounds = bounds_for(kind, session, facts, reference["arguments"])
    shown = "; ".join(f"{k} {lo:g}-{hi:g}" for k, (lo, hi) in bounds.items())
    rule = KIND_RULES[kind] + (f" ({shown})" if shown else "")
    if kind == "next_step":
        tools, rule = _next_tools(session, registry, tool)
    elif kind == "qc_thresholds":
        tools = ["filter_by_qc", "filter_cells"] if "qc_metrics" in session.done else [tool]
    elif kind == "annotation":
        tools = ["annotate_clusters", "annotate_celltypist"]
    else:
        tools = [tool]
    return Point(case=case, step=step, kind=kind, reference=reference, tools=tools,
                 bounds=bounds, rule=rule)  # fmt: skip


def _next_tools(session: Any, registry: ToolRegistry, tool: str) -> tuple[list[str], str]:
    """The recipe's tool and those reaching the earliest stage not reached, prerequisites met."""
    if not session.has_data:
        return ["load_data"], "load the data first"
    missing = session.missing_stages()
    earliest = next((s for s in STAGES if s in missing), None)
    if earliest is None:
        return sorted({tool, "finish"}), "every stage reached: the recipe's step, or finish"
    specs = registry.specs()
    reach = [
        name
        for name, spec in specs.items()
        if spec.stage == earliest and set(spec.needs_for({})) <= session.done
    ]
    rule = f"the recipe's {tool}, or a tool reaching the earliest stage not reached ({earliest})"
    return sorted({tool, *reach}), rule


@dataclass
class Walk:
    """A reference analysis walked step by step: the point before each call, then the call."""

    case: str
    session: Any
    world: Any
    registry: ToolRegistry

    def steps(self) -> Iterator[tuple[Point, Any]]:
        """(point, the recipe's call) before each call; the caller runs ``advance(call)`` before
        asking for the next."""
        from agent.policies.reference import ReferencePolicy

        policy = ReferencePolicy(self.registry)
        for _ in range(200):
            decision = policy.decide([], self.registry.schemas(), self.world)
            if not decision.calls:
                return
            call = decision.calls[0]
            point = derive(self.case, self.world.next_step, self.session, self.registry, call,
                           self.facts)  # fmt: skip
            yield point, call
            if self.world.last_ok("finish") is not None:
                return

    def facts(self, tool: str) -> dict[str, Any]:
        done = self.world.last_ok(tool)
        return (done.result or {}) if done else {}

    def advance(self, call: Any) -> Any:
        """Run the recipe's call on the session and record it."""
        from agent.record.world_state import Entry

        before = self.session.digest()
        outcome = self.registry.call(call.name, call.arguments, self.session)
        entry = self.world.add(Entry(
            **vars(outcome), step=self.world.next_step, digest_before=before,
            digest_after=self.session.digest(), call_id=call.id,
        ))  # fmt: skip
        if outcome.ok:
            entry.checkpoint = self.session.after_step(
                entry.step, outcome.tool, self.registry.spec(outcome.tool)
            )
        return entry


def read(path: Path = POINTS_FILE) -> dict[str, list[Point]]:
    """The versioned points, by case ({} where the file is missing)."""
    if not path.is_file():
        return {}
    doc = json.loads(path.read_text())
    return {case: [Point(**p) for p in points] for case, points in doc["cases"].items()}


def write(points: dict[str, list[Point]], path: Path = POINTS_FILE) -> None:
    doc = {
        "about": "decision points of agent eval (agent/eval/points.py); regenerate with "
        "python -m agent eval --regenerate-points",
        "cases": {case: [p.model_dump() for p in pts] for case, pts in points.items()},
    }
    path.write_text(json.dumps(doc, indent=1) + "\n")


def differences(derived: list[Point], kept: list[Point]) -> list[str]:
    """Where the points derived now differ from the versioned ones of the same case."""
    kept_by_step = {p.step: p for p in kept}
    out = []
    for p in derived:
        other = kept_by_step.pop(p.step, None)
        if other is None:
            out.append(f"{p.id}: not in {POINTS_FILE.name}")
        elif other != p:
            out.append(f"{p.id}: differs from {POINTS_FILE.name}")
    out += [f"{p.id}: in {POINTS_FILE.name} only" for p in kept_by_step.values()]
    return out
