"""annotate_celltypist: labels from a user-supplied CellTypist model (issue 24, item 4).

No second labelled real set ships in the installed packages (CellTypist's sample and Seurat's
pbmc_small carry no cell types), so a small model is trained on a seeded random half of
scanpy's pbmc68k_reduced (published Zheng 2017 bulk-profile labels; agent/testing/
celltypist_model.py) and applied to the other half, which the reference recipe analyses from its
raw counts with the model as a run option.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anndata as ad
import numpy as np
import pandas as pd
import pytest

from agent.config import RunConfig
from agent.record.provenance import file_sha256
from agent.record.world_state import WorldState
from agent.registry import ToolError
from agent.testing.celltypist_model import SPLIT_SEED, train_model, training_half
from agent.testing.reference_run import call_tool, run_reference
from agent.tools.celltypist_annotate import UNS_KEY
from agent.tools.session import Session
from tests.fixtures_realdata import shipped_or_skip
from tests.fixtures_workflow import WorkflowDir

# Accuracy against the published labels on the held-out half, measured 2026-12 (seed 0 split,
# SGD model alpha 0.1): per cell 0.815, voted per Leiden cluster 0.736. Floors leave a margin.
FLOORS = {"cell": 0.75, "voted": 0.65}


def pbmc_halves(seed: int = SPLIT_SEED) -> tuple[ad.AnnData, pd.Series, np.ndarray]:
    """pbmc68k_reduced's rebuilt counts, its labels, and the seeded training half (a mask)."""
    counts, labels = shipped_or_skip("pbmc68k_reduced")
    return counts, labels, training_half(counts.n_obs, seed)


@pytest.fixture(scope="module")
def held_out_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The reference analysis of the held-out half with the model trained on the other half."""
    counts, labels, train = pbmc_halves()
    root = tmp_path_factory.mktemp("celltypist")
    model = train_model(counts[train], labels[train], root / "pbmc_half.pkl")
    held_out = root / "held_out.h5ad"
    counts[~train].copy().write_h5ad(held_out)
    session, world = run_reference(held_out, root / "out", celltypist_model=model)
    return {"session": session, "world": world, "model": model, "truth": labels[~train]}


def test_reference_run_labels_from_the_model(held_out_run: dict[str, Any]) -> None:
    world, session = held_out_run["world"], held_out_run["session"]
    assert world.last_ok("finish") is not None, [(e.tool, e.error) for e in world.entries]
    entry = world.last_ok("annotate_celltypist")
    assert entry is not None and entry.params["model_file"] is None, entry  # the run's model
    final = ad.read_h5ad(session.layout.final)
    truth = held_out_run["truth"].loc[final.obs_names]
    cell = float((final.obs["cell_type_predicted"].astype(str) == truth).mean())
    voted = float((final.obs["cell_type"].astype(str) == truth).mean())
    print(f"held-out accuracy: per cell {cell:.3f}, voted per cluster {voted:.3f}")
    assert cell >= FLOORS["cell"] and voted >= FLOORS["voted"], (cell, voted)
    # the marker labels are kept beside the model's, for comparison
    assert "cell_type_markers" in final.obs and final.uns["annotation"]["key_added"] == (
        "cell_type_markers"
    )
    assert set(final.obs["cell_type"]) <= set(truth) | {"Unknown"}


def test_provenance_in_result_and_uns(held_out_run: dict[str, Any]) -> None:
    model_file = held_out_run["model"]
    result = held_out_run["world"].last_ok("annotate_celltypist").result
    model = result["model"]
    assert model["sha256"] == file_sha256(model_file)
    assert (model["name"], model["version"]) == ("pbmc_half.pkl", "test-1")
    assert 0 < model["n_genes_found"] <= model["n_model_genes"] == 765
    for cluster in result["clusters"].values():
        assert {"majority", "vote_share", "mean_confidence", "weak", "marker_label"} <= set(cluster)
        assert cluster["label"] in (cluster["majority"], "Unknown")
    uns = ad.read_h5ad(held_out_run["session"].layout.final).uns[UNS_KEY]
    assert uns["model"]["sha256"] == model["sha256"] and "rule" in uns


@contextmanager
def run_model(session: Session, path: Path | None, sha256: str | None = None) -> Iterator[None]:
    """The module's session, for a call, as a run given ``path`` as its model (whose setting
    is ``sha256``; None: not checked)."""
    saved = session.celltypist_model, session.celltypist_model_sha256
    session.celltypist_model = path.resolve() if path else None
    session.celltypist_model_sha256 = sha256
    try:
        yield
    finally:
        session.celltypist_model, session.celltypist_model_sha256 = saved


class RunsCode:
    """A pickle that runs a command when loaded, as a planted "model" would."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_refuses_a_file_that_is_no_model(held_out_run: dict[str, Any], tmp_path: Path) -> None:
    session = held_out_run["session"]
    notes = tmp_path / "notes.pkl"
    notes.write_text("not a model")
    with run_model(session, notes):
        outcome = call_tool(session, "annotate_celltypist")
    assert not outcome.ok and "is not a CellTypist model" in outcome.error, outcome.error
    # and a run given it is refused before it starts, not analysed with marker labels instead
    with pytest.raises(ValueError, match=f"--celltypist-model {notes} is not a CellTypist model"):
        RunConfig(input=tmp_path, outdir=tmp_path / "out", celltypist_model=notes)


def test_refuses_a_model_of_other_genes(held_out_run: dict[str, Any], tmp_path: Path) -> None:
    counts, labels, train = pbmc_halves()
    session = held_out_run["session"]
    other = counts[train].copy()
    other.var_names = [f"Gm{i}" for i in range(other.n_vars)]  # no gene in common
    with run_model(session, train_model(other, labels[train], tmp_path / "other.pkl")):
        outcome = call_tool(session, "annotate_celltypist")
    assert not outcome.ok and "0 of the model's 765 genes" in outcome.error, outcome.error


def test_no_pickle_but_the_run_model_is_read_and_none_runs_code(
    held_out_run: dict[str, Any], tmp_path: Path
) -> None:
    """A pickle in the output folder named by model_file, with or without a run model, is not
    read; the run's model itself, were it such a pickle, is refused before it runs: by `agent
    run` and `agent integrate` at once (exit 2, one line), and --help says why."""
    session = held_out_run["session"]
    marker = tmp_path / "ran"
    planted = session.outdir / "planted.pkl"
    planted.write_bytes(pickle.dumps(RunsCode(marker)))
    for model in (None, held_out_run["model"]):
        with run_model(session, model):
            outcome = call_tool(session, "annotate_celltypist", model_file="planted.pkl")
        assert not outcome.ok and "a model is a pickle, which can run code" in outcome.error
    assert not marker.exists()
    for command in (
        ["run", "--input", str(session.input_path), "--outdir", str(tmp_path / "out")],
        ["integrate", "--world-states", str(session.input_path), "--outdir", str(tmp_path)],
    ):
        out = subprocess.run(
            [sys.executable, "-m", "agent", *command, "--celltypist-model", str(planted)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert out.returncode == 2 and len(out.stderr.splitlines()) == 1, out.stderr
        assert f"{planted} is not a CellTypist model: its pickle names posix.system" in out.stderr
    assert not marker.exists()
    helped = subprocess.run(
        [sys.executable, "-m", "agent", "run", "--help"], capture_output=True, text=True
    )
    assert "pickle, which can run code when loaded" in " ".join(helped.stdout.split())


def test_a_model_changed_during_the_run_is_refused(
    held_out_run: dict[str, Any], tmp_path: Path
) -> None:
    """The run's model file replaced after the run began: its sha256 is checked at each use, so
    the labels never come from another model than the one the record and crate name."""
    session = held_out_run["session"]
    model = tmp_path / "model.pkl"
    shutil.copy(held_out_run["model"], model)
    began = file_sha256(model)
    train_model(*_other_half(), model)
    with run_model(session, model, began):
        outcome = call_tool(session, "annotate_celltypist")
    assert not outcome.ok and f"{model.resolve()} changed since the run began" in outcome.error
    assert f"the run's setting says {began}" in outcome.error


def test_run_model_is_readable_other_files_outside_are_not(tmp_path: Path) -> None:
    model = tmp_path / "models" / "m.pkl"
    model.parent.mkdir()
    model.write_bytes(b"x")
    (tmp_path / "other.pkl").write_bytes(b"x")
    session = Session(tmp_path / "out", celltypist_model=model)
    assert session.readable_path(str(model)) == model.resolve()
    with pytest.raises(ToolError, match="output folder"):
        session.readable_path(str(tmp_path / "other.pkl"))


def test_run_option_needs_an_existing_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"--celltypist-model .*: no such file"):
        RunConfig(input=tmp_path, outdir=tmp_path / "out", celltypist_model=tmp_path / "no.pkl")


def test_runner_records_the_model_and_a_changed_model_is_another_setting(
    held_out_run: dict[str, Any], tmp_path: Path
) -> None:
    """`agent run --celltypist-model`: the record, the report and the crate name the model, a
    replay reproduces it; the same folder with another model is refused as other settings."""
    from agent.replay import replay
    from agent.report.build import build_report
    from agent.resume import CannotReuse
    from agent.runner import run_sample

    model = tmp_path / "model.pkl"  # a copy: its content changes at the end
    shutil.copy(held_out_run["model"], model)
    held_out = held_out_run["session"].input_path
    config = RunConfig(input=held_out, outdir=tmp_path / "s1", celltypist_model=model)
    assert run_sample(config) == "finished"
    sha = file_sha256(model)
    record = config.layout.record
    meta = WorldState.load(record).meta
    assert (meta["celltypist_model"], meta["celltypist_model_sha256"]) == (str(model), sha)
    build_report([record], [], tmp_path / "report")
    table = pd.read_csv(tmp_path / "report" / "cohort.tsv", sep="\t")
    assert f"version test-1 sha256 {sha}" in table.loc[0, "reference_annotation"]
    page = next((tmp_path / "report" / "samples").glob("*.html")).read_text()
    assert "reference annotation" in page and sha in page
    graph = json.loads((tmp_path / "report" / "ro-crate" / "ro-crate-metadata.json").read_text())
    entity = next(e for e in graph["@graph"] if e["@id"] == model.as_uri())
    action = next(e for e in graph["@graph"] if e["@id"] == "#analyze-held_out")
    assert entity["sha256"] == sha and {"@id": model.as_uri()} in action["object"]
    assert replay(record)["verdict"] == "reproduced"  # the record's model, passed on

    other = train_model(*_other_half(), tmp_path / "other.pkl")
    with pytest.raises(CannotReuse, match="celltypist_model_sha256"):
        run_sample(config.model_copy(update={"celltypist_model": other}))
    model.write_bytes(other.read_bytes())  # the file the record names holds another model now
    out = replay(record)
    assert out["verdict"] == "not replayed", out
    assert "is not the model the analysis used" in out["summary"], out["summary"]


def _other_half() -> tuple[ad.AnnData, pd.Series]:
    """The held-out half with its labels: another model than the fixture's."""
    counts, labels, train = pbmc_halves()
    return counts[~train], labels[~train]


def test_workflow_passes_the_model_as_option_and_input(workflow_dir: WorkflowDir) -> None:
    """The sheet column (over the config default) reaches `agent run` and the analyze job's
    inputs (a changed model file reruns the job); a missing file is a sheet error."""
    inputs = workflow_dir.path / "inputs"
    inputs.mkdir()
    for name in ("a", "b", "m.pkl", "n.pkl"):
        (inputs / name).touch()
    workflow_dir.configure(analysis={"celltypist_model": "inputs/m.pkl"})
    workflow_dir.write_sheet(
        [{"sample": "a", "path": "inputs/a", "celltypist_model": "inputs/n.pkl"},
         {"sample": "b", "path": "inputs/b"}]
    )  # fmt: skip
    out = workflow_dir.snakemake("-n", "-p", "--cores", "2")
    assert out.returncode == 0, out.stdout
    assert "--celltypist-model inputs/n.pkl" in out.stdout, out.stdout
    assert "--celltypist-model inputs/m.pkl" in out.stdout, out.stdout
    assert re.search(r"input: inputs/a, inputs/n\.pkl", out.stdout), out.stdout
    workflow_dir.write_sheet([{"sample": "a", "path": "inputs/a", "celltypist_model": "no.pkl"}])
    out = workflow_dir.snakemake("-n", "--cores", "2")
    assert out.returncode != 0
    assert "column 'celltypist_model': 'no.pkl' is not a file" in out.stdout, out.stdout
