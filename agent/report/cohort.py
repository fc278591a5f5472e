"""The cohort table: one row per sample, outcomes first, then every parameter the analysis chose."""

from __future__ import annotations

from typing import Any

import orjson
import pandas as pd

from agent.record.checks import COLUMNS as CHECK_COLUMNS
from agent.record.collect import MODEL_PROVENANCE, Sample, chosen_parameters, seconds_between
from agent.tool_declarations import DECLARED

CELL_FILTERS = tuple(name for name, declared in DECLARED.items() if declared.kind == "cell_filter")
OUTCOME_COLUMNS = (
    "sample", "status", "error", "drift", "outliers", *CHECK_COLUMNS, "input", "input_sha256",
    "policy", "model", *MODEL_PROVENANCE, "reference_annotation", "server_flags", "seed", "steps",
    "errors", "iterations", "seconds",
    "decide_seconds", "tool_seconds", "prompt_tokens", "completion_tokens", "cached_tokens",
    "cached_ratio", "truncations", "reprefilled_tokens", "cells_before", "genes_before",
    "cells_after", "genes_after", "cells_kept_fraction", "cells_removed_qc", "doublets",
    "doublets_removed", "doublets_flagged", "ambient_method", "ambient_contamination",
    "clusters", "labels", "replay", "ari", "doublet_recall", "damaged_removed", "planted_types",
)  # fmt: skip


def _total(values: list[Any]) -> int | float | None:
    present = [v for v in values if v is not None]
    return sum(present) if present else None


def _result(sample: Sample, tool: str, key: str) -> Any:
    entry = sample.last_ok(tool)
    return (entry.result or {}).get(key) if entry else None


def _sum_results(sample: Sample, tools: tuple[str, ...], key: str) -> Any:
    return _total(
        [(e.result or {}).get(key) for e in sample.entries if e.status == "ok" and e.tool in tools]
    )


def labels_found(sample: Sample) -> str | None:
    """Cell-type labels of the final annotation, largest first."""
    sizes = (
        _result(sample, "annotate_celltypist", "label_sizes")  # a reference model's, when given
        or _result(sample, "annotate_clusters", "label_sizes")
        or _result(sample, "finish", "cell_type_sizes")
    )
    if not sizes:
        return None
    return "; ".join(k for k, _ in sorted(sizes.items(), key=lambda kv: (-kv[1], kv[0])))


def doublet_mode(sample: Sample) -> str | None:
    """The run's doublets setting ('remove' or 'flag'; records made before it removed them)."""
    return sample.meta.get("doublets") or ("remove" if sample.world else None)


def doublets_said(sample: Sample) -> str | None:
    """What became of the predicted doublets, in words (the sample page)."""
    predicted = _result(sample, "detect_doublets", "n_predicted_doublets")
    if predicted is None:
        return None
    if doublet_mode(sample) == "flag":
        return (
            f"flagged and kept: {predicted} cells (obs['predicted_doublet']), left out of the "
            "markers and of the labels' evidence"
        )
    removed = _result(sample, "remove_doublets", "removed")
    return f"removed: {removed} cells" if removed is not None else f"{predicted} predicted"


def ambient_said(sample: Sample) -> str | None:
    """The ambient RNA estimate, in words (the sample page)."""
    entry = sample.last_ok("remove_ambient")
    if entry is None:
        return None
    found = entry.result or {}
    return (
        f"{found.get('method')}: contamination {found.get('contamination')}, "
        f"{found.get('removed_fraction', 0):.1%} of the counts removed into "
        f"layers['{found.get('layer')}'] (the raw counts kept)"
    )


def _run_row(sample: Sample) -> dict[str, Any]:
    """Provenance and cost of the run: record, metrics and replay."""
    meta, rows = sample.meta, sample.metrics
    prompt = _total([r.get("prompt_tokens") for r in rows])
    cached = _total([r.get("cached_tokens") for r in rows])
    truncations = meta.get("truncations")
    if truncations is None and rows:
        truncations = sum(1 for r in rows if r.get("truncated_messages"))
    flags = meta.get("server_flags")
    return {
        "sample": sample.name,
        "status": sample.status,
        "error": sample.error,
        **sample.checks.columns(),
        "input": meta.get("input"),
        "input_sha256": meta.get("input_sha256"),
        "policy": meta.get("policy"),
        "model": meta.get("model"),
        **sample.model_provenance,
        "reference_annotation": sample.reference_annotation,
        "server_flags": orjson.dumps(flags).decode() if flags else None,
        "seed": meta.get("seed"),
        "steps": len(sample.entries) if sample.world else None,
        "errors": sum(e.status == "error" for e in sample.entries) if sample.world else None,
        "iterations": len(rows) if rows else None,
        "seconds": seconds_between(meta.get("started"), meta.get("ended")),
        "decide_seconds": _round(_total([r.get("decide_seconds") for r in rows])),
        "tool_seconds": _round(_total([r.get("tool_seconds") for r in rows])),
        "prompt_tokens": prompt,
        "completion_tokens": _total([r.get("completion_tokens") for r in rows]),
        "cached_tokens": cached,
        "cached_ratio": round(cached / prompt, 4) if prompt and cached is not None else None,
        "truncations": truncations,
        # what the cuts cost: tokens prefilled again after each cut of the history
        "reprefilled_tokens": _total([r.get("reprefilled_tokens") for r in rows]),
        "replay": (sample.replay or {}).get("verdict", "not replayed"),
    }


def _round(x: float | None, digits: int = 2) -> float | None:
    return None if x is None else round(x, digits)


def row(sample: Sample) -> dict[str, Any]:
    """The sample's outcomes and choices, as the cohort table shows them."""
    out = _run_row(sample)
    # an unfiltered droplet matrix loads empty barcodes too: its cells are those call_cells kept
    before = _result(sample, "call_cells", "n_cells") or _result(sample, "load_data", "n_cells")
    after = _result(sample, "finish", "n_cells")
    if after is None and sample.final_obs is not None:
        after = len(sample.final_obs)
    scores = sample.scores or {}
    out.update(
        cells_before=before,
        genes_before=_result(sample, "load_data", "n_genes"),
        cells_after=after,
        genes_after=_result(sample, "finish", "n_genes"),
        cells_kept_fraction=round(after / before, 4) if before and after is not None else None,
        cells_removed_qc=_sum_results(sample, CELL_FILTERS, "removed"),
        doublets=doublet_mode(sample),
        doublets_removed=_sum_results(sample, ("remove_doublets",), "removed"),
        doublets_flagged=_result(sample, "detect_doublets", "n_predicted_doublets")
        if doublet_mode(sample) == "flag"
        else None,
        ambient_method=_result(sample, "remove_ambient", "method"),
        ambient_contamination=_result(sample, "remove_ambient", "contamination"),
        clusters=_result(sample, "leiden", "n_clusters") or _result(sample, "finish", "n_clusters"),
        labels=labels_found(sample),
        ari=scores.get("ari"),
        doublet_recall=scores.get("doublet_recall"),
        damaged_removed=scores.get("damaged_removed"),
        planted_types=scores.get("planted_types"),
    )
    return {**out, **chosen_parameters(sample)}


def _cell(value: Any) -> Any:
    """Lists and mappings as compact JSON in a table cell."""
    return orjson.dumps(value).decode() if isinstance(value, list | dict | tuple) else value


def build_table(samples: list[Sample]) -> pd.DataFrame:
    """One row per sample; parameter columns in pipeline order, those never set left out."""
    rows = [row(s) for s in samples]
    params: dict[str, None] = {}
    for r in rows:
        params.update({k: None for k in r if k not in OUTCOME_COLUMNS})
    frame = pd.DataFrame(
        [{k: _cell(r.get(k)) for k in (*OUTCOME_COLUMNS, *params)} for r in rows],
        columns=[*OUTCOME_COLUMNS, *params],
        dtype=object,  # integers stay integers beside missing values
    )
    empty = [c for c in params if frame[c].isna().all()]
    return frame.drop(columns=empty)


def parameter_columns(table: pd.DataFrame) -> list[str]:
    return [c for c in table.columns if c not in OUTCOME_COLUMNS]
