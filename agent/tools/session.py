"""The state one run's tools share: the AnnData, the sample's output folder, the seed."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from scipy import sparse

from agent.registry import ToolError


def digest_adata(adata: Any) -> str:
    """A content digest of an AnnData: matrix, names, annotations, embeddings, layers."""
    h = hashlib.blake2b(digest_size=16)

    def add_array(a: Any) -> None:
        if sparse.issparse(a):
            a = a.tocsr()
            for part in (a.data, a.indices, a.indptr):
                h.update(np.ascontiguousarray(part).tobytes())
            h.update(str(a.shape).encode())
        else:
            a = np.ascontiguousarray(np.asarray(a))
            h.update(str((a.shape, a.dtype.str)).encode())
            h.update(a.tobytes())

    add_array(adata.X)
    for frame in (adata.obs, adata.var):
        h.update(pd.util.hash_pandas_object(frame.index.to_series(), index=False).to_numpy().tobytes())
        for col in frame.columns:
            h.update(col.encode())
            h.update(pd.util.hash_pandas_object(frame[col].astype(str), index=False).to_numpy().tobytes())
    for store in (adata.obsm, adata.layers):
        for key in sorted(store.keys()):
            h.update(key.encode())
            add_array(store[key])
    return h.hexdigest()


class Session:
    """Holds the AnnData of one sample between tool calls.

    Tools write only inside ``outdir``; ``path_inside`` enforces it for any path a tool is given.
    """

    def __init__(self, outdir: str | Path, seed: int = 0, input_path: str | Path | None = None):
        self.outdir = Path(outdir).resolve()
        self.outdir.mkdir(parents=True, exist_ok=True)
        self.seed = seed
        self.input_path = Path(input_path) if input_path else None
        self._adata: Any = None
        self.done: set[str] = set()  # names of tools that have succeeded, for prerequisites

    @property
    def adata(self) -> Any:
        if self._adata is None:
            raise ToolError("no data loaded yet: call load_data first")
        return self._adata

    @adata.setter
    def adata(self, value: Any) -> None:
        self._adata = value

    @property
    def has_data(self) -> bool:
        return self._adata is not None

    def digest(self) -> str | None:
        return digest_adata(self._adata) if self._adata is not None else None

    def path_inside(self, relative: str | Path) -> Path:
        """Resolve a tool-given path under the output folder, refusing anything outside it."""
        path = (self.outdir / relative).resolve()
        if not path.is_relative_to(self.outdir):
            raise ToolError(f"path {str(relative)!r} leaves the sample's output folder {self.outdir}")
        return path
