"""Reference annotation (annotate_celltypist) vs the marker sets, on held-out real cells.

No second labelled real set ships in the installed packages, so a CellTypist model is trained on
a seeded random half of scanpy's pbmc68k_reduced (the counts rebuilt from its .raw, published
Zheng 2017 bulk-profile labels) exactly as tests/test_tools_celltypist.py trains it
(agent/testing/celltypist_model.py), and the other half is analysed from its raw counts by the
reference recipe with the model as the run option: the marker labels (annotate_clusters, kept as 'cell_type_markers') and the model's (per cell, and
voted per Leiden cluster) land on the same cells, those the recipe kept.

Reported: accuracy against the published labels, overall and per published type: the model per
cell and voted (its labels are the published vocabulary), and all three at the lineage level
(LINEAGE below), the only level at which the marker sets' names can be compared with the
published ones; a marker label of no lineage there counts as wrong and is listed.

    python -m bench.celltypist_accuracy [--split-seed 0]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from bench import _report

# Lineage of each published label and of each marker set's name: the claim that makes the two
# vocabularies comparable (Zheng 2017's T subsets all T; the marker sets' monocyte and macrophage
# types all monocyte).
LINEAGE = {
    "CD14+ Monocyte": "monocyte", "Dendritic": "dendritic", "CD19+ B": "B",
    "CD4+/CD25 T Reg": "T", "CD4+/CD45RO+ Memory": "T", "CD4+/CD45RA+/CD25- Naive T": "T",
    "CD8+ Cytotoxic T": "T", "CD8+/CD45RA+ Naive Cytotoxic": "T", "CD56+ NK": "NK",
    "CD34+": "progenitor",
    # the marker sets (agent/data/markers.json)
    "CD4 T": "T", "CD8 T": "T", "CD4 naive T": "T", "CD4 memory T": "T", "Treg": "T",
    "CD8 naive T": "T", "CD8 effector-memory T": "T", "NK": "NK", "B": "B", "Plasma": "B",
    "CD14 Mono": "monocyte", "FCGR3A Mono": "monocyte", "Macrophage": "monocyte",
    "DC": "dendritic", "pDC": "dendritic", "Mature DC": "dendritic", "HSPC": "progenitor",
}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--split-seed", type=int, default=0, help="seed of the random half trained on")
    args = p.parse_args()

    import anndata as ad
    import numpy as np
    import pandas as pd

    from agent.data.real import REAL_SETS, shipped_file
    from agent.testing.celltypist_model import train_model, training_half
    from agent.testing.reference_run import run_reference

    real = REAL_SETS["pbmc68k_reduced"]
    source = shipped_file(real)
    if source is None:
        sys.exit(f"{real.file} of {real.package} is not installed")
    _report.header("Reference annotation (CellTypist model) vs marker sets on held-out real cells")
    counts, labels = real.read(source)
    train = training_half(counts.n_obs, args.split_seed)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = train_model(counts[train], labels[train], root / "pbmc_half.pkl")
        held_out = root / "held_out.h5ad"
        counts[~train].copy().write_h5ad(held_out)
        session, world = run_reference(held_out, root / "out", celltypist_model=model)
        final = ad.read_h5ad(session.layout.final)
    steps = {tool: world.last_ok(tool) for tool in ("annotate_clusters", "annotate_celltypist")}
    obs = final.obs
    truth = labels.loc[obs.index].astype(str)
    arms = {
        "model, per cell": obs["cell_type_predicted"].astype(str),
        "model, voted": obs["cell_type"].astype(str),
        "markers, voted": obs["cell_type_markers"].astype(str),
    }
    lineage = truth.map(LINEAGE)
    right = {name: values == truth for name, values in arms.items()}
    right_lineage = {name: values.map(LINEAGE) == lineage for name, values in arms.items()}

    print(
        f"trained on {int(train.sum())} cells (seed {args.split_seed}), {counts.n_vars} genes; "
        f"held out {int((~train).sum())}, of which the recipe kept {final.n_obs}"
    )
    for tool, entry in steps.items():
        print(f"{tool}: {entry.seconds:.2f} s")
    weak = steps["annotate_celltypist"].result["weak_clusters"]
    print(f"model's weak clusters (rule: {steps['annotate_celltypist'].result['rule']}): {weak}")
    rows = [
        [name, f"{right[name].mean():.3f}" if name.startswith("model") else "-",
         f"{right_lineage[name].mean():.3f}"]
        for name in arms
    ]  # fmt: skip
    print("\noverall accuracy against the published labels")
    print(_report.table(["labels", "published type", "lineage"], rows))

    per_type = []
    for label, n in truth.value_counts().items():
        cells = (truth == label).to_numpy()
        per_type.append([
            label, LINEAGE[label], n,
            *(f"{right[name][cells].mean():.2f}" for name in arms if name.startswith("model")),
            *(f"{right_lineage[name][cells].mean():.2f}" for name in arms),
        ])  # fmt: skip
    print("\nper published type (fraction of its cells labelled right)")
    headers = ["published type", "lineage", "cells", "model/cell", "model/voted",
               "lin. model/cell", "lin. model/voted", "lin. markers"]  # fmt: skip
    print(_report.table(headers, per_type, left=2))
    unmapped = pd.Series(arms["markers, voted"]).loc[lambda s: ~s.isin(list(LINEAGE))]
    print(
        "\nmarker labels of no lineage here (counted wrong): "
        + (", ".join(f"{k} ({v})" for k, v in unmapped.value_counts().items()) or "none")
    )
    print(f"cells whose published type has no lineage: {int(np.sum(lineage.isna()))}")
    print(_report.load_line("at end"))


if __name__ == "__main__":
    main()
