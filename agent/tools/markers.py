"""Marker genes per cluster: scanpy's rank_genes_groups, reported compactly."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import anndata as ad
import pandas as pd
import scanpy as sc
from pydantic import Field

from agent.registry import ToolError, tool
from agent.tools.common import Key, Limit, left_out, obs_column, scanpy_params
from agent.tools.doublets import flagged
from agent.tools.session import Session


def rank_singlets(
    adata: Any, groupby: str, key_added: str = "rank_genes_groups", **kwargs: Any
) -> int:
    """scanpy's rank_genes_groups over the cells not flagged as doublets (all cells where none
    is), its result in ``adata.uns[key_added]``; how many cells were left out. Flagged cells
    are ranked apart (a lean copy of the log-normalised values): a doublet cluster's genes must
    not become another cluster's markers."""
    doublets = flagged(adata)
    use_raw = adata.raw is not None
    if not doublets.any():
        sc.tl.rank_genes_groups(adata, groupby, use_raw=use_raw, key_added=key_added, **kwargs)
        return 0
    source = adata.raw if use_raw else adata
    keep = ~doublets
    groups = adata.obs[groupby][keep]
    lean = ad.AnnData(
        source.X[keep], obs=pd.DataFrame({groupby: groups.cat.remove_unused_categories()}),
        var=pd.DataFrame(index=source.var_names), uns={"log1p": adata.uns.get("log1p", {})},
    )  # fmt: skip
    sc.tl.rank_genes_groups(lean, groupby, use_raw=False, key_added=key_added, **kwargs)
    adata.uns[key_added] = lean.uns[key_added]
    adata.uns[key_added]["params"]["use_raw"] = use_raw  # the values ranked, as without doublets
    return int(doublets.sum())


@tool("markers", needs=("normalize",), expensive=True, stage="markers", clustering="groupby")
def rank_genes_groups(
    session: Session,
    groupby: Key = "leiden",
    method: Literal["wilcoxon", "t-test", "t-test_overestim_var", "logreg"] = "wilcoxon",
    n_genes: Annotated[int, Field(ge=1, le=50)] = 5,
    limit: Limit = 40,
) -> dict[str, Any]:
    """Rank marker genes of each group (cluster) against the rest and list the top ones.

    Uses the log-normalised values of all genes: X, or .raw where highly_variable_genes subset X.
    Each marker comes with its log2 fold change and Benjamini-Hochberg adjusted p-value. Cells
    predicted to be doublets and kept (obs['predicted_doublet'], a run that flags them) are left
    out of the ranking.

    Args:
        groupby: Cell annotation (obs column) with the groups, usually the Leiden clusters.
        method: Test used by scanpy's rank_genes_groups.
        n_genes: Top markers listed per group.
        limit: Groups listed at most; the rest are counted in left_out.
    """
    adata = session.adata
    groups = obs_column(
        adata, groupby, "rank_genes_groups", "call leiden first (or give another groupby)"
    )
    doublets = flagged(adata)
    counts = groups[~doublets].astype("category").value_counts()
    if doublets.any():  # a cluster of flagged doublets only has no markers
        counts = counts[counts > 0]
    if len(counts) < 2:
        raise ToolError(
            f"rank_genes_groups: {groupby!r} has {len(counts)} group; it needs at least 2"
        )
    if counts.min() < 2:
        small = [str(g) for g, n in counts.items() if n < 2]
        raise ToolError(f"rank_genes_groups: groups {small} of {groupby!r} have fewer than 2 cells")
    if groups.dtype.name != "category":
        adata.obs[groupby] = groups.astype(str).astype("category")
    use_raw = adata.raw is not None
    kwargs = {"random_state": session.seed} if method == "logreg" else {}
    excluded = rank_singlets(adata, groupby, method=method, **kwargs)
    names = list(adata.uns["rank_genes_groups"]["names"].dtype.names)
    top: dict[str, list[dict[str, Any]]] = {}
    for group in names[:limit]:
        df = sc.get.rank_genes_groups_df(adata, group=group).head(n_genes)
        rows = []
        for _, row in df.iterrows():
            entry = {"gene": row["names"], "score": round(float(row["scores"]), 2)}
            if "logfoldchanges" in df and row["logfoldchanges"] == row["logfoldchanges"]:
                entry["log2fc"] = round(float(row["logfoldchanges"]), 2)
            if "pvals_adj" in df:
                entry["pval_adj"] = float(f"{row['pvals_adj']:.3g}")
            rows.append(entry)
        top[str(group)] = rows
    return {
        "groupby": groupby,
        "method": method,
        "use_raw": use_raw,
        "n_groups": len(names),
        "doublets_excluded": excluded,
        "top_markers": top,
        "left_out": left_out(len(names), limit, "groups"),
        "scanpy_params": scanpy_params(adata, "rank_genes_groups"),
    }
