"""Real sets derived from the shipped ones for checking the lineage-gated labels (issue 37): a
T-only subset, an NK-containing subset, a thinned copy and a targeted panel, each analysed by the
reference recipe up to annotate_clusters, and their agreement with the published labels per
type. tests/test_tools_lineage.py and bench/label_agreement.py share them."""

from __future__ import annotations

from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd
from scipy import sparse

from agent.data.real import REAL_SETS, shipped_file
from agent.testing.reference_run import run_reference
from agent.tools.session import Session

CD3 = ["CD3D", "CD3E", "CD3G"]
T_LABELS = ("T", "CD4 T", "CD8 T", "CD4 naive T", "CD4 memory T", "Treg", "CD8 naive T",
            "CD8 effector-memory T")  # fmt: skip
T_SORTS = ("CD4+/CD25 T Reg", "CD4+/CD45RA+/CD25- Naive T", "CD4+/CD45RO+ Memory",
           "CD8+ Cytotoxic T", "CD8+/CD45RA+ Naive Cytotoxic")  # fmt: skip
CD8_TYPES = ("CD8+ Cytotoxic T", "CD8+/CD45RA+ Naive Cytotoxic")
# published type -> labels that agree with it at the lineage level (a type of the lineage, its
# group, or the lineage's own name where the subtype could not be told)
LINEAGE_AGREES = {
    "CD14+ Monocyte": {"CD14 Mono", "FCGR3A Mono", "Macrophage", "Myeloid"},
    "CD19+ B": {"B", "Plasma"},
    "CD34+": {"HSPC"},
    "CD56+ NK": {"NK"},
    "Dendritic": {"DC", "pDC", "Mature DC"},
    **{key: set(T_LABELS) for key in T_SORTS},
}
TUNING = "CellTypist all genes"  # the set the lineage thresholds were chosen on


def thinned(adata: ad.AnnData, share: float, seed: int = 0) -> ad.AnnData:
    """Each UMI kept with probability ``share`` (binomial thinning): the same cells, shallower."""
    counts = sparse.csr_matrix(adata.X).copy()
    counts.data = np.random.default_rng(seed).binomial(counts.data.astype(np.int64), share)
    counts.data = counts.data.astype(np.float32)
    counts.eliminate_zeros()
    return ad.AnnData(counts, obs=adata.obs[[]], var=adata.var[[]])


def held_out_inputs() -> dict[str, tuple[ad.AnnData, pd.Series | None]]:
    """The derived inputs (raw counts) with their published labels where they have them, and
    the tuning set (TUNING) as the panel's reference; empty where the packages that ship the
    sets are not installed."""
    found = {name: shipped_file(real) for name, real in REAL_SETS.items()}
    sets: dict[str, tuple[ad.AnnData, pd.Series | None]] = {}
    if found["pbmc68k_reduced"] is not None:
        counts, published = REAL_SETS["pbmc68k_reduced"].read(found["pbmc68k_reduced"])
        t_only = published.isin(T_SORTS).to_numpy()
        with_nk = published.isin(["CD56+ NK", *CD8_TYPES, "CD4+/CD45RO+ Memory"]).to_numpy()
        sets["pbmc68k T cells"] = (counts[t_only].copy(), published[t_only])
        sets["pbmc68k NK and T"] = (counts[with_nk].copy(), published[with_nk])
        sets["pbmc68k half depth"] = (thinned(counts, 0.5), published)
    if found["pbmc_small"] is not None:
        sets["pbmc_small"] = (REAL_SETS["pbmc_small"].read(found["pbmc_small"])[0], None)
    if found["celltypist_sample"] is not None and found["pbmc68k_reduced"] is not None:
        full = REAL_SETS["celltypist_sample"].read(found["celltypist_sample"])[0]
        panel = [g for g in counts.var_names if g in set(full.var_names)]
        sets["CellTypist panel"] = (full[:, panel].copy(), None)
        sets[TUNING] = (full, None)  # the panel's reference, not held out
    return sets


def analyse(adata: ad.AnnData, folder: Path) -> Session:
    """The reference recipe up to annotate_clusters on ``adata`` (raw counts)."""
    folder.mkdir(parents=True, exist_ok=True)
    adata.write_h5ad(folder / "input.h5ad")
    session, _ = run_reference(
        folder / "input.h5ad", folder / "run", stop_after="annotate_clusters"
    )
    return session


def agreement(labels: pd.Series, published: pd.Series) -> dict[str, float]:
    """Per published type, the share of its cells whose label agrees at the lineage level."""
    published = published.loc[labels.index].astype(str)
    return {
        kind: round(float(labels[published == kind].astype(str).isin(agrees).mean()), 3)
        for kind, agrees in LINEAGE_AGREES.items()
        if (published == kind).any()
    }


def detected(session: Session, genes: list[str]) -> pd.Series:
    """Per Leiden cluster, the share of cells with a count of one of ``genes`` (those present)."""
    adata = session.adata
    present = [g for g in genes if g in adata.var_names]
    counts = adata[:, present].layers["counts"]
    hits = np.asarray((counts > 0).sum(axis=1)).ravel() > 0
    return pd.Series(hits).groupby(adata.obs["leiden"].astype(str).to_numpy()).mean()
