"""Lineage gates: which blood lineage (T, NK, B, myeloid...) a cluster belongs to, from genes that
must be present and genes that must be absent, before any subtype is chosen inside it.

A cluster passes a lineage's gate when its defining genes are present and the genes the lineage
lacks are absent (NK: CD3D/CD3E/CD3G absent; B, myeloid...: no CD3 either), each judged two ways:

- detection, an absolute rule: the share of the cluster's cells with a count of at least one of
  the genes;
- level against the sample's strongest cluster: per gene, the cluster's mean share of the cells'
  expression over the highest such mean among the clusters; the set's level is the mean of its
  two highest genes. Ambient RNA is detected widely (LYZ and CST3 in 88% of the T and NK cells
  of CellTypist's tissue sample) but at a small fraction of its source's level (6-8% there), so
  detection alone cannot say present, and a sample of one lineage has no other cluster to be
  ranked against, so level alone cannot either.

Present: detection >= PRESENT_DETECTION and level >= PRESENT_LEVEL, and the genes mark some
clusters and not others: their level in the clusters that fail the detection test (where none
does, as with ambient genes detected everywhere: the clusters that fail the level test) is at
most 1/SPECIFIC of the highest (per gene, its mean over those clusters floored at FLOOR; the
median over the set's genes, so one gene missing from one small cluster does not make genes
expressed everywhere specific), so a sample mostly of one lineage is still compared with its
few other clusters; or, alike everywhere, the genes are detected in at least UNIFORM_DETECTION
of every cluster's cells, in a sample of one lineage only: where another lineage's gate passes
on specific genes, genes alike in every cluster are expressed by the whole sample (housekeeping
or background genes, as in the synthetic demo, where such genes reach 88% of the cells of
their least-detecting cluster), not a lineage.

Absent, in this order (the test that held is kept as ``absent_by``):
- "detection": at most ABSENT_DETECTION of the cells detect the genes (an NK-only sample has no
  T cells to compare the CD3 level with, so this absolute rule decides there);
- "ambient level": their level is at most AMBIENT_LEVEL, whatever the detection: deep data
  detect ambient RNA in most cells, at a level that does not grow with depth;
- "level": their level is at most ABSENT_LEVEL and under PRESENT_DETECTION of the cells detect
  them. Such a cluster may hold some cells of the lineage that has these genes (up to about its
  level's share), so a label that passes this way is flagged (``mixed``).

The thresholds and what chose them:
- PRESENT_DETECTION, PRESENT_LEVEL, ABSENT_DETECTION, ABSENT_LEVEL: CellTypist's sample alone
  (559 cells of a tissue, 32,786 genes, reference recipe, 2026-12; its clusters named by their
  canonical genes: T, NK, B with mature DC, monocytes, macrophages). Its lineage clusters had
  detection >= 0.64 and level >= 0.74; every lineage a cluster does not belong to had detection
  <= 0.28 or level <= 0.38 (myeloid genes in the B cluster: detection 0.74, level 0.38; LYZ is
  ambient there); its NK cluster detects CD3 in 23% of cells at level 0.23 of the T cluster, its
  T cluster in 70% at level 1.
- AMBIENT_LEVEL: about twice the highest level of genes ambient in most cells of CellTypist's
  clusters (myeloid genes in its T and NK clusters: 88% detection at level 0.06-0.08), for
  samples with up to twice its contamination.
- SPECIFIC, FLOOR: CellTypist's lineage genes stand 5 to 50 times above the clusters that fail
  their test; genes a sample expresses everywhere at a low level are no lineage: the synthetic
  demo's background genes (MZB1, PRSS57) stand 1.7-2.4 times above their lowest clusters.
- UNIFORM_DETECTION: above the synthetic small sample's background genes (detected in up to 73%
  of the cells of their least-detecting cluster; the larger demo samples reach 88%, which the
  one-lineage condition keeps out). It was checked on
  pbmc68k_reduced's T sorts (CD3 in 93-100% of each cluster's cells), which the tests use too:
  not held out. CellTypist's shallow tissue T cells detect CD3 in 70% only, so a one-lineage T
  sample that shallow stays Unknown (a known limit).
The tests check them on sets they were not chosen on: scanpy's pbmc68k_reduced (whole, T cells
only, NK with CD8 T, thinned to half its depth), Seurat's pbmc_small and a targeted-panel
version of the CellTypist sample (tests/test_tools_lineage.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
from scipy import sparse

PRESENT_DETECTION = 0.5
PRESENT_LEVEL = 0.5
ABSENT_DETECTION = 0.3
ABSENT_LEVEL = 0.35
AMBIENT_LEVEL = 0.15
TOP_GENES = 2  # a set's level: the mean of its genes' levels, the highest this many
SPECIFIC = 3.0
FLOOR = 0.02
UNIFORM_DETECTION = 0.8


def gate_rule() -> str:
    """The lineage gate in words, as the result and uns state it."""
    return (
        f"a lineage's genes are present when at least {PRESENT_DETECTION:.0%} of the cluster's "
        f"cells detect one of them, their level (mean of the {TOP_GENES} highest, each as a "
        f"share of the gene's highest cluster mean) is at least {PRESENT_LEVEL:.0%}, and they "
        f"mark some clusters ({SPECIFIC:g}-fold over the clusters that fail the detection test, "
        f"else the level test) or are detected in {UNIFORM_DETECTION:.0%} of every cluster's "
        f"cells; absent when "
        f"at most {ABSENT_DETECTION:.0%} of cells detect them, or their level is at most "
        f"{AMBIENT_LEVEL:.0%} (ambient), or at most {ABSENT_LEVEL:.0%} with under "
        f"{PRESENT_DETECTION:.0%} of cells detecting them (flagged: part of the cells may carry "
        "them); a cluster passes a lineage's gate when its present genes are present and its "
        "absent genes absent"
    )


def _shares(matrix: sparse.csr_matrix, column: np.ndarray) -> np.ndarray:
    """Each cell's expression of the ``column`` genes as shares of its total, from
    log1p-normalised values (only the totals read the whole matrix)."""
    rows = np.repeat(np.arange(matrix.shape[0]), np.diff(matrix.indptr))
    totals = np.bincount(rows, weights=np.expm1(matrix.data), minlength=matrix.shape[0])
    totals[totals == 0] = 1.0
    return np.expm1(matrix[:, column].toarray().astype(np.float64)) / totals[:, None]


def gene_profile(values: Any, names: Any, clusters: Any, genes: list[str]) -> dict[str, Any]:
    """Per cluster, for ``genes`` (as the data spell them): which cells detect each gene (a
    count above zero), and each gene's level relative to its highest cluster."""
    column = pd.Index(np.asarray(names).astype(str)).get_indexer(genes)
    matrix = sparse.csr_matrix(values)
    groups = clusters.to_numpy()
    mean = pd.DataFrame(_shares(matrix, column), columns=genes).groupby(groups).mean()
    highest = mean.max().replace(0.0, np.nan)
    return {"genes": genes, "cells": matrix[:, column] > 0, "groups": groups,
            "level": (mean / highest).fillna(0.0)}  # fmt: skip


def _judge(profile: dict[str, Any], genes: list[str]) -> tuple[pd.Series, pd.Series]:
    """Detection (any of ``genes``) and level (mean of the TOP_GENES highest) per cluster."""
    column = [profile["genes"].index(g) for g in genes]
    any_detected = np.asarray(profile["cells"][:, column].sum(axis=1)).ravel() > 0
    detection = pd.Series(any_detected).groupby(profile["groups"]).mean()
    level = profile["level"][genes].apply(
        lambda row: float(np.sort(row.to_numpy())[::-1][:TOP_GENES].mean()), axis=1
    )
    return detection, level


def _specificity(levels: pd.DataFrame, others: pd.Series) -> float:
    """How much the genes mark some clusters over ``others`` (cluster -> whether it is one):
    per gene, its highest cluster level (1) over its mean level there, floored at FLOOR; the
    median over the set's genes, so one gene missing from one small cluster does not make genes
    expressed everywhere specific. NaN where there are no others."""
    if not others.any():
        return np.nan
    background = levels.loc[others[others].index].mean().clip(lower=FLOOR)
    return float(np.median((1.0 / background).to_numpy()))


def _present(detection: float, level: float) -> bool:
    return detection >= PRESENT_DETECTION and level >= PRESENT_LEVEL


def _absent_by(detection: float, level: float) -> str:
    """Which absent test holds ('' where none does), in the module's order."""
    if detection <= ABSENT_DETECTION:
        return "detection"
    if level <= AMBIENT_LEVEL:
        return "ambient level"
    if level <= ABSENT_LEVEL and detection < PRESENT_DETECTION:
        return "level"
    return ""


def lineage_table(
    values: Any, names: Any, clusters: Any, lineages: dict[str, dict[str, list[str]]]
) -> pd.DataFrame:
    """One row per cluster and lineage: detection and level of the present genes and of the
    absent ones, whether each holds (and by which test), whether the gate passed, whether it
    passed only as a possible mix (``mixed``) with the lineage whose genes it lacks
    (``lacked_of``), and the gate in words.

    ``lineages``: name -> {"present": genes, "absent": genes, "undetected": lacked genes a
    gene filter removed as detected in too few cells (absent everywhere)}, spelled as the data
    spell them (a lineage without present genes in the data is left out by the caller)."""
    genes = [g for spec in lineages.values() for k in ("present", "absent") for g in spec[k]]
    profile = gene_profile(values, names, clusters, list(dict.fromkeys(genes)))
    rows = []
    for name, spec in lineages.items():
        lacked = set(spec["absent"]) | set(spec.get("undetected", []))
        # the lineage whose genes these are (NK lacks CD3: T), a mixed cluster's other part
        owner = next((o for o, s in lineages.items() if lacked & set(s["present"])), "")
        detection, level = _judge(profile, spec["present"])
        absent = _judge(profile, spec["absent"]) if spec["absent"] else None
        fails = detection < PRESENT_DETECTION
        if not fails.any():  # detected everywhere: compared with the clusters where it is low
            fails = level < PRESENT_LEVEL
        marks = _specificity(profile["level"][spec["present"]], fails)
        uniform = float(detection.min())  # where the genes are alike in every cluster
        for cluster in detection.index:
            d, v = float(detection[cluster]), float(level[cluster])
            row = {
                "cluster": cluster, "lineage": name, "present_detection": d, "present_level": v,
                "specificity": marks, "lowest_detection": uniform,
                "present_ok": _present(d, v)
                and (marks >= SPECIFIC or uniform >= UNIFORM_DETECTION),
                "absent_detection": np.nan, "absent_level": np.nan, "absent_by": "none lacked",
                "lacked_of": owner,
            }  # fmt: skip
            if absent is not None:
                lacking = float(absent[0][cluster]), float(absent[1][cluster])
                row.update(absent_detection=lacking[0], absent_level=lacking[1])
                row["absent_by"] = _absent_by(*lacking)
            elif spec.get("undetected"):  # filtered out as undetected: absent everywhere
                row.update(absent_detection=0.0, absent_level=0.0, absent_by="filtered out")
            row["absent_ok"] = bool(row["absent_by"])
            rows.append(row)
    table = pd.DataFrame(rows)
    specific = table["specificity"] >= SPECIFIC
    present = table["present_ok"]
    # genes alike in every cluster mark a sample of one lineage only: where another lineage
    # passes as specific, they are genes the whole sample expresses (housekeeping, background)
    one_lineage = not (present & specific & table["absent_ok"]).any()
    table["present_ok"] = present & (specific | one_lineage)
    table["one_lineage"] = one_lineage
    table["passed"] = table["present_ok"] & table["absent_ok"]
    table["mixed"] = table["passed"] & (table["absent_by"] == "level")
    table["gate"] = [
        _describe(r["lineage"], lineages[r["lineage"]], r) for r in table.to_dict("records")
    ]
    return table


def _describe(name: str, spec: dict[str, list[str]], row: dict[str, Any]) -> str:
    """The gate's outcome in words: what was measured and which test failed."""
    present = "/".join(spec["present"][:4]) + ("..." if len(spec["present"]) > 4 else "")
    fold, lowest = row["specificity"], row["lowest_detection"]
    marks = (
        f"{fold:.1f}-fold over the clusters without them"
        if fold >= SPECIFIC or (lowest < UNIFORM_DETECTION and not np.isnan(fold))
        else f"every cluster's detection {lowest:.0%}"
    )
    why = " (not present)"
    if fold < SPECIFIC and lowest >= UNIFORM_DETECTION and not row["one_lineage"]:
        why = " (not present: alike in every cluster, where other lineages mark some)"
    said = [
        f"{present} detected in {row['present_detection']:.0%} of cells, level "
        f"{row['present_level']:.0%}, {marks}" + ("" if row["present_ok"] else why)
    ]
    lacked = spec["absent"] or spec.get("undetected")
    if lacked:
        verdict = f"absent by {row['absent_by']}" if row["absent_ok"] else "not absent"
        if row["absent_by"] == "level":
            verdict += ": part of the cells may carry them"
        said.append(
            f"{'/'.join(lacked)} detected in {row['absent_detection']:.0%}, level "
            f"{row['absent_level']:.0%} ({verdict})"
        )
    return f"{name} gate {'passed' if row['passed'] else 'failed'}: " + "; ".join(said)
