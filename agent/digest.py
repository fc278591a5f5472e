"""The content digest of an AnnData's data, which records keep before and after each step.

A module of its own, light (numpy, pandas, scipy): readers of records (the integrity check of
cohort steps, replay) digest final objects without importing the tools (scanpy, umap, numba).
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import pandas as pd
from scipy import sparse

# What digest_adata hashes, and how. Bump it when that changes: records carry the version, so a
# replay can tell a changed digest from changed data.
DIGEST_VERSION = 1


def digest_adata(adata: Any) -> str:
    """A content digest of an AnnData's data: matrix, names, annotations, embeddings, graphs, raw.

    ``uns`` is left out: it holds parameters and summaries (reported in tool results anyway) whose
    Python types change on an .h5ad round trip, and a checkpoint must restore the same digest.
    """
    h = hashlib.blake2b(digest_size=16)

    def add_array(a: Any) -> None:
        if sparse.issparse(a):
            a = a.tocsr()
            for part in (a.data, a.indices, a.indptr):
                h.update(np.ascontiguousarray(part).tobytes())
            h.update(str(a.shape).encode())
            return
        a = np.asarray(a)
        h.update(str((a.shape, a.dtype.str)).encode())
        if a.dtype.hasobject:  # object or record arrays of strings: bytes of pointers mean nothing
            h.update(repr(a.tolist()).encode())
        else:
            h.update(np.ascontiguousarray(a).tobytes())

    def add_frame(frame: pd.DataFrame) -> None:
        h.update(
            pd.util.hash_pandas_object(frame.index.to_series(), index=False).to_numpy().tobytes()
        )
        for col in frame.columns:
            h.update(str(col).encode())
            values = frame[col]
            if values.dtype == object:  # mixed Python objects: their text is what is stable
                values = values.astype(str)
            h.update(pd.util.hash_pandas_object(values, index=False).to_numpy().tobytes())

    add_array(adata.X)
    add_frame(adata.obs)
    add_frame(adata.var)
    for store in (adata.obsm, adata.varm, adata.obsp, adata.layers):
        for key in sorted(store.keys()):
            h.update(key.encode())
            add_array(store[key])
    if adata.raw is not None:
        h.update(b"raw")
        add_array(adata.raw.X)
        add_frame(adata.raw.var)
    return h.hexdigest()
