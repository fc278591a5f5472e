"""index.html: one self-contained page (inline CSS, images as base64 PNG, no external URLs)."""

from __future__ import annotations

import math
import re
from collections import defaultdict
from datetime import UTC, datetime
from importlib import resources
from typing import Any

import jinja2
import orjson
import pandas as pd

from agent.report.collect import Sample
from agent.report.drift import Flag
from agent.report.plots import Figure, png_file

# The overview table: column -> header. The TSV holds every column; the page the readable ones.
OVERVIEW = {
    "sample": "sample", "status": "status", "policy": "policy", "model": "model",
    "steps": "steps", "errors": "errors", "cells_before": "cells in", "cells_after": "cells out",
    "cells_kept_fraction": "kept", "doublets_removed": "doublets removed",
    "clusters": "clusters", "labels": "labels", "ari": "ARI", "doublet_recall": "doublet recall",
    "replay": "replay", "iterations": "iterations", "seconds": "seconds",
    "prompt_tokens": "prompt tok.", "completion_tokens": "compl. tok.",
    "cached_tokens": "cached tok.", "truncations": "trunc.",
}  # fmt: skip
RESULT_CHARS = 1200  # longer step results are cut in the page (the world state has them whole)
REPLAY_STEPS_SHOWN = 6  # after a divergence most later steps differ too; replay.json lists all


def fmt(value: Any) -> str:
    """A cell as people read it: no 'nan', floats to 4 significant digits."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict | list):
        return orjson.dumps(value).decode()
    return str(value)


def anchor(name: str) -> str:
    return "s-" + re.sub(r"[^A-Za-z0-9_-]+", "-", name)


def compact(value: Any, limit: int = RESULT_CHARS) -> str:
    text = orjson.dumps(value, option=orjson.OPT_INDENT_2).decode() if value is not None else ""
    return (
        text
        if len(text) <= limit
        else text[:limit] + f"\n… ({len(text) - limit} more characters in the world state)"
    )


def verdict_class(verdict: str | None) -> str:
    if not verdict or verdict == "not replayed":
        return "muted"
    return {"reproduced": "good", "within tolerance": "warn"}.get(verdict, "bad")


def status_class(status: str) -> str:
    return "good" if status == "finished" else "bad"


def _difference(d: dict[str, Any]) -> str:
    def short(v: Any) -> str:
        text = orjson.dumps(v, default=str).decode()
        return text if len(text) <= 80 else text[:79] + "…"

    text = f"{d.get('field')} ({d.get('kind')}): recorded {short(d.get('recorded'))}, "
    text += f"replayed {short(d.get('replayed'))}"
    return f"{text} ({d['note']})" if d.get("note") else text


def _replay_note(replay: dict[str, Any]) -> str:
    tol = replay.get("tolerance") or {}
    return (
        f"rtol {fmt(tol.get('rtol'))}, atol {fmt(tol.get('atol'))}; "
        f"{fmt(replay.get('replayed_calls'))} calls in {fmt(replay.get('seconds'))} s"
    )


def _sample_view(sample: Sample) -> dict[str, Any]:
    meta = sample.meta
    details = [
        ("input", meta.get("input")),
        ("input sha256", meta.get("input_sha256")),
        ("policy", meta.get("policy")),
        ("model", meta.get("model")),
        ("server flags", meta.get("server_flags")),
        ("seed", meta.get("seed")),
        ("context limit", meta.get("context_limit")),
        ("started", meta.get("started")),
        ("ended", meta.get("ended")),
        ("world state", str(sample.world_state)),
        ("truth", str(sample.truth_path) if sample.truth_path else None),
    ]
    steps = [
        {
            "step": e.step,
            "tool": e.tool,
            "ok": e.status == "ok",
            "params": compact(e.params, 600),
            "result": compact(e.result) if e.status == "ok" else e.error,
            "seconds": f"{e.seconds:.2f}",
        }
        for e in sample.entries
    ]
    first_error = next((e for e in sample.entries if e.status == "error"), None)
    replay = sample.replay or {}
    differing = [
        s
        for s in replay.get("steps", [])
        if isinstance(s, dict) and s.get("comparison") != "identical"
    ]
    shown = [
        {
            "step": fmt(s.get("step")),
            "tool": fmt(s.get("tool")),
            "comparison": fmt(s.get("comparison")),
            "lines": [_difference(d) for d in s.get("differences") or [] if isinstance(d, dict)],
        }
        for s in differing[:REPLAY_STEPS_SHOWN]
    ]
    return {
        "name": sample.name,
        "id": anchor(sample.name),
        "status": sample.status,
        "status_class": status_class(sample.status),
        "error": sample.error,
        "problems": sample.problems,
        "first_error": (
            f"first error, step {first_error.step} ({first_error.tool}): {first_error.error}"
            if first_error and sample.failed
            else None
        ),
        "details": [(k, fmt(v)) for k, v in details if v not in (None, "")],
        "versions": meta.get("versions") or {},
        "scores": [(k, fmt(v)) for k, v in (sample.scores or {}).items()],
        "replay": replay,
        "replay_note": _replay_note(replay),
        "replay_verdict": replay.get("verdict", "not replayed"),
        "replay_class": verdict_class(replay.get("verdict", "not replayed")),
        "replay_differing": shown,
        "replay_more": len(differing) - len(shown),
        "steps": steps,
        "plots": [(p.stem.replace("_", " "), png_file(p)) for p in sample.plots],
    }


def render(
    table: pd.DataFrame,
    samples: list[Sample],
    parameters: list[str],
    drift: list[Flag],
    outliers: list[Flag],
    figures: list[Figure],
    threshold: float,
    floor: float,
) -> str:
    flagged: dict[tuple[str, str], str] = {(f.sample, f.column): str(f) for f in drift + outliers}
    for f in outliers:  # the outcome behind a derived outlier column
        if f.column == "doublets_removed_fraction":
            flagged[(f.sample, "doublets_removed")] = str(f)
    per_sample: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for kind, flags in (("parameter drift", drift), ("outcome outlier", outliers)):
        for f in flags:
            per_sample[f.sample].append((kind, str(f)))

    def cells(rec: dict[str, Any], columns: list[str]) -> list[dict[str, Any]]:
        out = []
        for c in columns:
            v = rec.get(c)
            text = f"{v:.0%}" if c == "cells_kept_fraction" and v is not None else fmt(v)
            numeric = isinstance(v, int | float) and not isinstance(v, bool)
            flag = flagged.get((rec["sample"], c))
            out.append({"text": text, "flag": flag, "col": c, "numeric": numeric})
        return out

    records = table.to_dict("records")
    overview = [c for c in OVERVIEW if c in table.columns]
    medians = {}
    done = table[table["status"] == "finished"]
    for c in parameters:
        values = pd.to_numeric(done[c], errors="coerce").dropna()
        medians[c] = fmt(float(values.median())) if len(values) else ""
    counts = {
        "samples": len(samples),
        "finished": sum(not s.failed for s in samples),
        "failed": sum(s.failed for s in samples),
        "reproduced": sum((s.replay or {}).get("verdict") == "reproduced" for s in samples),
        "flagged": len(per_sample),
    }
    env = jinja2.Environment(
        loader=jinja2.FunctionLoader(
            lambda name: resources.files("agent.report").joinpath("templates", name).read_text()
        ),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    return env.get_template("index.html.j2").render(
        generated=datetime.now(UTC).isoformat(timespec="seconds"),
        css=resources.files("agent.report").joinpath("templates", "style.css").read_text(),
        counts=counts,
        overview_headers=[OVERVIEW[c] for c in overview],
        overview_rows=[
            {
                "id": anchor(r["sample"]),
                "failed": r["status"] != "finished",
                "error": r["error"],
                "status_class": status_class(r["status"]),
                "replay_class": verdict_class(r["replay"]),
                "cells": cells(r, overview),
            }
            for r in records
        ],
        parameters=parameters,
        parameter_rows=[{"sample": r["sample"], "cells": cells(r, parameters)} for r in records],
        medians=[medians[c] for c in parameters],
        flags=sorted(per_sample.items()),
        anchors={s.name: anchor(s.name) for s in samples},
        threshold=threshold,
        floor=floor,
        figures=figures,
        samples=[_sample_view(s) for s in samples],
    )
