"""The report's pages: index.html (the cohort) and samples/NAME.html (one page per sample).

Both kinds are self-contained (inline CSS and script, images as base64 PNG, no external URLs) and
sized for 1,000 samples: the index holds the cohort summary, its figures and one compact samples
table whose columns come in views that each fit a laptop screen, sorted and filtered in the
browser; everything per sample (its checks first, details, labels with their doubts, replay,
plots, steps, parameters) is on its own page. A status is coloured alike everywhere: finished
green, partial amber, the others red; so are the checks' verdicts (pass, warn, refused).
"""

from __future__ import annotations

import base64
import hashlib
import re
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import orjson
import pandas as pd

from agent.checks import RULES
from agent.pages import asset, fmt, templates
from agent.record.checks import SOURCES, SampleChecks, label_flags
from agent.record.collect import Sample
from agent.report.cohort import ambient_said, doublets_said, labels_found
from agent.report.drift import Flag
from agent.report.plots import Figure, png_file

# The samples table of the index: columns always shown, then views of a few columns each
# (column -> header), so that no view is wider than a 1366-pixel screen. cohort.tsv holds every
# column; the sample pages everything per sample.
FIXED = {"sample": "sample", "status": "status", "replay": "replay"}
VIEWS = {
    "outcomes": {
        "checks": "checks", "cells_before": "cells in", "cells_after": "cells out",
        "cells_kept_fraction": "kept", "doublets_removed": "doublets removed",
        "clusters": "clusters", "ari": "ARI", "doublet_recall": "doublet recall", "flags": "flags",
    },
    "run": {
        "policy": "policy", "steps": "steps", "errors": "errors",
        "iterations": "iterations", "seconds": "seconds", "prompt_tokens": "prompt tok.",
        "completion_tokens": "compl. tok.", "cached_ratio": "cached", "truncations": "trunc.",
    },
    "model": {
        "model": "model", "model_id": "model id", "revision": "revision",
        "vllm_version": "vLLM", "family": "family", "sampling": "sampling",
        "prompt_digest": "prompt digest",
    },
    "annotation": {"reference_annotation": "reference annotation (CellTypist model)"},
}  # fmt: skip
# Columns of the views that are no column of the table: the checks (counts of refused and
# warned, coloured by the worst) and the flags (status, drift, outliers), each one a summary.
DERIVED = ("checks", "flags")
# Long values cut to this many characters in the samples table, whole in the cell's title (and
# in cohort.tsv and on the sample page): hashes are told apart by their start.
CUT = {"revision": 12, "prompt_digest": 12, "sampling": 40, "reference_annotation": 40}
PARAMETERS_PER_VIEW = 6  # parameter headers are wide (tool and name on two lines)
RESULT_CHARS = 1200  # longer step results are cut in the page (the world state has them whole)
EVIDENCE_CHARS = 600  # a check's evidence, likewise
LOOK_AT_CHARS = 240  # a check's message under the index's "Samples to look at" (whole on its page)
VERDICT_CLASS = {"pass": "good", "warn": "warn", "refused": "bad"}
# What the sample page says where a sample has no checks.
EMPTY = {"none": "No record, no checks.", "record": "No step made a decision that is checked."}
COHORT_FLAGS = ("parameter drift", "outcome outlier")  # a sample's flags against the cohort
REPLAY_STEPS_SHOWN = 6  # after a divergence most later steps differ too; replay.json lists all


def page_names(names: list[str]) -> dict[str, str]:
    """sample -> its page's file name under samples/: safe characters, unique among the cohort."""
    out: dict[str, str] = {}
    taken: set[str] = set()
    for name in names:
        base = re.sub(r"[^A-Za-z0-9_-]+", "_", name).strip("_") or "sample"
        stem, k = base, 1
        while stem.lower() in taken:  # case-insensitive file systems too
            k += 1
            stem = f"{base}-{k}"
        taken.add(stem.lower())
        out[name] = f"{stem}.html"
    return out


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


def status_class(status: str, live: bool = False) -> str:
    """finished green, partial amber (finish was told why it cannot complete), grey for a run
    that holds its folder while the report is built (``live``), the others red."""
    return "muted" if live else {"finished": "good", "partial": "warn"}.get(status, "bad")


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


def _provenance_text(value: Any) -> str | None:
    """A model provenance value on the sample page, settings as `name=value` pairs; None when
    the record has none."""
    if isinstance(value, dict):
        return ", ".join(f"{k}={fmt(v)}" for k, v in value.items()) or None
    return fmt(value) or None


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _evidence(evidence: dict[str, Any]) -> str:
    return _cut("; ".join(f"{k}={fmt(v)}" for k, v in evidence.items()), EVIDENCE_CHARS)


def _checks_class(found: SampleChecks) -> str:
    """The colour of a sample's checks: its worst verdict's; muted where all that passed is
    what the report could compute from a record without checks (weak evidence, not a pass)."""
    if found.source == "computed" and not found.flagged:
        return "muted"
    return VERDICT_CLASS.get(found.worst or "", "muted")


def _checks_view(sample: Sample) -> dict[str, Any]:
    """The sample page's checks: one row each, worst first, linked to their steps; the steps'
    worst verdicts; and where the checks came from."""
    found = sample.checks
    rows = [
        {
            "id": f"check-{i}",
            "verdict": c.verdict,
            "class": VERDICT_CLASS[c.verdict],
            "rule": c.rule,
            "rule_says": RULES.get(c.rule, ""),
            "message": c.message,
            "evidence": _evidence(c.evidence),
            "step": c.step,
            "tool": c.tool or "",
        }
        for i, c in enumerate(found.checks, 1)
    ]
    at_step: dict[int, dict[str, Any]] = {}
    for row in rows:  # worst first: a step's first flagged check is its worst
        if row["verdict"] != "pass" and row["step"] is not None:
            at_step.setdefault(row["step"], row)
    return {
        "rows": rows,
        "summary": found.summary() or "none",
        "class": _checks_class(found),
        "computed": SOURCES[found.source] if found.source == "computed" else None,
        "note": found.note,
        "empty": None if rows else EMPTY.get(found.source, EMPTY["record"]),
        "at_step": at_step,
    }


def _sample_view(sample: Sample) -> dict[str, Any]:
    """What a sample's page shows, apart from the cohort context (flags, parameters)."""
    meta = sample.meta
    details = [
        ("input", meta.get("input")),
        ("input sha256", meta.get("input_sha256")),
        ("policy", meta.get("policy")),
        ("model", meta.get("model")),
        ("reference annotation", sample.reference_annotation),
        ("server flags", meta.get("server_flags")),
        ("seed", meta.get("seed")),
        ("doublets", doublets_said(sample)),
        ("ambient RNA", ambient_said(sample)),
        ("context limit", meta.get("context_limit")),
        ("started", meta.get("started")),
        ("ended", meta.get("ended")),
        ("world state", str(sample.world_state)),
        ("truth", str(sample.truth_path) if sample.truth_path else None),
    ]
    checks = _checks_view(sample)
    steps = [
        {
            "step": e.step,
            "tool": e.tool,
            "check": checks["at_step"].get(e.step),
            "ok": e.status == "ok",
            "params": compact(e.params, 600),
            "result": compact(e.result) if e.status == "ok" else e.error,
            "seconds": f"{e.seconds:.2f}",
        }
        for e in sample.entries
    ]
    model = [
        (key.replace("_", " ").replace("vllm", "vLLM"), _provenance_text(value))
        for key, value in sample.model_provenance.items()
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
        "status": sample.status,
        "status_class": status_class(sample.status, live=sample.running is not None),
        "error": sample.error,
        "partial": sample.status == "partial",
        "checks": checks,
        "label_flags": label_flags(sample.entries),
        "problems": sample.problems,
        "first_error": (
            f"first error, step {first_error.step} ({first_error.tool}): {first_error.error}"
            if first_error and sample.failed
            else None
        ),
        "details": [(k, fmt(v)) for k, v in details if v not in (None, "")],
        "model": model,
        "versions": meta.get("versions") or {},
        "scores": [(k, fmt(v)) for k, v in (sample.scores or {}).items()],
        "labels": labels_found(sample),
        "replay": replay,
        "replay_note": _replay_note(replay),
        "replay_verdict": replay.get("verdict", "not replayed"),
        "replay_class": verdict_class(replay.get("verdict", "not replayed")),
        "replay_differing": shown,
        "replay_more": len(differing) - len(shown),
        "steps": steps,
        "plots": [(p.stem.replace("_", " "), png_file(p)) for p in sample.plots],
    }


@dataclass(frozen=True)
class Column:
    key: str
    header: str
    tool: str = ""  # parameter columns: the tool, shown above the parameter's name


@dataclass(frozen=True)
class Context:
    """What the index and the sample pages share: the table, flags, medians and page names."""

    table: pd.DataFrame
    parameters: list[str]
    flagged: dict[tuple[str, str], str]  # (sample, column) -> the flag in words
    per_sample: dict[str, list[tuple[str, str]]]  # sample -> (kind, flag) for each flag
    medians: dict[str, str]  # numeric column -> median over the finished samples
    pages: dict[str, str]  # sample -> file name under samples/
    checks: dict[str, SampleChecks]  # sample -> its checks
    running: set[str]  # samples whose run holds its folder as the report is built


def context(
    table: pd.DataFrame,
    samples: list[Sample],
    parameters: list[str],
    drift: list[Flag],
    outliers: list[Flag],
) -> Context:
    flagged: dict[tuple[str, str], str] = {(f.sample, f.column): str(f) for f in drift + outliers}
    for f in outliers:  # the outcome behind a derived outlier column
        if f.column == "doublets_removed_fraction":
            flagged[(f.sample, "doublets_removed")] = str(f)
    per_sample: dict[str, list[tuple[str, str]]] = defaultdict(list)
    for s in samples:  # a failed, refused or partial sample first, with its reason in words
        if s.status != "finished":
            per_sample[s.name].append((s.status.replace("_", " "), s.error or ""))
        for tool, repeated in s.checks.repeated_filters().items():  # the thresholds in force
            said = (
                f"in force: the strictest of {len(repeated.get('steps', []))} applications of "
                f"{tool} (steps {', '.join(map(str, repeated.get('steps', [])))})"
            )
            for key in repeated.get("effective", {}):
                column = (s.name, f"{tool}.{key}")
                flagged[column] = "; ".join(filter(None, [flagged.get(column), said]))
    for kind, flags in zip(COHORT_FLAGS, (drift, outliers), strict=True):
        for f in flags:
            per_sample[f.sample].append((kind, str(f)))
    done = table[table["status"] == "finished"]
    medians = {}
    for c in table.columns:
        values = pd.to_numeric(done[c], errors="coerce").dropna()
        present = done[c].dropna()
        if len(values) and all(
            isinstance(v, int | float) and not isinstance(v, bool) for v in present
        ):
            medians[c] = fmt(float(values.median()))
    return Context(
        table, parameters, flagged, dict(per_sample), medians,
        page_names([s.name for s in samples]), {s.name: s.checks for s in samples},
        {s.name for s in samples if s.running is not None},
    )  # fmt: skip


def constant_parameters(ctx: Context) -> dict[str, Any]:
    """Parameters every finished sample chose alike: listed once on the index, not as columns."""
    done = ctx.table[ctx.table["status"] == "finished"]
    out = {}
    for c in ctx.parameters:
        values = done[c].tolist()
        if values and all(fmt(v) == fmt(values[0]) and fmt(v) for v in values):
            out[c] = values[0]
    return out


def views(ctx: Context, constant: dict[str, Any]) -> list[tuple[str, list[Column]]]:
    """Named column sets of the samples table; varying parameters a few at a time, by tool."""
    out = [
        (name, [Column(c, h) for c, h in cols.items() if c in ctx.table.columns or c in DERIVED])
        for name, cols in VIEWS.items()
    ]
    chunks: list[list[str]] = []
    for c in (c for c in ctx.parameters if c not in constant):
        tool = c.split(".", 1)[0]
        last = chunks[-1] if chunks else None
        # a new view when this one is full, or would split a tool it could hold whole
        tool_size = sum(p.split(".", 1)[0] == tool for p in ctx.parameters if p not in constant)
        starts_tool = not last or last[-1].split(".", 1)[0] != tool
        if (
            last is None
            or len(last) >= PARAMETERS_PER_VIEW
            or (starts_tool and len(last) + tool_size > PARAMETERS_PER_VIEW)
        ):
            chunks.append([])
        chunks[-1].append(c)
    for chunk in chunks:
        tools = list(dict.fromkeys(c.split(".", 1)[0] for c in chunk))
        columns = [Column(c, c.split(".", 1)[1], c.split(".", 1)[0]) for c in chunk]
        out.append(("parameters: " + ", ".join(tools), columns))
    return [(name, cols) for name, cols in out if cols]


def _cell(ctx: Context, rec: dict[str, Any], key: str) -> tuple[str, str, str, str | None]:
    """(text, CSS class, title, sort key or None: the text) of one cell of the samples table."""
    name = rec["sample"]
    if key == "flags":
        flags = ctx.per_sample.get(name, [])
        return (
            str(len(flags)) if flags else "",
            "n f" if flags else "n",
            "; ".join(t for _, t in flags),
            None,
        )
    if key == "checks":  # refused and warned counts, coloured by the worst; refused sort first
        found = ctx.checks[name]
        title = "; ".join(f"{c.verdict} {c.rule}: {c.message}" for c in found.flagged)
        sort = 1000 * found.count("refused") + found.count("warn") if found.checks else None
        return (
            found.summary(),
            f"v {_checks_class(found)}",
            _cut(title, LOOK_AT_CHARS) if title else SOURCES[found.source],
            None if sort is None else str(sort),
        )
    v = rec.get(key)
    text = f"{v:.0%}" if key == "cells_kept_fraction" and v is not None else fmt(v)
    if key == "cached_ratio" and v is not None:
        text = f"{v:.0%}"
    numeric = isinstance(v, int | float) and not isinstance(v, bool)
    flag = ctx.flagged.get((name, key), "")
    classes = " ".join(filter(None, ["n" if numeric else "", "f" if flag else ""]))
    if key in CUT and len(text) > CUT[key]:
        return text[: CUT[key]] + "…", classes, text, None
    return text, classes, flag, None


def script_hash(script: str) -> str:
    """The CSP source that allows exactly this inline script and no other."""
    return "'sha256-" + base64.b64encode(hashlib.sha256(script.encode()).digest()).decode() + "'"


def render_index(
    ctx: Context,
    samples: list[Sample],
    figures: list[Figure],
    threshold: float,
    floor: float,
    performance: dict[str, Any] | None = None,
    cohort: dict[str, Any] | None = None,  # agent.cohort.integrate.report_view; None: no section
    comparison: str | None = None,  # the page of what reprocessing changed; None: no link
    evaluation: dict[str, Any] | None = None,  # agent.report.evaluation.view; None: not named
    composition: dict[str, Any] | None = None,  # agent.cohort.composition.report_view
    de: dict[str, Any] | None = None,  # agent.cohort.de.report_view; None: no section
) -> str:
    """``performance``: the performance section (agent/report/performance.py ``view`` and its
    figure); None leaves it out."""
    constant = constant_parameters(ctx)
    table_views = views(ctx, constant)
    fixed = [Column(c, h) for c, h in FIXED.items()]
    columns = fixed + [c for _, cols in table_views for c in cols]
    # each view shows the fixed columns and its own range of the table's columns (1-based)
    ranges, start = [], len(fixed) + 1
    for _, cols in table_views:
        ranges.append((start, start + len(cols) - 1))
        start += len(cols)
    look_at = _look_at(ctx)
    rows = []
    for rec in ctx.table.to_dict("records"):
        name = rec["sample"]
        live = name in ctx.running
        classes = [
            "" if live else {"finished": "", "partial": "partial"}.get(rec["status"], "failed")
        ]
        classes.append("flagged" if name in look_at else "")
        classes.append("checked" if ctx.checks[name].flagged else "")
        classes.append("" if rec["replay"] in ("reproduced", "within tolerance") else "unreplayed")
        rows.append(
            {
                "name": name,
                "page": "samples/" + ctx.pages[name],
                "classes": " ".join(filter(None, classes)),
                "status": fmt(rec["status"]),
                "status_class": status_class(rec["status"], live=live),
                "error": rec["error"],
                "replay": fmt(rec["replay"]),
                "replay_class": verdict_class(rec["replay"]),
                "cells": [_cell(ctx, rec, c.key) for c in columns[len(fixed) :]],
            }
        )
    script = asset("index.js")
    return (
        templates()
        .get_template("index.html.j2")
        .render(
            generated=datetime.now(UTC).isoformat(timespec="seconds"),
            css=asset("style.css"),
            script=script,
            script_hash=script_hash(script),
            counts={
                "samples": len(samples),
                "finished": sum(s.status == "finished" for s in samples),
                "partial": sum(s.status == "partial" for s in samples),
                "failed": sum(s.failed for s in samples),
                "checked": sum(bool(s.checks.flagged) for s in samples),
                "reproduced": sum((s.replay or {}).get("verdict") == "reproduced" for s in samples),
                "flagged": len(look_at),
            },
            views=[name for name, _ in table_views],
            ranges=ranges,
            fixed=fixed,
            columns=columns[len(fixed) :],
            medians=[ctx.medians.get(c.key, "") for c in columns[len(fixed) :]],
            rows=rows,
            constant=[(c, fmt(v)) for c, v in constant.items()],
            flags=sorted(look_at.items()),
            pages={n: "samples/" + p for n, p in ctx.pages.items()},
            threshold=threshold,
            floor=floor,
            figures=figures,
            performance=performance,
            cohort=cohort,
            comparison=comparison,
            evaluation=evaluation,
            composition=composition,
            de=de,
            fmt=fmt,
        )
    )


def _look_at(ctx: Context) -> dict[str, list[tuple[str, str, str | None]]]:
    """Sample -> what the index lists for it under "Samples to look at": (kind, words, link or
    None): why it failed or is partial, then its checks that were refused or warned (linked to
    them on its page), then its drift and outlier flags."""
    out: dict[str, list[tuple[str, str, str | None]]] = {}
    for name, page in ctx.pages.items():
        flags = ctx.per_sample.get(name, [])
        status = [(k, t, None) for k, t in flags if k not in COHORT_FLAGS]
        checks = [
            (
                f"{c.verdict} {c.rule}",
                _cut(
                    f"{f'step {c.step} ({c.tool}): ' if c.step else ''}{c.message}", LOOK_AT_CHARS
                ),
                f"samples/{page}#check-{i}",
            )
            for i, c in enumerate(ctx.checks[name].checks, 1)
            if c.verdict != "pass"
        ]
        others = [(k, t, None) for k, t in flags if k in COHORT_FLAGS]
        if status or checks or others:
            out[name] = status + checks + others
    return out


def render_samples(ctx: Context, samples: list[Sample]) -> Iterator[tuple[str, str]]:
    """(file name, page) for each sample, one at a time: together they hold every plot."""
    template = templates().get_template("sample.html.j2")
    css = asset("style.css")
    records = {r["sample"]: r for r in ctx.table.to_dict("records")}
    names = [s.name for s in samples]
    for i, sample in enumerate(samples):
        rec = records[sample.name]
        parameters = [
            {
                "tool": c.split(".", 1)[0],
                "name": c.split(".", 1)[1],
                "value": fmt(rec.get(c)),
                "median": ctx.medians.get(c, ""),
                "flag": ctx.flagged.get((sample.name, c)),
            }
            for c in ctx.parameters
            if fmt(rec.get(c))
        ]
        yield (
            ctx.pages[sample.name],
            template.render(
                css=css,
                s=_sample_view(sample),
                # its status and reason head the page already
                flags=[f for f in ctx.per_sample.get(sample.name, []) if f[0] in COHORT_FLAGS],
                parameters=parameters,
                previous=ctx.pages[names[i - 1]] if i > 0 else None,
                next=ctx.pages[names[i + 1]] if i + 1 < len(names) else None,
                position=i + 1,
                total=len(samples),
            ),
        )
