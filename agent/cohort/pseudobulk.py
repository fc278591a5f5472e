"""Which cell types a pseudobulk test of conditions can use, and which samples within each.

A sample's pseudobulk of a label is the sum of the raw counts of its cells of that label; it
enters the label's test only with at least ``min_cells`` cells (fewer make a profile of a few
cells' noise), and the label is tested only where at least ``min_samples`` such samples remain
in each of two or more conditions, the reference among them (conditions.design). Every label
not tested is kept with why, the cells of each sample named, never dropped silently.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from agent.cohort.conditions import Design, design


@dataclass(frozen=True)
class LabelPlan:
    """One label: its comparison (samples with enough cells, per condition), the cells of each
    sample, and those below ``min_cells``."""

    label: str
    design: Design
    cells: dict[str, int]
    too_few: dict[str, int]

    @property
    def tested(self) -> bool:
        return self.design.testable

    def why_not(self, min_cells: int) -> str:
        few = ", ".join(f"{s} {n}" for s, n in self.too_few.items())
        below = f"; below {min_cells} cells: {few}" if few else ""
        return f"{self.design.statement}{below}"


def plan_labels(
    counts: pd.DataFrame, sheet: dict[str, dict[str, str]], column: str, min_cells: int,
    min_samples: int, reference: str | None, overall: Design,
) -> list[LabelPlan]:  # fmt: skip
    """One plan per label of ``counts`` (cells per sample x label), among the samples the
    cohort's comparison ``overall`` uses, with the cohort's reference (so that every label
    compares the same conditions the same way round)."""
    plans = []
    for label in counts.columns:
        cells = {s: int(counts.at[s, label]) for s in overall.samples}
        enough = [s for s, n in cells.items() if n >= min_cells]
        plan = design(enough, sheet, column, min_samples, reference or overall.reference)
        too_few = {s: n for s, n in cells.items() if n < min_cells}
        plans.append(LabelPlan(label, plan, cells, too_few))
    return plans
