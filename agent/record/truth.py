"""How well an analysis recovered a synthetic sample's planted truth (truth.tsv)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd
from sklearn.metrics import adjusted_rand_score

TRUTH_COLUMNS = ("barcode", "cell_type", "is_doublet", "is_damaged", "is_empty")


def read_truth(path: Path) -> pd.DataFrame:
    """truth.tsv indexed by barcode, or ValueError naming the file and what it lacks."""
    try:
        truth = pd.read_csv(path, sep="\t")
    except (OSError, pd.errors.ParserError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not a readable truth table ({type(e).__name__}: {e})") from None
    missing = [c for c in TRUTH_COLUMNS if c not in truth.columns]
    if missing:
        raise ValueError(f"{path}: truth table lacks columns {missing} (expected {TRUTH_COLUMNS})")
    return truth.set_index("barcode")


def score(kept: pd.DataFrame, truth: pd.DataFrame, cluster_key: str = "leiden") -> dict[str, Any]:
    """Scores of the cells an analysis kept (``kept``: its final obs) against the planted truth.

    - ``ari``: adjusted Rand index of the clusters vs the planted cell types, over the kept
      cells that are planted singlets (doublets and empty barcodes have no type to recover);
    - ``doublet_recall``: planted doublets absent from the final object / planted doublets;
    - ``damaged_removed`` and ``empty_removed``: the same for damaged cells and empty barcodes;
    - ``singlets_kept``: healthy planted singlets still present / healthy planted singlets.
    """
    truth = truth.copy()
    for col in ("is_doublet", "is_damaged", "is_empty"):
        truth[col] = truth[col].astype(str).str.lower().isin(("true", "1"))
    present = truth.index.isin(kept.index)
    unknown = int((~kept.index.isin(truth.index)).sum())

    def removed(flag: pd.Series) -> float | None:
        return round(float((~present[flag.to_numpy()]).mean()), 4) if flag.any() else None

    healthy = ~(truth["is_doublet"] | truth["is_damaged"] | truth["is_empty"])
    out: dict[str, Any] = {
        "doublet_recall": removed(truth["is_doublet"]),
        "damaged_removed": removed(truth["is_damaged"]),
        "empty_removed": removed(truth["is_empty"]),
        "singlets_kept": round(float(present[healthy.to_numpy()].mean()), 4)
        if healthy.any()
        else None,
        "planted_types": int(truth.loc[healthy, "cell_type"].nunique()),
        "cells_not_in_truth": unknown,
        "ari": None,
    }
    if cluster_key in kept.columns:
        singlets = truth.index[~(truth["is_doublet"] | truth["is_empty"]).to_numpy()]
        cells = kept.index.intersection(singlets)
        if len(cells) > 1:
            ari = adjusted_rand_score(truth.loc[cells, "cell_type"], kept.loc[cells, cluster_key])
            out["ari"] = round(float(ari), 4)
    return out
