"""Each cell's sample and label across the cohort, and its raw counts summed per sample and label
(pseudobulk): what the composition and the condition tests read.

Labels come from the cohort object (`agent integrate`: one annotation of all samples together,
so that a type has one name in every sample) when it integrated exactly the finished analyses
given, else from each finished sample's own final object (obs['cell_type'], as its analysis
labelled it). Which one is in `Cells.source`, with the files and their sha256. Counts are
layers['counts'] (raw integers), summed over a label's cells, on the genes every sample kept.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from agent.cohort.integrate import LABEL, OBJECT, InputRecord, is_integrated, read_summary


@dataclass
class Cells:
    """One row per cell: ``sample`` and ``label``; where they were read (``source``); the
    samples left out (sample -> why)."""

    table: pd.DataFrame
    source: dict[str, Any]
    records: list[InputRecord]
    left_out: dict[str, str] = field(default_factory=dict)

    @property
    def from_cohort_object(self) -> bool:
        return self.source["labels"] == "cohort object"

    def counts(self) -> pd.DataFrame:
        """Cells per sample (rows, in the records' order) and label (columns, largest first)."""
        table = pd.crosstab(self.table["sample"], self.table["label"])
        samples = [r.sample for r in self.records if r.sample in table.index]
        return table.loc[samples, table.sum().sort_values(ascending=False, kind="stable").index]

    def pseudobulk(self, pairs: list[tuple[str, str]]) -> pd.DataFrame:
        """Raw counts summed over the cells of each (sample, label) of ``pairs``: one row per
        pair (index 'SAMPLE|LABEL'), one column per gene every sample kept. Reads one final
        object at a time (or the cohort object once)."""
        import anndata as ad

        wanted: dict[str, list[str]] = {}
        for sample, label in pairs:
            wanted.setdefault(sample, []).append(label)
        if self.from_cohort_object:
            whole = ad.read_h5ad(self.source["object"])
            of_sample = whole.obs["sample"].astype(str).to_numpy()
            parts = ((s, whole[of_sample == s]) for s in wanted)
        else:
            files = {r.sample: r.adata for r in self.records}
            parts = ((s, ad.read_h5ad(files[s])) for s in wanted)
        sums: dict[str, pd.Series] = {}
        genes: pd.Index | None = None
        for sample, one in parts:
            labels = one.obs[LABEL].astype(str).to_numpy()
            var = pd.Index(one.var_names.astype(str))
            genes = var if genes is None else genes.intersection(var, sort=False)
            for label in wanted[sample]:
                total = one.layers["counts"][labels == label].sum(axis=0)
                sums[f"{sample}|{label}"] = pd.Series(np.asarray(total).ravel(), index=var)
        frame = pd.DataFrame({k: v.loc[genes] for k, v in sums.items()}).T
        return frame.round().astype(np.int64)


def _cohort_object(cohort_dir: Path | None, records: list[InputRecord]) -> tuple[Path | None, str]:
    """The cohort object to read labels from, or None, and why (for the summary)."""
    if cohort_dir is None:
        return None, "no cohort object given"
    summary = read_summary(cohort_dir)
    if summary is None or not is_integrated(summary):
        return None, f"no cohort object in {cohort_dir}"
    made_of = {r["sample"]: r["adata_sha256"] for r in summary["inputs"]}
    given = {r.sample: r.adata_sha256 for r in records}
    if made_of != given:
        differ = sorted(set(made_of.items()) ^ set(given.items()))
        return None, (
            f"the cohort object in {cohort_dir} integrated other analyses than those given "
            f"(first differing: {differ[0][0]})"
        )
    return cohort_dir / summary.get("object", OBJECT), "the cohort object integrated them all"


def read_cells(records: list[InputRecord], cohort_dir: Path | None = None) -> Cells:
    """Every cell's sample and label, from the cohort object in ``cohort_dir`` when it
    integrated exactly ``records``, else from each record's final object."""
    from agent.record.collect import read_obs
    from agent.record.provenance import file_sha256

    obj, why = _cohort_object(cohort_dir, records)
    if obj is not None:
        obs = read_obs(obj, ["sample", LABEL])
        table = pd.DataFrame(
            {"sample": obs["sample"].astype(str).to_numpy(), "label": obs[LABEL].astype(str)}
        )
        source = {
            "labels": "cohort object", "object": str(obj.resolve()),
            "object_sha256": file_sha256(obj), "why": why,
        }  # fmt: skip
        return Cells(table, source, records)
    parts, kept, left_out = [], [], {}
    for record in records:
        obs = read_obs(Path(record.adata), [LABEL])
        if LABEL not in obs:
            left_out[record.sample] = f"{record.adata}: no obs['{LABEL}'] (its labels)"
            continue
        labels = obs[LABEL].astype(str).to_numpy()
        parts.append(pd.DataFrame({"sample": record.sample, "label": labels}))
        kept.append(record)
    table = (
        pd.concat(parts, ignore_index=True) if parts else pd.DataFrame(columns=["sample", "label"])
    )
    source = {"labels": "each sample's final object", "why": why}
    return Cells(table, source, kept, left_out)
