"""Reading a sample's counts."""

from __future__ import annotations

import re
import stat
from pathlib import Path
from typing import Any

import anndata as ad
import numpy as np
import pandas as pd
import scanpy as sc
from scipy import io as spio
from scipy import sparse

from agent.record.provenance import MTX_FILES, mtx_files
from agent.registry import ToolError, tool
from agent.tools.common import per_row
from agent.tools.input_size import check_fits
from agent.tools.qc import gene_masks
from agent.tools.session import Session
from agent.tools.species import detect_species, symbol_rules
from agent.tools.spots import MODALITY, spot_evidence

# Usual names of a column of gene symbols, matched in any case (AnnData from Seurat, Bioconductor,
# CELLxGENE, Cell Ranger).
SYMBOL_COLUMNS = (
    "gene_symbols",
    "gene_symbol",
    "symbol",
    "symbols",
    "feature_name",
    "gene_name",
    "gene_names",
    "gene_short_name",
)
ENSEMBL = re.compile(r"ENS[A-Z]*G\d")
ID_COLUMN = re.compile(r"(^|[_. ])ids?$|ensembl|entrez|accession", re.IGNORECASE)
# Counts stored as floats may sit a rounding error off their integers (a sum or a conversion on
# the way): within this relative tolerance they are counts, rounded.
COUNT_TOLERANCE = 1e-6
# Fewer cells than this cannot be analysed: QC's MAD thresholds, PCA and clusters mean little, and
# the neighbour graph (15 neighbours) needs 16 cells after QC, which removes 10-25%: a 20-cell
# sample kept 15 and "finished" with no clusters.
MIN_CELLS = 30


def read_matrix(path: Path) -> tuple[ad.AnnData, str]:
    """A 10x mtx folder, 10x .h5 or .h5ad as it is stored, and its format (remove_ambient reads
    an unfiltered matrix so too)."""
    names = [n for options in MTX_FILES.values() for n in options]
    for file in [path, *(path / n for n in names)] if path.is_dir() else [path]:
        if kind := _special_kind(file):  # opening a FIFO blocks, a device never ends
            raise ToolError(
                f"could not read {file}: it is {kind}, not a regular file; load_data reads a 10x "
                "mtx folder, a 10x .h5 or an .h5ad file"
            )
    if path.is_dir():
        return _read_mtx_folder(path), "10x_mtx"
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


def _read_mtx_folder(folder: Path) -> ad.AnnData:
    """A 10x mtx folder of Cell Ranger v2 (genes.tsv) or v3+ (features.tsv), gzipped or not, as
    scanpy's read_10x_mtx reads it (symbols as names, gene_ids and feature_types columns, only
    'Gene Expression' features), but with duplicate symbols left for load_data to count."""
    files = mtx_files(folder)
    missing = [MTX_FILES[role][0] for role in MTX_FILES if role not in files]
    if missing:
        raise ToolError(
            f"{folder} is a folder without {' or '.join(missing)}: a 10x mtx folder needs "
            "matrix.mtx, barcodes.tsv and features.tsv (Cell Ranger v2: genes.tsv), each "
            "gzipped or not"
        )
    features = pd.read_csv(files["features"], sep="\t", header=None, dtype=str)
    if features.shape[1] < 2:
        raise ToolError(
            f"could not read {folder}: {files['features'].name} has one column "
            f"({features.iloc[0, 0]!r}), but a 10x features file needs the gene ID and the gene "
            "symbol on each line, tab-separated"
        )
    check_fits(files["matrix"], "10x_mtx")
    barcodes = pd.read_csv(files["barcodes"], sep="\t", header=None, dtype=str)[0]
    matrix = spio.mmread(files["matrix"])  # genes x cells
    if matrix.shape != (len(features), len(barcodes)):
        raise ToolError(
            f"could not read {folder}: {files['matrix'].name} is {matrix.shape[0]:,} genes x "
            f"{matrix.shape[1]:,} cells, but {files['features'].name} lists {len(features):,} "
            f"genes and {files['barcodes'].name} {len(barcodes):,} cells"
        )
    var = pd.DataFrame({"gene_ids": features[0].to_numpy()}, index=features[1].to_numpy())
    if features.shape[1] > 2:
        var["feature_types"] = features[2].to_numpy()
    adata = ad.AnnData(
        sparse.csr_matrix(matrix.T), obs=pd.DataFrame(index=barcodes.to_numpy()), var=var
    )
    genes = var.get("feature_types", pd.Series(dtype=str)).to_numpy() == "Gene Expression"
    if genes.any() and not genes.all():  # antibody and CRISPR captures are not genes
        adata = adata[:, genes].copy()
    return adata


def _merge_duplicate_genes(adata: ad.AnnData) -> ad.AnnData:
    """One gene per name, its counts the sum of the genes sharing it (several IDs of one symbol):
    made unique (A, A-1), both halves of one gene showed up as markers. Annotations: the first's."""
    codes, names = pd.factorize(adata.var_names)
    merge = sparse.csr_matrix(
        (np.ones(len(codes), np.float32), (np.arange(len(codes)), codes)),
        shape=(len(codes), len(names)),
    )
    first = np.unique(codes, return_index=True)[1]
    return ad.AnnData(
        sparse.csr_matrix(adata.X) @ merge,
        obs=adata.obs,
        var=adata.var.iloc[first].set_axis(names.astype(str)),
        obsm=dict(adata.obsm),
        uns=dict(adata.uns),
    )


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


def _retry_with(option: str, value: str) -> str:
    """The one change that fixes a refusal, written as the reference policy reads it
    (agent/policies/reference.py), with the run option and sample-sheet column that set it."""
    return (
        f"call load_data({option}={value!r}) (run option --{option.replace('_', '-')} {value}, "
        f"sample-sheet column {option})"
    )


def _select_counts(adata: ad.AnnData, source: Path, layer: str | None) -> ad.AnnData:
    """The AnnData whose X is the matrix asked for: X, a layer, or adata.raw."""
    if layer == "raw":
        if adata.raw is None:
            raise ToolError(f"{source} has no adata.raw to read counts from")
        return adata.raw.to_adata()
    if layer is not None:
        if layer not in adata.layers:
            raise ToolError(
                f"{source} has no layer {layer!r} (layers: {list(adata.layers) or 'none'})"
            )
        adata.X = adata.layers[layer]
    return adata


def _check_cells(adata: ad.AnnData, source: Path) -> None:
    """Refuse a matrix whose cells cannot be analysed: too few, repeated, or without counts."""
    if adata.n_obs == 0 or adata.n_vars == 0:
        raise ToolError(
            f"{source}: the matrix is empty ({adata.n_obs} cells x {adata.n_vars} genes)"
        )
    if adata.n_obs < MIN_CELLS:
        raise ToolError(
            f"{source} holds {adata.n_obs} cells; an analysis needs at least {MIN_CELLS}: QC "
            "thresholds, PCA and clusters mean nothing on fewer"
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


def _check_counts(adata: ad.AnnData, source: Path, layer: str | None) -> None:
    """Refuse a matrix that is not raw counts, naming the layer that holds them, if one does."""
    bad = _non_count_value(adata.X)
    if bad is None:
        return
    where = f"layer {layer!r}" if layer else "X"
    hint = sorted(_integer_layers(adata), key=lambda k: k != "counts") if not layer else []
    raise ToolError(
        f"{source}: {where} (dtype {adata.X.dtype}) is not raw counts: it holds {bad}; "
        "load_data needs raw integer UMI counts"
        + (f"; these hold integer counts: {hint}: {_retry_with('layer', hint[0])}" if hint else "")
    )


def _integer_layers(adata: ad.AnnData) -> list[str]:
    """Layers (and raw) that hold non-negative integers: where raw counts may hide."""
    found = [k for k, m in adata.layers.items() if _non_count_value(m) is None]
    if adata.raw is not None and _non_count_value(adata.raw.X) is None:
        found.append("raw")
    return found


def _values(matrix: Any) -> np.ndarray:
    return matrix.data if sparse.issparse(matrix) else np.asarray(matrix).ravel()


def _off_integers(values: np.ndarray) -> np.ndarray:
    """Which values are farther from an integer than a rounding error."""
    distance = np.abs(values - np.round(values))
    return distance > COUNT_TOLERANCE * np.maximum(1.0, np.abs(values))


def _non_count_value(matrix: Any) -> str | None:
    """What rules out raw counts, in words (None if every value is a count)."""
    values = _values(matrix)
    if not np.issubdtype(values.dtype, np.number):
        return "values that are not numbers"
    if values.dtype.kind == "f" and not np.isfinite(values).all():  # integers are finite
        if n := int(np.isnan(values).sum()):
            return f"{n:,} NaN (not a number) values, which counts cannot be (missing values?)"
        n = int(np.isinf(values).sum())
        return f"{n:,} infinite values, which counts cannot be (an overflow upstream?)"
    bad = values < 0
    if values.dtype.kind == "f":
        bad |= _off_integers(values)
    if not bad.any():
        return None
    return f"{values[np.argmax(bad)]:.4g}; it looks normalised or log-transformed"


def _round_counts(adata: ad.AnnData) -> int:
    """Round counts stored a rounding error off their integers; how many values were."""
    values = _values(adata.X)
    if values.dtype.kind != "f":
        return 0
    rounded = np.round(values)
    n = int(np.count_nonzero(values != rounded))
    if n and sparse.issparse(adata.X):
        adata.X = adata.X.copy()
        adata.X.data = rounded
        adata.X.eliminate_zeros()  # a value just above 0 was no count
    elif n:
        adata.X = rounded.reshape(adata.shape)
    return n


def _symbol_column(var: pd.DataFrame) -> str | None:
    """The column of gene symbols under a usual name, in any case ('Symbol', 'gene_short_name')."""
    lower = {str(c).lower(): c for c in var.columns}
    return next((lower[n] for n in SYMBOL_COLUMNS if n in lower), None)


def _ensembl_share(names: Any) -> float:
    return float(np.mean([bool(ENSEMBL.match(str(g))) for g in list(names[:1000])] or [0.0]))


def _symbol_like_columns(var: pd.DataFrame) -> list[str]:
    """Columns under other names that look like symbols: words, mostly distinct, not IDs."""
    found = []
    for column in var.columns:
        if ID_COLUMN.search(str(column)):
            continue  # IDs of another scheme (Entrez, a lab's own) look like words too
        values = var[column].dropna().astype(str)
        if len(values) < len(var) / 2 or values.nunique() < len(values) / 2:
            continue  # mostly missing, or a category (biotype, chromosome)
        words = values[:1000].str.fullmatch(r"[A-Za-z][A-Za-z0-9._-]*").mean()
        if words > 0.9 and _ensembl_share(values) < 0.1:
            found.append(str(column))
    return found


def _use_symbols(adata: ad.AnnData, column: str) -> int:
    """Name the genes by ``column``, keeping the ID of a gene without a symbol; how many kept."""
    if "gene_ids" not in adata.var.columns:  # the IDs stay with the genes
        adata.var["gene_ids"] = adata.var_names.to_numpy()
    values = adata.var[column].astype(object)
    missing = (values.isna() | (values.astype(str).str.strip() == "")).to_numpy()
    adata.var_names = np.where(missing, adata.var_names, values.astype(str)).astype(str)
    return int(missing.sum())


def _gene_names(
    adata: ad.AnnData, source: Path, gene_symbols: str | None, warnings: list[str]
) -> str:
    """Make the gene names symbols (QC and markers need them); where they come from."""
    ids = _ensembl_share(adata.var_names) > 0.5
    if gene_symbols == "var_names":  # the IDs kept on purpose
        if ids:
            warnings.append(
                "gene names kept as Ensembl IDs (gene_symbols='var_names'): "
                "mitochondrial genes and marker sets will not match"
            )
        return "var_names"
    if gene_symbols is not None and gene_symbols not in adata.var.columns:
        raise ToolError(
            f"{source}: no gene annotation column {gene_symbols!r} "
            f"(var columns: {list(adata.var.columns)})"
        )
    column = gene_symbols or (_symbol_column(adata.var) if ids else None)
    if column is None and ids:  # QC and annotation need symbols: make the choice explicit
        likely = _symbol_like_columns(adata.var)
        fix = (
            f"{_retry_with('gene_symbols', likely[0])}, naming the column of symbols"
            if likely
            else "call load_data with gene_symbols=COLUMN naming the column of symbols"
        )
        raise ToolError(
            f"{source}: the gene names are Ensembl IDs (e.g. {adata.var_names[0]!r}) and no "
            f"gene symbol column was found by name (var columns: "
            f"{list(adata.var.columns) or 'none'}); {fix}, or gene_symbols='var_names' to keep "
            "the IDs (mitochondrial genes and marker sets will then not match)"
        )
    if column is None:
        return "var_names"
    if n := _use_symbols(adata, column):
        warnings.append(f"{n} genes without a symbol in {column!r} keep their ID")
    return column


@tool("load", expensive=True)
def load_data(
    session: Session,
    path: str | None = None,
    layer: str | None = None,
    gene_symbols: str | None = None,
) -> dict[str, Any]:
    """Load a sample's raw counts from a 10x mtx folder, a 10x .h5 file or an .h5ad file.

    Checks that the matrix holds raw integer counts (floats within 1e-6 of integers are rounded)
    of at least 30 cells, and reports shape, sparsity, where the gene symbols come from, and
    how many mitochondrial, ribosomal and haemoglobin genes there are. Genes that share a name
    are merged into one (counts summed). Spatial spots are named as such, with the evidence
    (coordinates, Space Ranger's .h5 or spot list beside the matrix) in uns['modality'].
    Loading replaces any data loaded before, and every step starts again.
    An error that a parameter can fix says so as load_data(NAME=VALUE).

    Args:
        path: File or 10x folder to read; leave out to read the run's input.
        layer: Read the counts from this layer of an .h5ad instead of X ('raw' for adata.raw).
        gene_symbols: Column of the gene annotations (var) that holds gene symbols, when the
            gene names are IDs such as Ensembl; 'var_names' keeps the IDs knowingly.
    """
    source = session.readable_path(path)
    try:
        adata, fmt = read_matrix(source)
    except ToolError:
        raise
    except Exception as e:  # a corrupt or foreign file: say which and why
        raise _unreadable(source, e) from None
    original_dtype = str(adata.X.dtype) if adata.X is not None else "none"
    spots = spot_evidence(adata, source)  # by content and layout (agent/tools/spots.py)
    adata = _select_counts(adata, source, layer)
    _check_cells(adata, source)
    _check_counts(adata, source, layer)
    # X now holds checked counts: a log1p mark or a .raw from the file describe other values (with
    # counts read from .raw the mark stayed, and filter_cells took X for normalised data)
    adata.uns.pop("log1p", None)
    adata.raw = None
    warnings: list[str] = []
    if n_rounded := _round_counts(adata):
        warnings.append(
            f"{n_rounded:,} counts stored as floats a rounding error off integers were rounded"
        )
    symbols_from = _gene_names(adata, source, gene_symbols, warnings)
    n_duplicated = int(adata.var_names.duplicated().sum())
    if n_duplicated:
        adata = _merge_duplicate_genes(adata)
    adata.X = sparse.csr_matrix(adata.X, dtype=np.float32)
    if spots:  # kept with the data, for the steps that must not treat spots as cells
        adata.uns["modality"] = {"modality": MODALITY, "evidence": spots}
    session.replace_data(adata)

    rules = symbol_rules(detect_species(adata.var_names)["species"])  # mouse globins: Hba-a1
    masks = gene_masks(adata.var_names, rules.mt_prefix, rules.ribo_pattern, rules.hb_pattern)
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
        "counts_rounded": n_rounded,
        "sparsity": round(1 - adata.X.nnz / (adata.n_obs * adata.n_vars), 4),
        "total_counts": int(counts.sum()),
        "median_counts_per_cell": float(np.median(counts)),
        "median_genes_per_cell": float(np.median(genes)),
        "gene_symbols_from": symbols_from,
        "duplicate_genes_merged": n_duplicated,
        "modality": MODALITY if spots else "single cells or nuclei",
        **({"modality_evidence": spots} if spots else {}),
        "n_mt_genes": int(masks["mt"].sum()),
        "n_ribo_genes": int(masks["ribo"].sum()),
        "n_hb_genes": int(masks["hb"].sum()),
        "warnings": warnings,
    }


# How a result names the run's input: by role, never by its file or folder name, so the same bytes
# renamed give the same record; meta.input_sha256 and meta.input_files identify it by content.
INPUT = "<input>"


def _shown(session: Session, source: Path) -> str:
    """The file read as the record names it: the run's input (or a file in its 10x folder) as
    ``<input>``, another file by its path in the output folder."""
    if session.input_path is not None and source.is_relative_to(session.input_path):
        return str(INPUT / source.relative_to(session.input_path))
    return str(source.relative_to(session.outdir))
