"""Reading a sample's counts and writing the analysed AnnData."""

from __future__ import annotations

import gzip
import re
import stat
from pathlib import Path
from typing import Annotated, Any

import anndata as ad
import numpy as np
import scanpy as sc
from pydantic import Field
from scipy import sparse

from agent.durable import atomic_write_h5ad
from agent.provenance import MTX_V2, MTX_V3, input_files
from agent.registry import ToolError, tool
from agent.tools.common import per_row, sizes
from agent.tools.input_size import check_fits
from agent.tools.qc import gene_masks
from agent.tools.session import Session

SYMBOL_COLUMNS = (
    "gene_symbols",
    "gene_symbol",
    "feature_name",
    "gene_name",
    "gene_names",
    "symbol",
)


def _read(path: Path) -> tuple[ad.AnnData, str]:
    for file in [path, *(path / n for n in (*MTX_V2, *MTX_V3))] if path.is_dir() else [path]:
        if kind := _special_kind(file):  # opening a FIFO blocks, a device never ends
            raise ToolError(
                f"could not read {file}: it is {kind}, not a regular file; load_data reads a 10x "
                "mtx folder, a 10x .h5 or an .h5ad file"
            )
    if path.is_dir():
        matrix = next((f for f in input_files(path) if f.name.startswith("matrix.mtx")), None)
        if matrix is None:
            raise ToolError(
                f"{path} is a folder without matrix.mtx(.gz): a 10x mtx folder needs matrix.mtx.gz, "
                "barcodes.tsv.gz and features.tsv.gz"
            )
        _check_features(path)
        check_fits(matrix, "10x_mtx")
        return sc.read_10x_mtx(
            path, var_names="gene_symbols", make_unique=True, cache=False
        ), "10x_mtx"
    if not path.is_file():
        raise ToolError(f"input {path} does not exist")
    if path.stat().st_size == 0:
        raise ToolError(f"could not read {path}: the file is empty (0 bytes)")
    fmt = {".h5": "10x_h5", ".h5ad": "h5ad"}.get(path.suffix)
    if fmt is None:
        raise ToolError(
            f"{path}: unknown input format (expected a 10x mtx folder, a 10x .h5 or an .h5ad file)"
        )
    check_fits(path, fmt)
    return (sc.read_10x_h5(path) if fmt == "10x_h5" else ad.read_h5ad(path)), fmt


def _special_kind(path: Path) -> str | None:
    """What a path is when it exists but is neither a regular file nor a folder."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return None  # missing: said where it is needed
    kinds = {
        stat.S_ISFIFO: "a FIFO (named pipe)",
        stat.S_ISCHR: "a character device",
        stat.S_ISBLK: "a block device",
        stat.S_ISSOCK: "a socket",
    }
    return next((kind for test, kind in kinds.items() if test(mode)), None)


def _check_features(folder: Path) -> None:
    """scanpy fails with a bare KeyError when the 10x features file lacks the symbol column."""
    for name in ("features.tsv.gz", "features.tsv", "genes.tsv"):
        file = folder / name
        if file.is_file():
            with gzip.open(file, "rt") if name.endswith(".gz") else file.open() as f:
                first = f.readline().rstrip("\n").split("\t")
            if len(first) < 2:
                raise ToolError(
                    f"could not read {folder}: {name} has one column ({first[0]!r}), but a 10x "
                    "features file needs the gene ID and the gene symbol on each line, tab-separated"
                )
            return


def _unreadable(path: Path, e: Exception) -> ToolError:
    """The reason a file could not be read, in words: h5py's own messages are cryptic."""
    text = str(e)
    if eof := re.search(r"truncated file: eof = (\d+).*stored_eof = (\d+)", text):
        why = (
            f"the file is truncated ({eof[1]} of {eof[2]} bytes): "
            "was a copy or download interrupted?"
        )
    elif "file signature not found" in text:
        why = "it is not an HDF5 file: corrupt, or another format under an .h5/.h5ad name"
    else:
        why = f"{type(e).__name__}: {text}"
    return ToolError(f"could not read {path}: {why}")


def _integer_layers(adata: ad.AnnData) -> list[str]:
    """Layers (and raw) that hold non-negative integers: where raw counts may hide."""
    found = [k for k, m in adata.layers.items() if _non_count_value(m) is None]
    if adata.raw is not None and _non_count_value(adata.raw.X) is None:
        found.append("raw")
    return found


def _non_count_value(matrix: Any) -> str | None:
    """What rules out raw counts, in words (None if every value is a count)."""
    values = matrix.data if sparse.issparse(matrix) else np.asarray(matrix).ravel()
    if not np.issubdtype(values.dtype, np.number):
        return "values that are not numbers"
    if values.dtype.kind == "f" and not np.isfinite(values).all():  # integers are finite
        if n := int(np.isnan(values).sum()):
            return f"{n:,} NaN (not a number) values, which counts cannot be (missing values?)"
        n = int(np.isinf(values).sum())
        return f"{n:,} infinite values, which counts cannot be (an overflow upstream?)"
    bad = (values < 0) | (values != np.round(values))
    if not bad.any():
        return None
    return f"{values[np.argmax(bad)]:.4g}; it looks normalised or log-transformed"


@tool("io", expensive=True)
def load_data(
    session: Session,
    path: str | None = None,
    layer: str | None = None,
    gene_symbols: str | None = None,
) -> dict[str, Any]:
    """Load a sample's raw counts from a 10x mtx folder, a 10x .h5 file or an .h5ad file.

    Checks that the matrix holds raw integer counts and reports shape, sparsity, where the gene
    symbols come from, and how many mitochondrial, ribosomal and haemoglobin genes there are.
    Loading replaces any data loaded before, and every step starts again.

    Args:
        path: File or 10x folder to read; leave out to read the run's input.
        layer: Read the counts from this layer of an .h5ad instead of X ('raw' for adata.raw).
        gene_symbols: Column of the gene annotations (var) that holds gene symbols, when the
            gene names are IDs such as Ensembl; 'var_names' keeps the IDs knowingly.
    """
    source = session.readable_path(path)
    try:
        adata, fmt = _read(source)
    except ToolError:
        raise
    except Exception as e:  # a corrupt or foreign file: say which and why
        raise _unreadable(source, e) from None
    original_dtype = str(adata.X.dtype) if adata.X is not None else "none"
    if layer == "raw":
        if adata.raw is None:
            raise ToolError(f"{source} has no adata.raw to read counts from")
        adata = adata.raw.to_adata()
    elif layer is not None:
        if layer not in adata.layers:
            raise ToolError(
                f"{source} has no layer {layer!r} (layers: {list(adata.layers) or 'none'})"
            )
        adata.X = adata.layers[layer]
    if adata.n_obs == 0 or adata.n_vars == 0:
        raise ToolError(
            f"{source}: the matrix is empty ({adata.n_obs} cells x {adata.n_vars} genes)"
        )
    duplicated = adata.obs_names[adata.obs_names.duplicated()]
    if len(duplicated):  # every per-cell result would be ambiguous: refuse rather than guess
        raise ToolError(
            f"{source}: {len(duplicated)} duplicate cell barcodes (e.g. {duplicated[0]!r}): each "
            "cell must appear once; was the file concatenated from several samples without "
            "unique barcodes?"
        )
    matrix = adata.X
    if (matrix.nnz if sparse.issparse(matrix) else np.count_nonzero(matrix)) == 0:
        raise ToolError(f"{source}: the matrix holds no counts (every value is zero)")
    bad = _non_count_value(matrix)
    if bad is not None:
        where = f"layer {layer!r}" if layer else "X"
        hint = _integer_layers(adata) if not layer else []
        raise ToolError(
            f"{source}: {where} (dtype {matrix.dtype}) is not raw counts: it holds {bad}; "
            "load_data needs raw integer UMI counts"
            + (
                f"; these hold integer counts: {hint} (call load_data with layer=...)"
                if hint
                else ""
            )
        )

    warnings = []
    symbols_from = "var_names"
    ids = np.mean([bool(re.match(r"ENS[A-Z]*G\d", g)) for g in adata.var_names[:1000]]) > 0.5
    if gene_symbols == "var_names":  # the IDs kept on purpose
        if ids:
            warnings.append(
                "gene names kept as Ensembl IDs (gene_symbols='var_names'): "
                "mitochondrial genes and marker sets will not match"
            )
    elif gene_symbols is not None:
        if gene_symbols not in adata.var.columns:
            raise ToolError(
                f"{source}: no gene annotation column {gene_symbols!r} (var columns: {list(adata.var.columns)})"
            )
        adata.var_names = adata.var[gene_symbols].astype(str).to_numpy()
        symbols_from = gene_symbols
    elif ids:
        column = next((c for c in SYMBOL_COLUMNS if c in adata.var.columns), None)
        if column is None:  # QC and annotation need symbols: make the choice explicit
            raise ToolError(
                f"{source}: the gene names are Ensembl IDs (e.g. {adata.var_names[0]!r}) and no "
                f"gene symbol column was found (var columns: {list(adata.var.columns) or 'none'}); "
                "call load_data with gene_symbols=COLUMN naming the column of symbols, or "
                "gene_symbols='var_names' to keep the IDs (mitochondrial genes and marker sets "
                "will then not match)"
            )
        adata.var_names = adata.var[column].astype(str).to_numpy()
        symbols_from = column
    n_duplicated = int(adata.var_names.duplicated().sum())
    if n_duplicated:
        adata.var_names_make_unique()
    adata.X = sparse.csr_matrix(adata.X, dtype=np.float32)
    session.replace_data(adata)

    masks = gene_masks(adata.var_names)
    counts = per_row(adata.X, "sum")
    genes = per_row(adata.X, "nnz")
    if not masks["mt"].any():
        warnings.append("no mitochondrial genes with prefix 'MT-' (mouse data use 'mt-')")
    return {
        "path": _shown(session, source),
        "format": fmt,
        "n_cells": adata.n_obs,
        "n_genes": adata.n_vars,
        "dtype_in_file": original_dtype,
        "layer": layer,
        "sparsity": round(1 - adata.X.nnz / (adata.n_obs * adata.n_vars), 4),
        "total_counts": int(counts.sum()),
        "median_counts_per_cell": float(np.median(counts)),
        "median_genes_per_cell": float(np.median(genes)),
        "gene_symbols_from": symbols_from,
        "duplicate_gene_names_made_unique": n_duplicated,
        "n_mt_genes": int(masks["mt"].sum()),
        "n_ribo_genes": int(masks["ribo"].sum()),
        "n_hb_genes": int(masks["hb"].sum()),
        "warnings": warnings,
    }


def _shown(session: Session, source: Path) -> str:
    """The input as the record names it: the input's name, or its path in the output folder, so
    that the same bytes in a moved folder give the same record."""
    if session.input_path is not None and source.is_relative_to(session.input_path):
        return str(source.relative_to(session.input_path.parent))
    return str(source.relative_to(session.outdir))


@tool("io", mutates=False)
def save(session: Session, path: str = "adata.h5ad") -> dict[str, Any]:
    """Write the current AnnData to an .h5ad file inside the sample's output folder.

    Args:
        path: File name (or relative path) inside the output folder; must end in .h5ad.
    """
    if not path.endswith(".h5ad"):
        raise ToolError(f"save path {path!r} must end in .h5ad")
    target = session.path_inside(path)
    adata = session.adata
    atomic_write_h5ad(adata, target)
    return {
        "path": str(target.relative_to(session.outdir)),
        "n_cells": adata.n_obs,
        "n_genes": adata.n_vars,
        "bytes": target.stat().st_size,
    }


@tool("finish", mutates=False)
def finish(
    session: Session,
    conclusion: Annotated[str, Field(max_length=4000)] = "",
) -> dict[str, Any]:
    """Finish the analysis: write the final adata.h5ad and return a short summary.

    Call this last; the run ends when it succeeds.

    Args:
        conclusion: A few sentences on what the analysis found, for the record.
    """
    adata = session.adata
    target = session.layout.final
    atomic_write_h5ad(adata, target)
    summary: dict[str, Any] = {
        "path": str(target.relative_to(session.outdir)),
        "n_cells": adata.n_obs,
        "n_genes": adata.n_vars,
        "steps_done": sorted(session.done),
        "conclusion": conclusion,
    }
    for key in ("leiden", "cell_type"):
        if key in adata.obs.columns:
            summary[f"{key}_sizes"] = sizes(adata.obs[key])
    summary["n_clusters"] = len(summary["leiden_sizes"]) if "leiden_sizes" in summary else 0
    return summary
