"""Parameter drift and outcome outliers: robust distance from the cohort median, in MADs.

A value is flagged when ``|x - median| / scale > threshold`` with
``scale = max(1.4826 * MAD, floor * |median|, 1e-9)``: 1.4826 makes the MAD a standard
deviation for normal data; the floor keeps a cohort that agrees exactly (MAD = 0) from flagging
every tiny difference. Only columns with at least ``MIN_SAMPLES`` numbers are judged.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

THRESHOLD = 3.5  # MADs (Iglewicz and Hoaglin's cut-off for the modified z-score)
FLOOR = 0.1  # the scale is at least this fraction of the median
MIN_SAMPLES = 3
OUTCOMES = ("cells_kept_fraction", "clusters", "doublets_removed_fraction")


@dataclass(frozen=True)
class Flag:
    sample: str
    column: str
    value: float
    median: float
    distance: float  # in (floored) MADs, signed

    def __str__(self) -> str:
        return (
            f"{self.column}={self.value:.4g} is {abs(self.distance):.1f} MADs "
            f"{'above' if self.distance > 0 else 'below'} the cohort median {self.median:.4g}"
        )


def numeric(column: pd.Series) -> pd.Series | None:
    """The column as floats, or None when it holds anything but numbers (and gaps)."""
    present = column.dropna()
    if present.empty or not all(
        isinstance(v, int | float | np.number) and not isinstance(v, bool | np.bool_)
        for v in present
    ):
        return None
    return column.astype(float)


def robust_flags(
    table: pd.DataFrame, columns: list[str], threshold: float = THRESHOLD, floor: float = FLOOR
) -> list[Flag]:
    flags = []
    for col in columns:
        values = numeric(table[col]) if col in table else None
        if values is None or values.notna().sum() < MIN_SAMPLES:
            continue
        median = float(values.median())
        mad = float((values - median).abs().median())
        scale = max(1.4826 * mad, floor * abs(median), 1e-9)
        for sample, x in zip(table["sample"], values, strict=True):
            if np.isnan(x):
                continue
            distance = (x - median) / scale
            if abs(distance) > threshold:
                flags.append(Flag(str(sample), col, x, median, round(distance, 2)))
    return flags


def outcome_table(table: pd.DataFrame) -> pd.DataFrame:
    """The outcome columns judged for outliers (doublets removed as a fraction of cells)."""
    out = table[["sample", "cells_kept_fraction", "clusters"]].copy()
    before = pd.to_numeric(table["cells_before"], errors="coerce")
    removed = pd.to_numeric(table["doublets_removed"], errors="coerce")
    out["doublets_removed_fraction"] = [
        None if np.isnan(r) or np.isnan(b) or b == 0 else round(r / b, 4)
        for r, b in zip(removed, before, strict=True)
    ]
    return out


def flag_cohort(
    table: pd.DataFrame, parameters: list[str], threshold: float = THRESHOLD, floor: float = FLOOR
) -> tuple[list[Flag], list[Flag]]:
    """(parameter drift flags, outcome outlier flags) over the samples that finished."""
    done = table[table["status"] == "finished"].reset_index(drop=True)
    drift = robust_flags(done, parameters, threshold, floor)
    outliers = robust_flags(outcome_table(done), list(OUTCOMES), threshold, floor)
    return drift, outliers
