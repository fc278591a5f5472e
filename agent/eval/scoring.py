"""A decision judged at its point: executed on a copy of the session as it was there, then held
against the point's tools and bounds, the stage its tool must reach, and the checks of its result
(agent/checks.py). The recipe's own call goes through the same judge; the checks it fails alike
at its point (``Point.tolerated``) are the data's, not the decision's."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent.eval.points import KIND_OF_TOOL, Point
from agent.record.layout import SampleLayout
from agent.registry import ToolRegistry, jsonable


def scratch(session: Any, folder: Path) -> Any:
    """A copy of ``session`` writing into ``folder``: the decision runs there, not on the walk."""
    copied = copy.copy(session)  # every setting of the run (seed, input, model, options)
    folder.mkdir(parents=True, exist_ok=True)
    copied.outdir, copied.layout = folder.resolve(), SampleLayout(folder.resolve())
    copied.adata = session.adata.copy() if session.has_data else None
    copied.done, copied.stages, copied.stale = (
        set(session.done),
        dict(session.stages),
        dict(session.stale),
    )
    return copied


def judge(
    point: Point,
    decision: Any,
    session: Any,
    registry: ToolRegistry,
    folder: Path,
    bounds_for: Callable[[str], dict[str, list[float]]],
) -> dict[str, Any]:
    """The verdict on ``decision`` at ``point``, before the checks the recipe's own call fails
    alike are forgiven (``settle``). ``bounds_for(kind)``: that kind's bounds at this point, for
    a decision of another kind than the point's (leiden at a next-step point)."""
    if not decision.calls:
        reason = decision.text if decision.finish_reason == "context overflow" else None
        return {"acceptable": False, "doubts": [], "tool": None,
                "why": reason or f"no tool call ({decision.finish_reason})"}  # fmt: skip
    call = decision.calls[0]
    shown = {"tool": call.name, "arguments": _parsed(call.arguments), "doubts": []}
    if call.name not in point.tools:
        return {"acceptable": False, "why": f"{call.name} is not among {', '.join(point.tools)}: "
                f"{point.rule}", **shown}  # fmt: skip
    work = scratch(session, folder)
    outcome = registry.call(call.name, call.arguments, work)
    if not outcome.ok:
        return {"acceptable": False, "why": f"{call.name} failed: {outcome.error}", **shown}
    result = outcome.result or {}
    kind = KIND_OF_TOOL.get(call.name)
    bounds = point.bounds if kind in (None, point.kind) else bounds_for(kind)
    for name, (low, high) in bounds.items():
        value = outcome.params.get(name, result.get(name))
        if name == "n_pcs" and value is None:  # neighbors on every component computed
            value = high
        if value is None or not low <= value <= high:
            return {"acceptable": False, "why": f"{name}={value} outside {low}-{high}", **shown}
    stage = registry.spec(call.name).stage
    missing = work.missing_stages()
    if stage and stage in missing:
        return {"acceptable": False, "why": f"{stage} not reached: {missing[stage]}", **shown}
    if point.kind == "finish" and result.get("status") != "finished":
        return {"acceptable": False, "why": f"finish said {result.get('status')}", **shown}
    doubts = [c for c in result.get("checks", []) if c.get("verdict") != "pass"]
    if doubts:
        said = "; ".join(c["message"] for c in doubts)
        return {**shown, "acceptable": False, "why": f"its checks: {said}",
                "doubts": sorted({c["rule"] for c in doubts})}  # fmt: skip
    return {"acceptable": True, "why": point.rule, **shown}


def settle(verdict: dict[str, Any], tolerated: list[str]) -> dict[str, Any]:
    """The verdict once the point's ``tolerated`` rules are known: a decision failing only
    checks the recipe's own call fails alike there is acceptable."""
    doubts = verdict.get("doubts") or []
    if not verdict["acceptable"] and doubts and set(doubts) <= set(tolerated):
        return {**verdict, "acceptable": True,
                "why": f"{verdict['why']} (the recipe's own call is flagged alike here)"}  # fmt: skip
    return verdict


def _parsed(arguments: str) -> Any:
    """The arguments as JSON where they are (plain JSON types: an integer beyond 64 bits, as a
    random model writes, stays text); else the text as sent."""
    try:
        return jsonable(json.loads(arguments or "{}"))
    except (ValueError, TypeError):
        return arguments
