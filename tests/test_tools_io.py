"""load_data, save, finish: formats, the raw-counts check, bad input, paths kept inside."""

from __future__ import annotations

import gzip
import io
import os
import re
import resource
import shutil
import threading
import time
from pathlib import Path

import anndata as ad
import h5py
import numpy as np
import pandas as pd
import pytest
import scanpy as sc
import scipy.io as spio
from scipy import sparse

from agent.record.provenance import checksum, input_files
from agent.registry import InfrastructureError
from agent.testing.reference_run import call_tool as call
from agent.tools.input_size import available_memory
from agent.tools.session import Session


@pytest.mark.parametrize("name", ["pbmc1", "pbmc2", "pbmc3"])
def test_load_each_demo_format_from_the_run_input(name, demo_inputs, tmp_path):
    session = Session(tmp_path, input_path=demo_inputs[name])
    out = call(session, "load_data")
    assert out.ok, out.error
    r = out.result
    assert r["format"] == {"pbmc1": "10x_mtx", "pbmc2": "h5ad", "pbmc3": "10x_h5"}[name]
    assert r["path"] == "<input>"  # not its name or place: renamed or moved, the same record
    assert (r["n_cells"], r["n_genes"]) == session.adata.shape
    assert (r["n_mt_genes"], r["n_hb_genes"]) == (13, 10) and r["n_ribo_genes"] > 70
    assert 0.6 < r["sparsity"] < 0.95
    assert r["gene_symbols_from"] == "var_names" and r["warnings"] == []
    assert sparse.isspmatrix_csr(session.adata.X) and session.adata.X.dtype == np.float32


def test_loading_again_starts_over(fresh_session):
    assert call(fresh_session, "load_data").ok
    fresh_session.done |= {"load_data", "normalize"}
    assert call(fresh_session, "load_data").ok
    assert fresh_session.done == {"load_data"}  # what was done before applied to other data


def _write(tmp_path, adata, name="in.h5ad"):
    path = tmp_path / name
    adata.write_h5ad(path)
    return path


def test_normalised_data_are_refused_with_the_reason(tmp_path):
    # scanpy's bundled PBMC set: scaled values in X, log-normalised values in .raw
    path = _write(tmp_path, sc.datasets.pbmc68k_reduced())
    out = call(Session(tmp_path / "o", input_path=path), "load_data")
    assert not out.ok
    assert "not raw counts" in out.error and str(path) in out.error and "normalised" in out.error


def test_float_counts_pass_and_a_counts_layer_is_pointed_to(tmp_path):
    counts = sparse.random(300, 100, density=0.2, format="csr", random_state=1) * 20
    counts.data = np.ceil(counts.data)
    adata = ad.AnnData(counts.copy(), var=pd.DataFrame(index=[f"G{i}" for i in range(100)]))
    path = _write(tmp_path, adata, "ints.h5ad")
    assert call(
        Session(tmp_path / "a", input_path=path), "load_data"
    ).ok  # float dtype, integer values
    normed = adata.copy()
    normed.layers["counts"] = normed.X.copy()
    sc.pp.normalize_total(normed)
    sc.pp.log1p(normed)
    path = _write(tmp_path, normed, "normed.h5ad")
    out = call(Session(tmp_path / "b", input_path=path), "load_data")
    assert not out.ok and "['counts']: call load_data(layer='counts')" in out.error
    assert "run option --layer counts" in out.error
    session = Session(tmp_path / "c", input_path=path)
    out = call(session, "load_data", layer="counts")
    assert out.ok and session.adata.X.sum() == counts.sum()


@pytest.mark.parametrize(
    ("matrix", "message"),
    [
        (np.zeros((0, 5), np.float32), "empty (0 cells x 5 genes)"),
        (np.ones((29, 5), np.float32), "holds 29 cells; an analysis needs at least 30"),
        (np.zeros((30, 5), np.float32), "no counts"),
        (-np.ones((30, 5), np.float32), "not raw counts"),
        (np.full((30, 5), 1.5, np.float32), "not raw counts: it holds 1.5"),
        (np.full((30, 5), 1 + 1e-5, np.float32), "not raw counts: it holds 1"),  # past tolerance
        (np.where(np.eye(30, 5), np.nan, 1).astype(np.float32), "holds 5 NaN (not a number)"),
        (np.where(np.eye(30, 5), np.inf, 1).astype(np.float32), "holds 5 infinite values"),
    ],
)
def test_bad_matrices_get_a_clear_error(tmp_path, matrix, message):
    adata = ad.AnnData(matrix, var=pd.DataFrame(index=[f"G{i}" for i in range(5)]))
    out = call(Session(tmp_path / "o", input_path=_write(tmp_path, adata)), "load_data")
    assert not out.ok and message in out.error, out.error


@pytest.mark.parametrize("kind", ["dense", "sparse"])
def test_counts_a_rounding_error_off_integers_are_rounded_and_said(tmp_path, kind):
    counts = np.random.default_rng(0).poisson(2, (30, 6)).astype(np.float64)
    counts[0, 0] = 0
    noisy = counts + np.where(counts > 0, 1e-12, 0) - np.where(counts > 2, 3e-7 * counts, 0)
    noisy[0, 0] = 4e-7  # a zero a rounding error off: no count
    x = sparse.csr_matrix(noisy) if kind == "sparse" else noisy
    session = Session(tmp_path / "o", input_path=_write(tmp_path, ad.AnnData(x)))
    out = call(session, "load_data")
    assert out.ok, out.error
    changed = int(np.count_nonzero(noisy != counts))
    assert out.result["counts_rounded"] == changed > 0
    assert any(f"{changed:,} counts stored as floats" in w for w in out.result["warnings"])
    assert np.array_equal(session.adata.X.toarray(), counts)


def test_ensembl_ids_switch_to_the_symbol_column(tmp_path):
    rng = np.random.default_rng(0)
    names = ["MT-CO1", "CD3D", "LYZ", "RPL3"]
    adata = ad.AnnData(
        rng.poisson(3, (50, 4)).astype(np.float32),
        var=pd.DataFrame({"gene_symbols": names}, index=[f"ENSG0000000000{i}" for i in range(4)]),
    )
    session = Session(tmp_path / "o", input_path=_write(tmp_path, adata))
    out = call(session, "load_data")
    assert out.ok and out.result["gene_symbols_from"] == "gene_symbols"
    assert list(session.adata.var_names) == names and out.result["n_mt_genes"] == 1
    out = call(session, "load_data", gene_symbols="no_such_column")
    assert not out.ok and "no_such_column" in out.error


@pytest.mark.parametrize("column", ["Symbol", "gene_short_name", "feature_name"])
def test_a_symbol_column_under_a_usual_name_in_any_case_is_used(tmp_path, column):
    ids = [f"ENSG0000000000{i}" for i in range(4)]
    symbols = ["MT-CO1", "CD3D", None, "RPL3"]  # a gene without a symbol keeps its ID
    path = _write(tmp_path, _counts(genes=ids, **{column: symbols}))
    session = Session(tmp_path / "o", input_path=path)
    out = call(session, "load_data")
    assert out.ok and out.result["gene_symbols_from"] == column, out.error
    assert list(session.adata.var_names) == ["MT-CO1", "CD3D", ids[2], "RPL3"]
    assert list(session.adata.var["gene_ids"]) == ids and out.result["n_mt_genes"] == 1
    assert "1 genes without a symbol in" in out.result["warnings"][0]


def test_a_symbol_column_under_another_name_is_named_as_the_fix(tmp_path):
    ids = [f"ENSG0000000000{i}" for i in range(4)]
    var = {"biotype": ["protein_coding"] * 4, "hgnc": ["MT-CO1", "CD3D", "LYZ", "RPL3"]}
    path = _write(tmp_path, _counts(genes=ids, **var))
    out = call(Session(tmp_path / "o", input_path=path), "load_data")
    assert not out.ok and "call load_data(gene_symbols='hgnc')" in out.error
    assert "run option --gene-symbols hgnc, sample-sheet column gene_symbols" in out.error
    session = Session(tmp_path / "p", input_path=path)
    out = call(session, "load_data", gene_symbols="hgnc")
    assert out.ok and session.adata.var_names[0] == "MT-CO1"


def _counts(n_cells=50, genes=("MT-CO1", "CD3D", "LYZ", "RPL3"), **var_columns):
    rng = np.random.default_rng(0)
    return ad.AnnData(
        rng.poisson(3, (n_cells, len(genes))).astype(np.float32),
        var=pd.DataFrame(var_columns, index=list(genes)),
    )


@pytest.mark.parametrize(
    ("name", "fault", "reason"),
    [
        ("cut.h5ad", "truncated", "the file is truncated ("),
        ("noise.h5ad", "random", "not an HDF5 file"),
        ("noise.h5", "random", "not an HDF5 file"),
        ("empty.h5ad", "empty", "the file is empty (0 bytes)"),
    ],
)
def test_unreadable_files_name_the_path_and_the_reason(tmp_path, name, fault, reason):
    path = tmp_path / name
    if fault == "truncated":
        whole = _write(tmp_path, _counts(2000), "whole.h5ad").read_bytes()
        path.write_bytes(whole[: len(whole) // 2])
    else:
        path.write_bytes(np.random.default_rng(0).bytes(4096) if fault == "random" else b"")
    out = call(Session(tmp_path / "o", input_path=path), "load_data")
    assert not out.ok and f"could not read {path}: " in out.error and reason in out.error, out.error


def test_duplicate_cell_barcodes_are_refused(tmp_path):
    adata = _counts()
    adata.obs_names = [f"C{i % 40}-1" for i in range(50)]  # two samples pasted together
    path = _write(tmp_path, adata)
    out = call(Session(tmp_path / "o", input_path=path), "load_data")
    assert not out.ok and f"{path}: 10 duplicate cell barcodes (e.g. 'C0-1')" in out.error


def test_genes_sharing_a_name_are_merged_and_counted(tmp_path):
    adata = _counts(genes=("A", "B", "A"))
    session = Session(tmp_path / "o", input_path=_write(tmp_path, adata.copy()))
    out = call(session, "load_data")
    assert out.ok and out.result["duplicate_genes_merged"] == 1
    assert list(session.adata.var_names) == ["A", "B"]  # one gene A, not A and A-1 as markers
    assert np.array_equal(session.adata.X.toarray()[:, 0], adata.X[:, 0] + adata.X[:, 2])


def test_ensembl_ids_without_symbols_need_an_explicit_choice(tmp_path):
    ids = [f"ENSG0000000000{i}" for i in range(4)]
    path = _write(tmp_path, _counts(genes=ids, biotype=["protein_coding"] * 4))
    session = Session(tmp_path / "o", input_path=path)
    out = call(session, "load_data")
    assert not out.ok and str(path) in out.error and "var columns: ['biotype']" in out.error
    assert "gene_symbols=COLUMN" in out.error and "gene_symbols='var_names'" in out.error
    out = call(session, "load_data", gene_symbols="var_names")
    assert out.ok and list(session.adata.var_names) == ids
    assert any("will not match" in w for w in out.result["warnings"])


def test_mtx_features_without_symbols_are_explained(tmp_path):
    folder = tmp_path / "mtx"
    folder.mkdir()
    buffer = io.BytesIO()
    spio.mmwrite(buffer, sparse.coo_matrix(np.ones((3, 2))), field="integer")
    files = {
        "matrix.mtx.gz": buffer.getvalue(),
        "barcodes.tsv.gz": b"C0-1\nC1-1\n",
        "features.tsv.gz": b"ENSG01\nENSG02\nENSG03\n",  # IDs only, no symbol column
    }
    for name, data in files.items():
        (folder / name).write_bytes(gzip.compress(data))
    out = call(Session(tmp_path / "o", input_path=folder), "load_data")
    assert not out.ok and f"could not read {folder}: features.tsv.gz has one column" in out.error


def _mtx_folder(folder, features_name, gz, symbols):
    """A 10x folder of 30 cells: Cell Ranger v2 (genes.tsv) or v3 (features.tsv), gzipped or not."""
    folder.mkdir()
    counts = sparse.random(len(symbols), 30, density=0.5, format="coo", random_state=0)
    counts.data = np.ceil(counts.data * 5)
    buffer = io.BytesIO()
    spio.mmwrite(buffer, counts, field="integer")
    kind = "\tGene Expression" if features_name == "features.tsv" else ""
    files = {
        "matrix.mtx": buffer.getvalue(),
        features_name: "".join(f"ENSG{i:05d}\t{g}{kind}\n" for i, g in enumerate(symbols)).encode(),
        "barcodes.tsv": "".join(f"C{i}-1\n" for i in range(30)).encode(),
    }
    for name, data in files.items():
        if gz:
            (folder / f"{name}.gz").write_bytes(gzip.compress(data))
        else:
            (folder / name).write_bytes(data)
    return counts.T.toarray()


@pytest.mark.parametrize("gz", [False, True])
@pytest.mark.parametrize("features_name", ["genes.tsv", "features.tsv"])
def test_10x_folders_v2_and_v3_gzipped_or_not_are_read_and_checksummed(tmp_path, features_name, gz):
    folder = tmp_path / "mtx"
    counts = _mtx_folder(folder, features_name, gz, ["MT-CO1", "CD3D", "CD3D", "LYZ", "LYZ"])
    session = Session(tmp_path / "o", input_path=folder)
    out = call(session, "load_data")
    assert out.ok, out.error
    assert out.result["format"] == "10x_mtx" and out.result["duplicate_genes_merged"] == 2
    assert list(session.adata.var_names) == ["MT-CO1", "CD3D", "LYZ"]
    merged = np.c_[counts[:, 0], counts[:, 1] + counts[:, 2], counts[:, 3] + counts[:, 4]]
    assert np.array_equal(session.adata.X.toarray(), merged)
    suffix = ".gz" if gz else ""
    used = [f"matrix.mtx{suffix}", f"{features_name}{suffix}", f"barcodes.tsv{suffix}"]
    assert [f.name for f in input_files(folder)] == used
    before = checksum(folder)
    (folder / used[1]).write_bytes(b"changed")  # the features file is part of the input
    assert checksum(folder) != before


def test_a_10x_folder_missing_a_file_names_it(tmp_path):
    folder = tmp_path / "mtx"
    _mtx_folder(folder, "genes.tsv", False, ["A", "B"])
    (folder / "genes.tsv").unlink()
    out = call(Session(tmp_path / "o", input_path=folder), "load_data")
    assert not out.ok and f"{folder} is a folder without features.tsv.gz" in out.error
    assert "genes.tsv" in out.error


def test_missing_unknown_and_outside_paths(tmp_path, small_input):
    session = Session(tmp_path / "o", input_path=small_input)
    for path, message in [
        ("nothing.h5ad", "does not exist"),
        ("../../etc/passwd", "neither the run's input"),
        ("/etc/passwd", "neither the run's input"),
    ]:
        out = call(session, "load_data", path=path)
        assert not out.ok and message in out.error, out.error
    (tmp_path / "o" / "table.csv").write_text("a,b\n1,2\n")
    out = call(session, "load_data", path="table.csv")
    assert not out.ok and "unknown input format" in out.error
    assert not call(Session(tmp_path / "p"), "load_data").ok  # no input at all


def test_a_file_in_the_output_folder_is_named_by_its_path_there(tmp_path, small_input):
    session = Session(tmp_path / "o", input_path=small_input)
    (tmp_path / "o" / "sub").mkdir()
    shutil.copy(small_input, tmp_path / "o" / "sub" / "copy.h5ad")
    out = call(session, "load_data", path="sub/copy.h5ad")
    assert out.ok and out.result["path"] == "sub/copy.h5ad"


CELLS, GENES, NNZ = 2_000_000_000, 3_000_000_000, 200_000_000_000  # terabytes once read


def _huge_mtx(tmp_path):
    folder = tmp_path / "mtx"
    folder.mkdir()
    header = f"%%MatrixMarket matrix coordinate integer general\n{GENES} {CELLS} {NNZ}\n1 1 1\n"
    files = {"matrix.mtx.gz": header, "barcodes.tsv.gz": "C0-1\n", "features.tsv.gz": "ID\tA\n"}
    for name, text in files.items():
        (folder / name).write_bytes(gzip.compress(text.encode()))
    return folder, folder / "matrix.mtx.gz"


def _huge_h5ad(tmp_path):
    path = _write(tmp_path, ad.AnnData(sparse.csr_matrix(np.eye(3, dtype=np.float32))))
    with h5py.File(path, "a") as f:  # a declared length: chunks never written take no space
        del f["X/data"]
        f["X"].create_dataset("data", shape=(NNZ,), dtype=np.float32, chunks=(1 << 20,))
        f["X"].attrs["shape"] = (CELLS, GENES)
    return path, path


def _huge_h5(tmp_path):
    path = tmp_path / "in.h5"
    with h5py.File(path, "w") as f:
        m = f.create_group("matrix")
        m["shape"] = np.array([GENES, CELLS])
        m.create_dataset("data", shape=(NNZ,), dtype=np.int32, chunks=(1 << 20,))
        m["indices"] = np.zeros(1, np.int64)
    return path, path


@pytest.mark.parametrize("make", [_huge_mtx, _huge_h5ad, _huge_h5])
def test_a_matrix_too_big_for_memory_is_refused_from_its_header(tmp_path, make):
    path, file = make(tmp_path)
    start = time.perf_counter()
    with pytest.raises(InfrastructureError) as refused:  # the job's fault, not the sample's
        call(Session(tmp_path / "o", input_path=path), "load_data")
    assert time.perf_counter() - start < 1  # the header alone: nothing was allocated
    declared = f"{file} declares 2,000,000,000 cells x 3,000,000,000 genes with 200,000,000,000 "
    error = str(refused.value)
    assert "MemoryError" in error and declared + "nonzero values: reading it needs about " in error
    assert re.search(r"(GiB|MiB), this job has [\d,.-]+ (GiB|MiB) available \(", error), error


def test_available_memory_follows_the_address_space_limit():
    vm_size = int(re.search(r"VmSize:\s+(\d+) kB", Path("/proc/self/status").read_text())[1])
    before = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (vm_size * 1024 + (256 << 20), before[1]))
    try:
        room, limit = available_memory()
    finally:
        resource.setrlimit(resource.RLIMIT_AS, before)
    assert room <= 256 << 20 and "ulimit -v" in limit


@pytest.mark.parametrize("where", ["file", "matrix in folder", "device"])
def test_a_fifo_or_device_is_refused_without_opening_it(tmp_path, where):
    if where == "device":
        path = special = Path("/dev/zero")
    elif where == "file":
        path = special = tmp_path / "in.h5ad"
        os.mkfifo(special)
    else:
        path, matrix = _huge_mtx(tmp_path)
        matrix.unlink()
        special = path / "matrix.mtx.gz"
        os.mkfifo(special)
    outcomes = []
    worker = threading.Thread(
        target=lambda: outcomes.append(call(Session(tmp_path / "o", input_path=path), "load_data")),
        daemon=True,  # were it to hang on open(), the test fails instead of hanging
    )
    worker.start()
    worker.join(timeout=10)
    assert outcomes, "load_data hung"
    kind = "a character device" if where == "device" else "a FIFO (named pipe)"
    assert not outcomes[0].ok and f"could not read {special}: it is {kind}" in outcomes[0].error


def test_save_writes_inside_outdir_only(session_at):
    session = session_at("filter_genes")
    out = call(session, "save", path="sub/keep.h5ad")
    assert out.ok and ad.read_h5ad(session.outdir / "sub/keep.h5ad").shape == session.adata.shape
    for bad, message in [
        ("../escape.h5ad", "leaves the sample's output folder"),
        ("x.csv", "must end in .h5ad"),
        ("adata.h5ad", "written by finish"),  # only finish writes the final object
        ("checkpoints/step_0004.h5ad", "hold checkpoints"),
        ("previous/x/adata.h5ad", "hold checkpoints"),
    ]:
        out = call(session, "save", path=bad)
        assert not out.ok and message in out.error
    assert not (session.outdir.parent / "escape.h5ad").exists()


def test_finish_writes_the_final_object_and_summary(session_at):
    session = session_at("annotate_clusters")
    out = call(session, "finish", conclusion="done")
    assert out.ok, out.error
    r = out.result
    final = ad.read_h5ad(session.outdir / "adata.h5ad")
    assert final.shape == (r["n_cells"], r["n_genes"]) == session.adata.shape
    assert r["n_clusters"] == final.obs["leiden"].nunique() == len(r["leiden_sizes"])
    assert sum(r["cell_type_sizes"].values()) == r["n_cells"]
    assert "leiden" in r["steps_done"] and r["conclusion"] == "done"
    assert not list(session.outdir.glob(".*tmp"))  # atomic write left no temp file


def test_finish_without_data_is_an_error(tmp_path):
    out = call(Session(tmp_path), "finish")
    assert not out.ok and "load_data" in out.error
