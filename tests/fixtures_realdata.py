"""Real single-cell count matrices that installed packages ship, as test inputs (issue 15).

The sets themselves (where each lies, how it becomes raw counts, its published labels) are
agent/data/real.py's, which `agent eval` reads too; here they are converted once per test session
to an .h5ad of raw counts with a truth.tsv of the published labels beside it where the set has
them. A set whose package is missing is skipped, naming what installs it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anndata as ad
import pandas as pd
import pytest

from agent.data.real import (
    PUBLISHED_TYPES,
    REAL_SETS,
    RealSet,
    per_type_agreement,
    shipped_file,
    write_real,
    write_truth,
)
from agent.testing.reference_run import run_reference

__all__ = [
    "INSTALL_HINT", "PUBLISHED_FLOORS", "PUBLISHED_TYPES", "REAL_SETS", "RealSet",
    "per_type_agreement", "real_input", "real_run", "shipped_file", "shipped_or_skip", "write_truth",
]  # fmt: skip

INSTALL_HINT = "pip install -e '.[test]' and bash tests/realdata/install.sh"


def _not_installed(real: RealSet) -> str:
    return f"{real.name}: {real.file} of {real.package} not installed ({INSTALL_HINT})"


def shipped_or_skip(name: str) -> tuple[ad.AnnData, pd.Series | None]:
    """The shipped set ``name`` as raw counts with its published labels (None where it has
    none); the test skipped, naming what installs it, where its package is not installed."""
    real = REAL_SETS[name]
    source = shipped_file(real)
    if source is None:
        pytest.skip(_not_installed(real))
    return real.read(source)


@pytest.fixture(scope="session", params=sorted(REAL_SETS))
def real_input(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One shipped set as a raw-count .h5ad (truth.tsv beside it when it has published labels)."""
    real = REAL_SETS[request.param]
    path = write_real(real, tmp_path_factory.mktemp(real.name))
    if path is None:
        pytest.skip(_not_installed(real))
    return path


@pytest.fixture(scope="session")
def real_run(real_input: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The reference analysis of one shipped set, run once per session."""
    session, world = run_reference(real_input, tmp_path_factory.mktemp(f"{real_input.stem}_run"))
    return {"name": real_input.stem, "input": real_input, "session": session, "world": world}


# Floors of the share of a published type labelled as it, below those measured 2026-12 (shipped
# Louvain clusters / reference recipe: monocytes 0.95 / 0.94, B 0.95 / 1.0, CD34+ 1.0 / 1.0, NK
# 0.97 / 0.97, Dendritic 0.78 / 0.64). The T-cell sorts are printed, not floored: the set's 765
# genes hold none of FOXP3, IL2RA, SELL, LEF1, TCF7, and the bulk labels of T sorts are noisy.
# Nor the NK sort (issue 37): its cells detect CD3 in 65% (CD8 T cells 97%, non-T 23-35%) and
# share a cluster with CD8 T cells, which the lineage gate calls T (a CD3+ cluster is never NK).
PUBLISHED_FLOORS = {
    "CD14+ Monocyte": 0.9, "CD19+ B": 0.9, "CD34+": 0.9, "Dendritic": 0.55,
}  # fmt: skip
