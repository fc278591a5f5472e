"""Cell-type labels from a CellTypist model the user supplies, voted per cluster.

CellTypist (Dominguez Conde et al. 2022) is a logistic-regression classifier trained on labelled
reference cells: it carries labels of the reference's tissue, where the built-in marker sets only
know immune cells. The model is a file the user gives (``--celltypist-model``); nothing is
downloaded. It is a pickle, as CellTypist writes them, so the tool reads no file but the run's
model, through an allow-list of a model's classes, and checks its sha256 against the run's
setting at every use (agent/celltypist_model.py).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated, Any

import anndata as ad
import numpy as np
import pandas as pd
import scanpy as sc
from pydantic import Field
from scipy import sparse

from agent.celltypist_model import ModelRefused, read_model
from agent.registry import ToolError, tool
from agent.tools.annotate import UNKNOWN, _natural
from agent.tools.common import Key, Limit, counts_matrix, left_out, obs_column, sizes
from agent.tools.doublets import flagged
from agent.tools.session import Session

UNS_KEY = "annotation_celltypist"
FLAGGED = "<flagged doublets>"  # the voting group of the doublets a run keeps: no cluster's
# A model whose genes the data mostly lack predicts from a fraction of its coefficients: refuse.
MIN_SHARED_FRACTION = 0.5
CELLTYPIST_TARGET_SUM = 1e4  # CellTypist's models are trained on log1p(counts per 10,000)


def _rule(min_vote_share: float, min_confidence: float) -> str:
    return (
        f"'{UNKNOWN}' when the majority label holds less than {min_vote_share:.0%} of the "
        "cluster's cells; flagged weak (obs '<key_added>_ambiguous') then too, or when the "
        f"cluster's mean confidence (the model's highest probability per cell) is below "
        f"{min_confidence}"
    )


def import_celltypist() -> Any:
    """celltypist, imported without its side effect on logging: it calls logging.basicConfig at
    import, which would print every library's INFO messages (httpx's requests...) for the rest of
    the run; its own warnings still show through logging's last-resort handler."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    import celltypist

    root.handlers[:], root.level = handlers, level
    return celltypist


def _load_model(session: Session, model_file: str | None) -> tuple[Any, Path, str]:
    """The run's CellTypist model (``model_file``, when given, must name it: no other file is
    unpickled), its path and the sha256 of the bytes read, which must be the run's setting's."""
    path = session.celltypist_model
    if path is None:
        raise ToolError(
            "annotate_celltypist: this run has no CellTypist model (agent run --celltypist-model); "
            "no other file is read as one (a model is a pickle, which can run code)"
        )
    if model_file is not None and Path(model_file) not in (path, Path(path.name)):
        raise ToolError(
            f"annotate_celltypist: only the run's model ({path.name}) is read, not {model_file} "
            "(a model is a pickle, which can run code); leave model_file out"
        )
    try:
        doc, sha256 = read_model(path, session.celltypist_model_sha256)
    except ModelRefused as e:
        raise ToolError(f"annotate_celltypist: {e}") from None
    model = import_celltypist().models.Model(doc["Model"], doc["Scaler_"], doc["description"])
    return model, path, sha256


def _celltypist_input(adata: Any) -> ad.AnnData:
    """log1p of counts per 10,000 for every gene that passed filtering, as CellTypist expects."""
    if adata.raw is None:  # X may hold regress_out's residuals; the counts layer has every gene
        values = sparse.csr_matrix(counts_matrix(adata), dtype=np.float64)
    else:  # X holds the highly variable genes only; .raw keeps all, log-normalised by normalize
        values = sparse.csr_matrix(adata.raw.X, dtype=np.float64).expm1()
    genes = (adata if adata.raw is None else adata.raw).var_names
    query = ad.AnnData(
        values, obs=pd.DataFrame(index=adata.obs_names), var=pd.DataFrame(index=genes)
    )
    sc.pp.normalize_total(query, target_sum=CELLTYPIST_TARGET_SUM)
    sc.pp.log1p(query)
    return query


def _model_meta(model: Any, path: Path, sha256: str, shared: int) -> dict[str, Any]:
    """What identifies the model: its file, checksum and its description (h5ad-safe: no None)."""
    description = model.description if isinstance(model.description, dict) else {}
    n_genes = len(model.features)
    return {
        "name": path.name,
        "path": str(path),
        "sha256": sha256,
        "version": str(description.get("version") or "not given"),
        "date": str(description.get("date") or "not given"),
        "details": str(description.get("details") or "")[:300],
        "source": str(description.get("source") or ""),
        "n_cell_types": len(model.cell_types),
        "n_model_genes": n_genes,
        "n_genes_found": shared,
        "fraction_found": round(shared / n_genes, 3),
    }


@tool(
    "annotate", needs=("normalize",), expensive=True, stage="labels", clustering="groupby",
    loosens={"min_vote_share": "lower", "min_confidence": "lower"},
)  # fmt: skip
def annotate_celltypist(
    session: Session,
    model_file: str | None = None,
    groupby: Key = "leiden",
    key_added: Key = "cell_type",
    min_vote_share: Annotated[float, Field(ge=0, le=1)] = 0.5,
    min_confidence: Annotated[float, Field(ge=0, le=1)] = 0.5,
    limit: Limit = 40,
) -> dict[str, Any]:
    """Label cells with a reference CellTypist model, then each cluster by majority vote.

    CellTypist predicts each cell's type from log1p(counts per 10,000) of the model's genes
    (rebuilt from the counts, whatever normalize's target), then gives each cluster the label most
    of its cells got (CellTypist's majority voting over the groupby clusters). Per cell: the
    predicted label ('<key_added>_predicted') and confidence, the model's highest probability
    ('<key_added>_confidence'). A cluster whose majority label holds less than min_vote_share of
    its cells is 'Unknown'; it, and one whose mean confidence is below min_confidence, is flagged
    in '<key_added>_ambiguous'. Refused when the data hold under half the model's genes. Cells
    predicted to be doublets and kept (a run that flags them) do not vote; they take their
    cluster's label.

    Args:
        model_file: The run's CellTypist model (agent run --celltypist-model), by its file name;
            leave out for the same. No other file is read.
        groupby: Cell annotation (obs column) with the clusters to vote over.
        key_added: Cell annotation (obs column) to store the voted labels in.
        min_vote_share: A cluster whose majority label has a smaller share of its cells is
            labelled 'Unknown'.
        min_confidence: A cluster whose cells' mean confidence is lower is flagged.
        limit: Clusters listed at most in the result.
    """
    adata = session.adata
    clusters = obs_column(
        adata, groupby, "annotate_celltypist", "call leiden first (or give another groupby)"
    ).astype(str)
    model, path, sha256 = _load_model(session, model_file)
    query = _celltypist_input(adata)
    shared = int(np.isin(query.var_names, model.features).sum())
    meta = _model_meta(model, path, sha256, shared)
    if meta["fraction_found"] < MIN_SHARED_FRACTION:
        raise ToolError(
            f"annotate_celltypist: the data hold {shared} of the model's {meta['n_model_genes']} "
            f"genes ({meta['fraction_found']:.0%}; at least {MIN_SHARED_FRACTION:.0%} needed): "
            f"model genes look like {', '.join(map(str, model.features[:3]))}, the data's like "
            f"{', '.join(query.var_names[:3])}; is it a model of this species and gene naming?"
        )
    celltypist = import_celltypist()
    doublets = flagged(adata)
    voters = clusters.where(~doublets, FLAGGED)  # flagged doublets vote apart, unheard
    try:
        predictions = celltypist.annotate(query, model=model, majority_voting=False)
        # CellTypist's own vote, over our clusters (its annotate skips voting under 50 cells)
        predictions = celltypist.classifier.Classifier.majority_vote(predictions, voters.to_numpy())
    except ValueError as e:  # its checks of the input (e.g. not log1p of counts per 10,000)
        raise ToolError(f"annotate_celltypist: CellTypist refused the data: {e}") from None
    predicted = predictions.predicted_labels["predicted_labels"].astype(str)
    majority = predictions.predicted_labels["majority_voting"].astype(str)
    confidence = predictions.probability_matrix.max(axis=1)
    votes = pd.crosstab(voters.to_numpy(), predicted.to_numpy())
    votes = votes.drop(index=FLAGGED, errors="ignore")
    mean_confidence = confidence.groupby(voters.to_numpy()).mean()
    markers = adata.uns.get("annotation", {})
    marker_labels = markers.get("cluster_labels", {}) if markers.get("groupby") == groupby else {}
    result: dict[str, dict[str, Any]] = {}
    for cluster in sorted(votes.index, key=_natural):
        label = majority[voters == cluster].iloc[0]
        share = float(votes.loc[cluster, label] / votes.loc[cluster].sum())
        conf = float(mean_confidence[cluster])
        result[cluster] = {
            "label": label if share >= min_vote_share else UNKNOWN,
            "majority": label,
            "vote_share": round(share, 3),
            "mean_confidence": round(conf, 3),
            "weak": share < min_vote_share or conf < min_confidence,
            "n_cells": int(votes.loc[cluster].sum()),
            **({"marker_label": str(marker_labels[cluster])} if cluster in marker_labels else {}),
        }
    for cluster in sorted(set(clusters) - set(result), key=_natural):  # doublets only: no vote
        result[cluster] = {
            "label": UNKNOWN, "vote_share": 0.0, "weak": True,
            "n_cells": int((clusters == cluster).sum()),
            "reason": "every cell is a flagged doublet: no vote",
        }  # fmt: skip
    mapping = {cluster: entry["label"] for cluster, entry in result.items()}
    weak = [cluster for cluster, entry in result.items() if entry["weak"]]
    rule = _rule(min_vote_share, min_confidence)
    adata.obs[key_added] = clusters.map(mapping).astype("category")
    adata.obs[f"{key_added}_ambiguous"] = clusters.isin(weak).to_numpy()
    adata.obs[f"{key_added}_predicted"] = pd.Categorical(predicted.to_numpy())
    adata.obs[f"{key_added}_confidence"] = confidence.to_numpy(dtype=np.float32)
    adata.uns[UNS_KEY] = {
        "model": meta, "groupby": groupby, "key_added": key_added,
        "min_vote_share": min_vote_share, "min_confidence": min_confidence, "rule": rule,
        "clusters": result,
    }  # fmt: skip
    listed = dict(list(result.items())[:limit])
    return {
        "model": meta,
        "groupby": groupby,
        "key_added": key_added,
        "clusters": listed,
        "left_out": left_out(len(result), limit, "clusters"),
        "weak_clusters": weak,
        "rule": rule,
        "mean_confidence": round(float(confidence.mean()), 3),
        "label_sizes": sizes(adata.obs[key_added]),
        "doublets_excluded": int(doublets.sum()),
    }
