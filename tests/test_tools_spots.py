"""Spatial spots recognised by content and layout (issue 37): Space Ranger's .h5 without
obsm['spatial'], its spot list beside the matrix, Visium HD's bin barcodes, positions on a
capture array's lattice, and inputs that only look like it (Cell Ranger's .h5, segmented cells'
positions, a spot list of other barcodes)."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pandas as pd
import pytest

from agent.data.synthetic import SampleSpec, simulate, write_10x_h5, write_10x_mtx
from agent.testing.reference_run import call_tool as call
from agent.tools.session import Session
from agent.tools.spots import are_spots

BASES = np.array(list("ACGT"))


@pytest.fixture(scope="module")
def counts():
    """120 synthetic cells with barcodes as 10x writes them (16 bases, '-1')."""
    adata, _ = simulate(SampleSpec("spots", 120, seed=11, doublet_fraction=0, empty_fraction=0))
    rng = np.random.default_rng(0)
    adata.obs_names = ["".join(rng.choice(BASES, 16)) + "-1" for _ in range(adata.n_obs)]
    return adata


def _positions(barcodes, path: Path, header: bool = True) -> None:
    """A Space Ranger spot list: barcode, in_tissue, array row/col, full-resolution pixels."""
    n = len(barcodes)
    rows = pd.DataFrame({
        "barcode": barcodes, "in_tissue": 1, "array_row": np.arange(n) // 8,
        "array_col": np.arange(n) % 8 * 2, "pxl_row_in_fullres": np.arange(n) * 90,
        "pxl_col_in_fullres": np.arange(n) * 70,
    })  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    rows.to_csv(path, index=False, header=header)


def _load(path: Path, outdir: Path):
    session = Session(outdir, input_path=path)
    out = call(session, "load_data")
    assert out.ok, out.error
    return session, out.result


def _write_h5(counts, path: Path, **attrs: str) -> Path:
    """A 10x .h5 with the root attributes its writer (Cell Ranger, Space Ranger) sets."""
    write_10x_h5(counts, path)
    with h5py.File(path, "a") as f:
        for key, value in attrs.items():
            f.attrs[key] = np.bytes_(value)
    return path


def test_a_cell_ranger_h5_is_single_cells(counts, tmp_path):
    matrix = _write_h5(
        counts, tmp_path / "outs" / "filtered_feature_bc_matrix.h5",
        software_version="cellranger-7.1.0", chemistry_description="Single Cell 3' v3",
    )  # fmt: skip
    session, result = _load(matrix, tmp_path / "o")
    assert result["modality"] == "single cells or nuclei" and "modality_evidence" not in result
    assert "modality" not in session.adata.uns


def test_space_rangers_spot_list_beside_the_h5_makes_spots(counts, tmp_path):
    """No obsm['spatial'] in the .h5: the spot positions Space Ranger writes beside it say
    spots, and doublet detection then calls none."""
    matrix = tmp_path / "outs" / "filtered_feature_bc_matrix.h5"
    write_10x_h5(counts, matrix)
    _positions(counts.obs_names, tmp_path / "outs" / "spatial" / "tissue_positions.csv")
    session, result = _load(matrix, tmp_path / "o")
    assert result["modality"] == "spatial spots"
    assert "100% of the barcodes are listed" in result["modality_evidence"][0]
    assert session.adata.uns["modality"]["evidence"] == result["modality_evidence"]
    out = call(session, "detect_doublets")
    assert out.ok and "spatial spots" in out.result["skipped"]


@pytest.mark.parametrize(
    ("attrs", "said"),
    [
        ({"software_version": "spaceranger-2.1.0", "chemistry_description": "Visium V1 Slide"},
         "software_version 'spaceranger-2.1.0', chemistry_description 'Visium V1 Slide'"),
        ({"software_version": "spaceranger-3.0.0"}, "software_version 'spaceranger-3.0.0'"),
        ({"chemistry_description": "Spatial 3' v1"}, "chemistry_description \"Spatial 3' v1\""),
    ],
)  # fmt: skip
def test_space_rangers_own_h5_makes_spots(counts, tmp_path, attrs, said):
    """Either of Space Ranger's root attributes is enough."""
    matrix = _write_h5(counts, tmp_path / "filtered_feature_bc_matrix.h5", **attrs)
    _, result = _load(matrix, tmp_path / "o")
    assert result["modality"] == "spatial spots"
    assert result["modality_evidence"] == [
        f"the .h5's root attributes name Space Ranger's output ({said})"
    ]


def test_an_mtx_folder_with_the_older_spot_list_makes_spots(counts, tmp_path):
    """Space Ranger before 2.0: tissue_positions_list.csv, no header, one folder up."""
    write_10x_mtx(counts, tmp_path / "outs" / "filtered_feature_bc_matrix")
    _positions(counts.obs_names, tmp_path / "outs" / "spatial" / "tissue_positions_list.csv",
               header=False)  # fmt: skip
    _, result = _load(tmp_path / "outs" / "filtered_feature_bc_matrix", tmp_path / "o")
    assert result["modality"] == "spatial spots"


def test_a_spot_list_of_other_barcodes_is_no_evidence(counts, tmp_path):
    """Judged by content: a positions file that lists none of the matrix's barcodes."""
    matrix = tmp_path / "outs" / "filtered_feature_bc_matrix.h5"
    write_10x_h5(counts, matrix)
    others = [f"TTTT{b[4:]}" for b in counts.obs_names]
    _positions(others, tmp_path / "outs" / "spatial" / "tissue_positions.csv")
    _, result = _load(matrix, tmp_path / "o")
    assert result["modality"] == "single cells or nuclei"


def _hexagonal(n: int, spacing: float, rng: np.random.Generator) -> np.ndarray:
    """Visium's layout: spots on a hexagonal grid, positions rounded to whole pixels."""
    rows, cols = np.divmod(np.arange(n), 12)
    x = cols * spacing + (rows % 2) * spacing / 2
    y = rows * spacing * np.sqrt(3) / 2
    return np.rint(np.column_stack([x, y]) + rng.uniform(0, 1000, 2))


def test_positions_on_a_lattice_are_spots_and_segmented_cells_are_not(counts, tmp_path):
    """obsm['spatial'] alone: a capture array's grid makes spots; cells segmented from an image
    (Xenium, MERSCOPE: scattered positions) stay single cells, as does a string modality."""
    rng = np.random.default_rng(1)
    spots = counts.copy()
    spots.obsm["spatial"] = _hexagonal(spots.n_obs, 137.5, rng)
    spots.write_h5ad(tmp_path / "spots.h5ad")
    _, result = _load(tmp_path / "spots.h5ad", tmp_path / "o1")
    assert result["modality"] == "spatial spots"
    assert "regular grid" in result["modality_evidence"][0]
    cells = counts.copy()
    cells.obsm["spatial"] = rng.uniform(0, 400, (cells.n_obs, 2))  # micrometres, scattered
    cells.write_h5ad(tmp_path / "cells.h5ad")
    session, result = _load(tmp_path / "cells.h5ad", tmp_path / "o2")
    assert result["modality"] == "single cells or nuclei"
    session.adata.uns["modality"] = "rna"  # written by another tool: no crash, judged by layout
    assert not are_spots(session.adata)


def test_visium_hd_bin_barcodes_make_spots(counts, tmp_path):
    binned = counts.copy()
    binned.obs_names = [f"s_008um_{i // 11:05d}_{i % 11:05d}-1" for i in range(binned.n_obs)]
    matrix = tmp_path / "square_008um" / "filtered_feature_bc_matrix.h5"
    write_10x_h5(binned, matrix)
    _, result = _load(matrix, tmp_path / "o")
    assert result["modality"] == "spatial spots"
    assert "Visium HD bins" in result["modality_evidence"][0]
