"""eval.html: an evaluation in the report's look (self-contained, the report's style sheet)."""

from __future__ import annotations

import json
from typing import Any

from agent.eval.points import KIND_RULES

# The speed figures shown, in order: (key of sample_figures, label, format)
SPEED = (
    ("iteration_p50_s", "seconds per request (points) / iteration (end to end), p50", "{:.2f}"),
    ("iteration_p95_s", "seconds per request (points) / iteration (end to end), p95", "{:.2f}"),
    ("ttft_cold_s", "TTFT, first request (cold prefix)", "{:.3f} s"),
    ("ttft_warm_s", "TTFT, later requests (median)", "{:.3f} s"),
    ("warm_hit_rate", "prompt tokens from the prefix cache", "{:.1%}"),
    ("decode_tokens_per_s", "decode tokens per second (median)", "{:.1f}"),
    ("thinking_tokens_per_step", "thinking tokens per step", "{:.0f}"),
)


def _show(value: Any, form: str) -> str:
    return "-" if value is None else form.format(value)


def _class(score: float | None) -> str:
    if score is None:
        return "muted"
    return "good" if score >= 0.9 else "warn" if score >= 0.6 else "bad"


def _flags(flags: list[dict[str, Any]]) -> str:
    """The server's chosen arguments, as vllm serve got them."""
    chosen = [f for f in flags if f.get("chosen") and not f.get("env") and not f.get("launch")]
    return " ".join(f["name"] + (f" {f['value']}" if f.get("value") else "") for f in chosen)


def render(doc: dict[str, Any]) -> str:
    from agent.pages import asset, templates

    model = doc["model"]
    counts: dict[str, int] = {}
    for p in doc["points"]:
        counts[p["kind"]] = counts.get(p["kind"], 0) + 1
    speed = doc["speed"]
    rows = [
        (label, _show((speed.get("points") or {}).get(k), f),
         _show((speed.get("end_to_end") or {}).get(k), f))
        for k, label, f in SPEED
    ]  # fmt: skip
    runs = [
        {
            "name": name, "status": r["status"], "score": r["score"], "steps": r["steps"],
            "cls": {"finished": "good", "partial": "warn"}.get(r["status"], "bad"),
            "checks": f"{r['checks']['pass']} / {r['checks']['warn']} / {r['checks']['refused']}",
            "ari": _show(r.get("ari"), "{:.2f}"), "labels": _show(r.get("label_agreement"), "{:.0%}"),
        }
        for name, r in doc["end_to_end"].items()
    ]  # fmt: skip
    cases = [
        {
            "name": name,
            "acceptable": f"{c['acceptable']} of {c['points']}" if c["evaluated"] else "-",
            "note": "" if c["evaluated"] else f"left out: {c['why']}",
        }
        for name, c in doc["cases"].items()
    ]
    return (
        templates()
        .get_template("eval.html.j2")
        .render(
            css=asset("style.css"),
            model_name=model.get("model_id") or model.get("model") or model.get("policy"),
            started=doc["started"],
            seconds=doc["seconds"],
            score=_show(doc["score"], "{:.2f}"),
            score_class=_class(doc["score"]),
            n_points=len(doc["points"]),
            n_wrong=len(doc["wrong"]),
            e2e_score=_show(doc["end_to_end_score"], "{:.2f}"),
            model=[
                (k, json.dumps(v) if isinstance(v, dict | list) else v)
                for k, v in model.items()
                if k != "flags"
            ]
            + [("flags", _flags(model.get("flags") or []))],
            kinds=[
                {
                    "kind": k,
                    "score": _show(v, "{:.2f}"),
                    "cls": _class(v),
                    "n": counts[k],
                    "rule": KIND_RULES[k],
                }
                for k, v in doc["by_kind"].items()
            ],
            speed=rows,
            server=[(k, v) for k, v in (speed.get("server") or {}).items() if v is not None],
            runs=runs,
            cases=cases,
            points=[
                {
                    "point": p["point"],
                    "kind": p["kind"],
                    "ok": p["acceptable"],
                    "call": json.dumps({"tool": p.get("tool"), "arguments": p.get("arguments")}),
                    "reference": json.dumps(p["reference"]),
                    "why": p["why"],
                }
                for p in doc["points"]
            ],
            stale=doc["points_file"]["differences"],
        )
    )
