"""Small helpers the tool modules share: parameter types, the counts matrix, compact numbers."""

from __future__ import annotations

from typing import Annotated, Any

import numpy as np
from pydantic import Field
from scipy import sparse

from agent.registry import ToolError

QUANTILES = (1, 5, 25, 50, 75, 95, 99)

# An AnnData column or key name a tool creates: plain identifiers only.
Key = Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")]
Count = Annotated[int, Field(ge=0)]
Limit = Annotated[int, Field(ge=1, le=200)]


def counts_matrix(adata: Any) -> Any:
    """The raw counts: X before normalisation, the 'counts' layer after it."""
    if "counts" in adata.layers:
        return adata.layers["counts"]
    if adata.uns.get("log1p") is not None:
        raise ToolError("the data are normalised and no 'counts' layer holds the raw counts")
    return adata.X


def all_genes(adata: Any) -> Any:
    """Log-normalised values of all genes (``.X`` and ``.var_names``): ``adata.raw`` where
    highly_variable_genes subset X, else the AnnData itself."""
    return adata.raw if adata.raw is not None else adata


def quantiles(values: Any, digits: int = 2) -> dict[str, float]:
    """Percentiles 1, 5, 25, 50, 75, 95 and 99 of a vector, keyed 'p1' ... 'p99'."""
    values = np.asarray(values, dtype=float)
    return {
        f"p{q}": round(float(v), digits)
        for q, v in zip(QUANTILES, np.percentile(values, QUANTILES), strict=True)
    }


def per_row(matrix: Any, fn: str) -> np.ndarray:
    """Row sums or non-zero counts of a dense or sparse matrix as a flat array."""
    if fn == "nnz":
        out = matrix.getnnz(axis=1) if sparse.issparse(matrix) else np.count_nonzero(matrix, axis=1)
    else:
        out = matrix.sum(axis=1)
    return np.asarray(out).ravel()


def obs_column(adata: Any, key: str, tool: str, hint: str) -> Any:
    """An obs column a tool needs, or an error that says which step makes it."""
    if key not in adata.obs.columns:
        raise ToolError(f"{tool}: no column {key!r} in the cell annotations (obs): {hint}")
    return adata.obs[key]


def left_out(n: int, limit: int, what: str) -> str | None:
    """What a result's list leaves out past its limit, in words (None: nothing)."""
    return f"{n - limit} {what} not listed" if n > limit else None


def sizes(labels: Any) -> dict[str, int]:
    """Cells per label, labels in their natural (categorical) order."""
    counts = labels.value_counts(sort=False)
    return {str(k): int(v) for k, v in counts.items()}


def scanpy_params(adata: Any, key: str) -> dict[str, Any]:
    """The parameters scanpy itself recorded under ``adata.uns[key]['params']``."""
    entry = adata.uns.get(key)
    if isinstance(entry, dict) and isinstance(entry.get("params"), dict):
        return dict(entry["params"])
    return {}
