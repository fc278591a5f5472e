"""`python -m agent compare OLD [NEW]`: what reprocessing changed, sample by sample.

OLD and NEW are results folders (each with samples/NAME/); with OLD alone, each sample's newest
analysis in its previous/ (set aside there by --fresh or --replace-changed: agent/resume.py) is
the old side and its current one the new side. Writes into OUTDIR comparison.tsv (one row per
sample) and comparison.html (self-contained, the cohort report's look): each side's status,
model, vLLM and package versions and record (path and sha256), cells in each and in both, the
ARI of the Leiden clusterings on the shared cells, the share of shared cells with the same
cell_type (and the confusion of labels), and each parameter and run setting whose value differs;
a cohort summary on top, largest changes first. A sample on one side only, or whose files are
missing or unreadable, or whose record fails the integrity check that replay runs (an edited
record, a final object that is not the one its finish step wrote), is a row that says so and
compares nothing; no sample stops the comparison.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from agent import say
from agent.config import LOAD_OPTIONS
from agent.record.layout import FINAL, PREVIOUS, RECORD, SampleLayout

if TYPE_CHECKING:
    import pandas as pd

    from agent.record.collect import Sample

TSV = "comparison.tsv"
HTML = "comparison.html"
SAMPLES = "samples"  # RESULTS/samples/NAME/, as the workflow lays out a cohort
LABEL_KEY = "cell_type"
# Settings of a run (the record's meta) besides the tools' parameters: what resume compares,
# and what the model was given.
RUN_SETTINGS = (
    "input_sha256", "policy", "model", "seed", "brief", *LOAD_OPTIONS, "celltypist_model_sha256",
    "server_flags", "sampling", "prompt_digest", "context_limit",
)  # fmt: skip
# Outcomes, largest change first (the table's order).
OUTCOMES = (
    "labels changed", "clusters changed", "cells changed", "unchanged", "not compared",
    "only in old", "only in new", "not reprocessed",
)  # fmt: skip
COLUMNS = (
    "sample", "outcome", "note", "same_label", "ari", "old_cells", "new_cells", "shared_cells",
    "parameters_changed", "old_status", "new_status", "old_model", "new_model", "old_vllm",
    "new_vllm", "versions_changed", "label_confusion", "old_record", "old_record_sha256",
    "new_record", "new_record_sha256", "old_versions", "new_versions",
)  # fmt: skip


@dataclass
class Side:
    """One analysis of a sample: its record read as the report reads it, the record's digest,
    and the final object's clusters and labels."""

    record: Path
    sample: Sample
    digest: str | None = None
    obs: pd.DataFrame | None = None
    cluster_key: str = "leiden"
    problems: list[str] = field(default_factory=list)
    unsound: list[str] = field(default_factory=list)  # what the integrity check found

    @property
    def model(self) -> str:
        provenance = self.sample.model_provenance
        return str(
            provenance["model_id"]
            or self.sample.meta.get("model")
            or f"none ({self.sample.meta.get('policy', 'unknown')} policy)"
        )


def read_side(record: Path) -> Side:
    """The analysis whose record is ``record``; what cannot be read is noted, never raised. The
    record is checked as replay checks it (``check_record``: chain, seal, steps, and the final
    object holding the finish step's data): a side that fails is not compared."""
    from agent.record.collect import cluster_key, load_sample, read_obs
    from agent.record.integrity import check_record
    from agent.record.provenance import file_sha256

    side = Side(record, load_sample(record))
    side.problems += side.sample.problems
    if side.sample.world is not None:
        side.unsound = [p.what for p in check_record(side.sample.world, record.parent)]
    if record.is_file():
        try:
            side.digest = file_sha256(record)
        except OSError as e:
            side.problems.append(f"{record}: {e}")
    side.cluster_key = cluster_key(side.sample)
    final = record.parent / FINAL
    if side.sample.world is not None and final.is_file():
        try:
            side.obs = read_obs(final, [side.cluster_key, LABEL_KEY])
        except Exception as e:  # a damaged object is this side's note, not the cohort's end
            side.problems.append(f"{final}: {type(e).__name__}: {e}")
    return side


def newest_previous(folder: Path) -> Path | None:
    """The record of the analysis set aside last in ``folder``/previous/: the folders are named
    by the start time of the analysis they hold (ISO, so they sort by time; a '+' is added to
    a name already taken, which sorts after it)."""
    found = sorted(p for p in (folder / PREVIOUS).glob(f"*/{RECORD}"))
    return found[-1] if found else None


def sample_names(roots: list[Path], chosen: list[str] | None) -> list[str]:
    """The samples to compare: those chosen, else every sample folder on either side."""
    if chosen:
        return list(dict.fromkeys(chosen))
    names = {
        p.name
        for root in roots
        for p in (root / SAMPLES).iterdir()
        if p.is_dir() and not p.name.startswith(".")
    }
    return sorted(names)


def _json(value: Any) -> str:
    return orjson.dumps(value, default=str, option=orjson.OPT_SORT_KEYS).decode()


def changed_settings(old: Sample, new: Sample) -> list[str]:
    """``what: old -> new`` for each run setting and tool parameter whose value differs (the
    last successful call of each analysis tool, as the cohort report shows them)."""
    from agent.record.collect import chosen_parameters

    pairs = [(f"run.{k}", old.meta.get(k), new.meta.get(k)) for k in RUN_SETTINGS]
    before, after = chosen_parameters(old), chosen_parameters(new)
    pairs += [(k, before.get(k), after.get(k)) for k in dict.fromkeys([*before, *after])]
    return [f"{k}: {_json(a)} -> {_json(b)}" for k, a, b in pairs if a != b]


def changed_versions(old: Sample, new: Sample) -> list[str]:
    before, after = old.meta.get("versions") or {}, new.meta.get("versions") or {}
    return [
        f"{k} {before.get(k, '(none)')} -> {after.get(k, '(none)')}"
        for k in sorted(set(before) | set(after))
        if before.get(k) != after.get(k)
    ]


def side_columns(prefix: str, side: Side | None) -> dict[str, Any]:
    if side is None:
        return {}
    return {
        f"{prefix}_status": side.sample.status,
        f"{prefix}_model": side.model,
        f"{prefix}_vllm": side.sample.model_provenance["vllm_version"],
        f"{prefix}_record": str(side.record.resolve()),  # the inputs' provenance: where they are
        f"{prefix}_record_sha256": side.digest,
        f"{prefix}_versions": _json(side.sample.meta.get("versions") or {}),
        f"{prefix}_cells": len(side.obs) if side.obs is not None else None,
    }


def compare_results(old: Side, new: Side) -> dict[str, Any]:
    """Cells, ARI, label agreement and confusion of two analyses of one sample."""
    from sklearn.metrics import adjusted_rand_score

    sides = (("old", old), ("new", new))
    missing = [
        f"no final object on the {name} side ({side.sample.status})"
        for name, side in sides
        if side.obs is None
    ]
    unsound = [
        f"the {name} side fails the integrity check: {'; '.join(side.unsound)}"
        for name, side in sides
        if side.unsound
    ]
    if missing or unsound:
        note = "; ".join(unsound + missing + old.problems + new.problems)
        return {"outcome": "not compared", "note": note}
    shared = old.obs.index.intersection(new.obs.index)
    row: dict[str, Any] = {"shared_cells": len(shared)}
    if not len(shared):
        return {**row, "outcome": "not compared", "note": "no cell in both final objects"}
    notes = []
    if old.cluster_key in old.obs and new.cluster_key in new.obs:
        row["ari"] = round(
            float(
                adjusted_rand_score(
                    old.obs.loc[shared, old.cluster_key], new.obs.loc[shared, new.cluster_key]
                )
            ),
            4,
        )
    else:
        notes.append("no Leiden clustering on one side")
    if LABEL_KEY in old.obs and LABEL_KEY in new.obs:
        a = old.obs.loc[shared, LABEL_KEY].astype(str)
        b = new.obs.loc[shared, LABEL_KEY].astype(str)
        row["same_label"] = round(float((a.to_numpy() == b.to_numpy()).mean()), 4)
        counts = a.to_frame("old").assign(new=b.to_numpy()).value_counts()
        confusion: dict[str, dict[str, int]] = {}
        for (x, y), n in sorted(counts.items()):
            confusion.setdefault(x, {})[y] = int(n)
        row["label_confusion"] = _json(confusion)
    else:
        notes.append(f"no {LABEL_KEY} on one side")
    if row.get("same_label", 1.0) < 1:
        row["outcome"] = "labels changed"
    elif row.get("ari", 1.0) < 1:
        row["outcome"] = "clusters changed"
    elif len(shared) != len(old.obs) or len(shared) != len(new.obs):
        row["outcome"] = "cells changed"
    else:
        row["outcome"] = "unchanged" if not notes else "not compared"
    row["note"] = "; ".join(notes + old.problems + new.problems) or None
    return row


def compare_sample(name: str, old: Path | None, new: Path | None, one_folder: bool) -> dict:
    """The comparison row of one sample (records that are None: absent on that side)."""
    row: dict[str, Any] = {"sample": name}
    sides = {"old": read_side(old) if old else None, "new": read_side(new) if new else None}
    for prefix, side in sides.items():
        row.update(side_columns(prefix, side))
    a, b = sides["old"], sides["new"]
    if a is None and b is None:
        return {**row, "outcome": "not compared", "note": f"no analysis of {name} on either side"}
    if a is None and one_folder:
        return {**row, "outcome": "not reprocessed", "note": f"no earlier analysis in {PREVIOUS}/"}
    if a is None or b is None:
        missing = "old" if a is None else "new"
        present = "new" if a is None else "old"
        return {
            **row,
            "outcome": f"only in {present}",
            "note": f"no analysis on the {missing} side",
        }
    row.update(compare_results(a, b))
    if a.sample.world is not None and b.sample.world is not None:
        row["parameters_changed"] = "; ".join(changed_settings(a.sample, b.sample)) or None
        row["versions_changed"] = "; ".join(changed_versions(a.sample, b.sample)) or None
    return row


def _order(row: dict[str, Any]) -> tuple:
    return (
        OUTCOMES.index(row["outcome"]),
        row.get("same_label") if row.get("same_label") is not None else 2.0,
        row.get("ari") if row.get("ari") is not None else 2.0,
        row["sample"],
    )


def summary(rows: list[dict[str, Any]]) -> str:
    """The cohort in one line: how many of the compared samples changed labels, largest first."""
    compared = [r for r in rows if r.get("same_label") is not None]
    changed = [r for r in compared if r["outcome"] == "labels changed"]
    text = f"labels changed in {len(changed)} of {len(compared)} samples compared"
    if changed:
        text += ": " + ", ".join(
            f"{r['sample']} ({r['same_label']:.1%} of shared cells keep their label)"
            for r in changed
        )
    others = {o: sum(r["outcome"] == o for r in rows) for o in OUTCOMES[1:]}
    parts = [f"{o} in {n}" for o, n in others.items() if n and o != "unchanged"]
    return text + ("; " + "; ".join(parts) if parts else "")


def compare(
    old: Path, new: Path | None, outdir: Path, samples: list[str] | None = None
) -> list[dict[str, Any]]:
    """Compare and write OUTDIR/comparison.tsv and comparison.html; returns the rows, in order.
    ``new`` None: the current analyses in ``old`` against their newest previous/ one."""
    import pandas as pd

    from agent.record.durable import publish

    roots = [old] if new is None else [old, new]
    rows = []
    for name in sample_names(roots, samples):
        if new is None:
            current = old / SAMPLES / name
            before = newest_previous(current)
            after = SampleLayout(current).record if current.is_dir() else None
        else:
            before, after = (
                SampleLayout(root / SAMPLES / name).record
                if (root / SAMPLES / name).is_dir()
                else None
                for root in (old, new)
            )
        try:
            rows.append(compare_sample(name, before, after, one_folder=new is None))
        except Exception as e:  # one sample's surprise must not lose the others' comparison
            rows.append(
                {"sample": name, "outcome": "not compared", "note": f"{type(e).__name__}: {e}"}
            )
    rows.sort(key=_order)
    outdir.mkdir(parents=True, exist_ok=True)
    table = pd.DataFrame(
        [{c: r.get(c) for c in COLUMNS} for r in rows],
        columns=COLUMNS,
        dtype=object,  # counts stay integers beside missing values
    )
    publish(outdir / TSV, table.to_csv(sep="\t", index=False).encode())
    publish(outdir / HTML, render(rows, old, new).encode())
    return rows


def render(rows: list[dict[str, Any]], old: Path, new: Path | None) -> str:
    """comparison.html: the summary, one table row per sample, each sample's label confusion
    and records; the report's style sheet, nothing external."""
    from agent.pages import asset, fmt, templates

    def view(row: dict[str, Any]) -> dict[str, Any]:
        confusion = orjson.loads(row["label_confusion"]) if row.get("label_confusion") else {}
        labels = sorted({y for counts in confusion.values() for y in counts})
        return {
            **{c: fmt(row.get(c)) for c in COLUMNS},
            "outcome_class": {"unchanged": "good", "not reprocessed": "muted"}.get(
                row["outcome"], "warn" if row["outcome"].endswith("changed") else "bad"
            ),
            "same_label": f"{row['same_label']:.1%}" if row.get("same_label") is not None else "",
            "parameters": [p for p in (row.get("parameters_changed") or "").split("; ") if p],
            "versions": [v for v in (row.get("versions_changed") or "").split("; ") if v],
            "labels": labels,
            "confusion": [
                (x, [counts.get(y, 0) for y in labels]) for x, counts in confusion.items()
            ],
        }

    counts = {o: sum(r["outcome"] == o for r in rows) for o in OUTCOMES}
    return (
        templates()
        .get_template("comparison.html.j2")
        .render(
            css=asset("style.css"),
            generated=datetime.now(UTC).isoformat(timespec="seconds"),
            old=str(old),
            new=str(new) if new is not None else f"the current analyses in {old}",
            one_folder=new is None,
            summary=summary(rows),
            counts=counts,
            compared=sum(r.get("same_label") is not None for r in rows),
            rows=[view(r) for r in rows],
        )
    )


def copy_into_report(folder: Path | None, outdir: Path) -> list[Path]:
    """The comparison in ``folder`` copied into the report folder ``outdir`` (the report links
    it, and a report folder is shipped alone: `snakemake --report`); [] and no copy when
    ``folder`` holds none."""
    from agent.record.durable import publish

    sources = [folder / TSV, folder / HTML] if folder is not None else []
    if sources and all(p.is_file() for p in sources):
        for p in sources:
            publish(outdir / p.name, p.read_bytes())
        return [outdir / p.name for p in sources]
    for name in (TSV, HTML):  # an earlier report's copy would describe another run
        (outdir / name).unlink(missing_ok=True)
    return []


def input_records(tsv: Path) -> list[dict[str, str]]:
    """Every record the comparison in ``tsv`` read: sample, side, path and sha256."""
    import pandas as pd

    table = pd.read_csv(tsv, sep="\t", dtype=str, keep_default_na=False)
    return [
        {"sample": r["sample"], "side": side, "path": r[f"{side}_record"],
         "sha256": r[f"{side}_record_sha256"]}
        for r in table.to_dict("records")
        for side in ("old", "new")
        if r[f"{side}_record"]
    ]  # fmt: skip


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "old", type=Path, metavar="OLD",
        help=f"results folder of the earlier analyses ({SAMPLES}/NAME/ inside); alone, a results "
        f"folder whose samples' newest {PREVIOUS}/ analysis is compared with the current one",
    )  # fmt: skip
    p.add_argument(
        "new", type=Path, nargs="?", metavar="NEW",
        help="results folder of the reprocessed analyses",
    )  # fmt: skip
    p.add_argument("--outdir", type=Path, required=True, help="e.g. results/comparison")
    p.add_argument(
        "--samples", nargs="+", metavar="NAME",
        help="compare only these samples (default: every sample folder on either side)",
    )  # fmt: skip


def main(args: argparse.Namespace) -> int:
    for what, folder in (("OLD", args.old), ("NEW", args.new)):
        if folder is None:
            continue
        if not folder.is_dir():
            say.error(f"{what} {folder} is not a folder")
            return 2
        if not (folder / SAMPLES).is_dir():
            say.error(
                f"{what} {folder} is not a results folder: it has no {SAMPLES}/ "
                f"(expected {folder}/{SAMPLES}/NAME/{RECORD})"
            )
            return 2
    if args.outdir.exists() and not args.outdir.is_dir():
        say.error(f"--outdir {args.outdir} is not a folder")
        return 2
    try:
        rows = compare(args.old, args.new, args.outdir, args.samples)
    except OSError as e:
        say.error(f"cannot write the comparison into {args.outdir}: {e}")
        return 1
    print(f"{summary(rows)}; {args.outdir / HTML} and {TSV}")
    return 0
