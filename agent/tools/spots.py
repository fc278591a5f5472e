"""Spatial spots told from single cells by the input's content and layout, not one key.

A Visium spot (55 µm) holds several cells and a Visium HD bin parts of cells: doublet detection
and per-cell QC mean something else there. Space Ranger writes the same 10x matrix formats as
Cell Ranger, and imaging technologies that segment single cells (Xenium, MERSCOPE, CosMx) store
positions in ``obsm['spatial']`` too, so neither the format nor that key can tell; what can:

- positions on a regular lattice: a capture array's spots or bins lie at one spacing from their
  nearest neighbour (Visium's hexagonal grid, Visium HD's square bins; Space Ranger's pixel
  positions are the fitted grid, rounded to whole pixels), segmented cells at scattered distances;
- scanpy's and squidpy's Visium layout: ``uns['spatial'][library]['scalefactors']`` with
  ``spot_diameter_fullres`` (Visium) or ``bin_size_um`` (Visium HD);
- a 10x .h5 that Space Ranger wrote: its root attributes (``software_version`` 'spaceranger-...'
  or ``chemistry_description`` naming Visium or Spatial, either one);
- Visium HD's bin barcodes (``s_008um_00301_00046-1``: the bin's size, row and column). Its spot
  list, ``spatial/tissue_positions.parquet``, needs a parquet reader the pipeline does not
  install; it lists these same barcodes;
- a spot list beside the matrix, as Space Ranger lays out ``outs/``: ``spatial/
  tissue_positions.csv`` (``tissue_positions_list.csv`` before Space Ranger 2.0) in the matrix's
  folder or the one above it, holding the matrix's barcodes (AAACAAGTATCTCCCA-1) with their
  array positions. A file of that name that does not list the matrix's barcodes is no evidence.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pandas as pd
from scipy.spatial import cKDTree

MODALITY = "spatial spots"
POSITION_FILES = ("tissue_positions.csv", "tissue_positions_list.csv")
# share of the matrix's barcodes a positions file (or Visium HD's bin pattern) must cover
MIN_LISTED = 0.9
# A lattice: at least this share of the positions have their nearest neighbour within
# LATTICE_TOLERANCE of the median spacing. Whole-pixel rounding of a Visium grid (about 100-300
# pixels apart) moves a spacing by under 1%; segmented cells' spacings spread over tens of
# percent, so few fall within 2% of their median.
LATTICE_SHARE = 0.8
LATTICE_TOLERANCE = 0.02
HD_BARCODE = re.compile(r"^s_\d{3}um_\d{5}_\d{5}-1$")


def _h5_writer(path: Path) -> str | None:
    """Space Ranger's mark in a 10x .h5's root attributes, in words (None: not its file)."""
    try:
        with h5py.File(path, "r") as f:
            attrs = dict(f.attrs)
    except OSError:
        return None
    text = {k: v.decode() if isinstance(v, bytes) else str(v) for k, v in attrs.items()}
    software = text.get("software_version", "")
    chemistry = text.get("chemistry_description", "")
    if software.lower().startswith("spaceranger") or any(
        word in chemistry.lower() for word in ("visium", "spatial")
    ):
        said = {"software_version": software, "chemistry_description": chemistry}
        named = ", ".join(f"{k} {v!r}" for k, v in said.items() if v)
        return f"the .h5's root attributes name Space Ranger's output ({named})"
    return None


def _positions_file(source: Path) -> list[Path]:
    """Space Ranger's spot lists where its layout puts them beside a matrix file or folder."""
    folder = source if source.is_dir() else source.parent
    return [
        base / "spatial" / name
        for base in (folder, folder.parent)
        for name in POSITION_FILES
        if (base / "spatial" / name).is_file()
    ]


def _listed(path: Path, barcodes: Any) -> float:
    """Share of ``barcodes`` that the positions file lists in its first column."""
    try:
        first = pd.read_csv(path, header=None, usecols=[0], dtype=str)[0]
    except (OSError, ValueError, pd.errors.ParserError):
        return 0.0
    return float(np.isin(np.asarray(barcodes, dtype=str), first.to_numpy()).mean())


def _lattice(coordinates: Any) -> str | None:
    """Whether 2-D positions lie on a regular lattice (capture spots or bins), in words."""
    points = np.asarray(coordinates, dtype=float)
    if points.ndim != 2 or points.shape[1] < 2 or len(points) < 3:
        return None
    points = points[:, :2][np.isfinite(points[:, :2]).all(axis=1)]
    if len(points) < 3:
        return None
    spacing = cKDTree(points).query(points, k=2)[0][:, 1]
    median = float(np.median(spacing))
    if median <= 0:
        return None
    on_grid = float((np.abs(spacing - median) <= LATTICE_TOLERANCE * median).mean())
    if on_grid < LATTICE_SHARE:
        return None
    return (
        f"obsm['spatial'] positions lie on a regular grid ({on_grid:.0%} at {median:.4g} from "
        "their nearest neighbour): capture spots or bins, not segmented cells"
    )


def _layout(adata: Any) -> list[str]:
    """The AnnData's own spot evidence: a lattice of positions, Visium's scale factors, Visium
    HD's bin barcodes."""
    found = []
    if (coordinates := adata.obsm.get("spatial")) is not None and (grid := _lattice(coordinates)):
        found.append(grid)
    libraries = adata.uns.get("spatial")
    for library, content in libraries.items() if isinstance(libraries, dict) else []:
        scale = content.get("scalefactors", {}) if isinstance(content, dict) else {}
        if "spot_diameter_fullres" in scale or "bin_size_um" in scale:
            found.append(f"uns['spatial'][{library!r}] holds Visium scale factors (spots)")
            break
    names = pd.Index(np.asarray(adata.obs_names, dtype=str))
    if len(names) and names.str.match(HD_BARCODE.pattern).mean() >= MIN_LISTED:
        found.append(f"the barcodes are Visium HD bins ({names[0]}: bin size, row, column)")
    return found


def spot_evidence(adata: Any, source: Path) -> list[str]:
    """Why the input's barcodes are spatial spots, each piece of evidence in words (empty:
    single cells or nuclei)."""
    found = _layout(adata)
    if source.is_file() and source.suffix == ".h5" and (writer := _h5_writer(source)):
        found.append(writer)
    for path in _positions_file(source):
        share = _listed(path, adata.obs_names)
        if share >= MIN_LISTED:
            found.append(
                f"{share:.0%} of the barcodes are listed in Space Ranger's spot positions "
                f"({path.parent.name}/{path.name} beside the matrix)"
            )
            break
    return found


def are_spots(adata: Any) -> bool:
    """Whether the loaded data are spatial spots: load_data's evidence in uns['modality'], or
    the AnnData's own layout judged as load_data judges it."""
    said = adata.uns.get("modality")
    if isinstance(said, dict):
        return said.get("modality") == MODALITY
    return said == MODALITY or bool(_layout(adata))
