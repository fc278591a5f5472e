"""Writing a snapshot of the current AnnData on the model's request (the final object is finish's)."""

from __future__ import annotations

from typing import Any

from agent.record.durable import atomic_write_h5ad
from agent.record.layout import PREVIOUS
from agent.registry import ToolError, tool
from agent.tools.session import Session


@tool("save", mutates=False)
def save(session: Session, path: str = "snapshot.h5ad") -> dict[str, Any]:
    """Write the current AnnData to an .h5ad file inside the sample's output folder (not the
    final object, which only finish writes).

    Args:
        path: File name (or relative path) inside the output folder; must end in .h5ad.
    """
    if not path.endswith(".h5ad"):
        raise ToolError(f"save path {path!r} must end in .h5ad")
    target = session.path_inside(path)
    layout = session.layout
    reserved = (layout.checkpoints, layout.root / PREVIOUS, layout.plots)
    if target == layout.final or any(target.is_relative_to(r) for r in reserved):
        raise ToolError(
            f"save path {path!r} is the run's own: {layout.final.name} is written by finish, and "
            f"{', '.join(r.name + '/' for r in reserved)} hold checkpoints and earlier analyses"
        )
    adata = session.adata
    atomic_write_h5ad(adata, target)
    return {
        "path": str(target.relative_to(session.outdir)),
        "n_cells": adata.n_obs,
        "n_genes": adata.n_vars,
        "bytes": target.stat().st_size,
    }
