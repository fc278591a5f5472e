"""The synthetic generator: seeded, realistic in the ways QC looks at, readable by scanpy."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import anndata as ad
import numpy as np
import pytest
import scanpy as sc

from agent.cli import main as cli
from agent.data.synthetic import (
    CELL_TYPES,
    DEMO_COHORT,
    LINEAGE,
    MT_GENES,
    PROGRAMS,
    SampleSpec,
    load_truth,
    simulate,
    write_sample,
)
from agent.tools.annotate import default_marker_sets

SPEC = SampleSpec("t", 500, seed=3, damaged_fraction=0.1, doublet_fraction=0.06, empty_fraction=0.1)


@pytest.fixture(scope="module")
def sample() -> tuple[ad.AnnData, object]:
    return simulate(SPEC)


def test_same_seed_same_data_other_seed_other_data(sample):
    adata, truth = sample
    again, truth_again = simulate(SPEC)
    assert (adata.X != again.X).nnz == 0
    assert truth.equals(truth_again)
    other, _ = simulate(replace(SPEC, seed=4))
    assert (adata.X != other.X).nnz > 0


def test_planted_counts_match_the_spec(sample):
    adata, truth = sample
    n_doublets = round(0.06 * 500)
    assert adata.n_obs == len(truth) == 500 + round(0.1 * 500)
    assert truth["is_doublet"].sum() == n_doublets
    assert truth["is_empty"].sum() == 50
    assert truth["is_damaged"].sum() == round(0.1 * (500 - n_doublets))
    assert not (truth["is_damaged"] & truth["is_doublet"]).any()
    assert set(truth.loc[truth["is_empty"], "cell_type"]) == {"empty"}
    doublet_types = truth.loc[truth["is_doublet"], "cell_type"]
    assert all(len({LINEAGE[t] for t in pair.split("+")}) == 2 for pair in doublet_types)
    assert list(adata.obs_names) == list(truth["barcode"])
    assert adata.obs_names.is_unique and adata.obs_names.str.fullmatch(r"[ACGT]{16}-1").all()


def test_counts_look_like_umi_data(sample):
    adata, truth = sample
    x = adata.X
    assert np.all(x.data == np.round(x.data)) and x.data.min() >= 1
    assert 0.6 < 1 - x.nnz / np.prod(x.shape) < 0.95  # sparse
    counts = np.asarray(x.sum(1)).ravel()
    genes = np.diff(x.indptr)
    mt = np.asarray(x[:, adata.var_names.isin(MT_GENES)].sum(1)).ravel() / counts * 100
    healthy = ~(truth["is_damaged"] | truth["is_doublet"] | truth["is_empty"]).to_numpy()
    assert 2000 < np.median(counts[healthy]) < 8000
    assert np.median(genes[healthy]) > 500
    assert np.median(genes[truth["is_empty"].to_numpy()]) < 200
    assert np.median(mt[healthy]) < 10 < np.percentile(mt[truth["is_damaged"].to_numpy()], 10)
    doublets = truth["is_doublet"].to_numpy()
    assert np.median(counts[doublets]) > 1.5 * np.median(counts[healthy])


def test_marker_genes_are_real_symbols_and_mark_their_type(sample):
    adata, truth = sample
    assert {"CD3D", "MS4A1", "LYZ", "GNLY", "PPBP", "FCER1A"} <= set(adata.var_names)
    assert adata.var_names.str.startswith("MT-").sum() == 13
    lyz = np.asarray(adata[:, "LYZ"].X.todense()).ravel()
    mono = (truth["cell_type"] == "CD14 Mono").to_numpy()
    t_cells = (truth["cell_type"] == "CD4 naive T").to_numpy()
    assert lyz[mono].mean() > 20 * max(lyz[t_cells].mean(), 0.05)
    assert set(CELL_TYPES) <= set(truth["cell_type"]) | {"Platelet", "DC"}  # rare types may miss
    assert all(g in adata.var_names for p in PROGRAMS.values() for g in p)


def test_planted_profiles_are_not_the_marker_lists():
    """Each planted type runs only part of the marker set of its name, genes on no marker list,
    and marker genes another type runs too: a wrong or lucky marker list cannot pass the label
    tests because the data were made from it."""
    sets = default_marker_sets()
    on_panel = {gene for genes in sets.values() for gene in genes}
    planted = {
        cell_type: {gene for program in programs for gene in PROGRAMS[program]}
        for cell_type, (programs, _, _) in CELL_TYPES.items()
    }
    for cell_type, genes in planted.items():
        markers = set(sets[cell_type])  # every planted type has the marker set of its name
        assert len(markers - genes) >= len(markers) / 4, (cell_type, markers & genes)
        assert len(genes - on_panel) >= 3, (cell_type, genes - on_panel)
    shared = {gene for gene in on_panel if sum(gene in g for g in planted.values()) >= 2}
    assert len(shared) >= 5, shared


@pytest.mark.parametrize("name", list(DEMO_COHORT))
def test_demo_sample_written_in_its_format_and_truth_beside_it(name, demo_inputs):
    spec = DEMO_COHORT[name]
    path = demo_inputs[name]
    if spec.format == "mtx":
        adata = sc.read_10x_mtx(path)
        assert {p.name for p in path.iterdir()} >= {
            "matrix.mtx.gz",
            "barcodes.tsv.gz",
            "features.tsv.gz",
        }
    elif spec.format == "h5":
        adata = sc.read_10x_h5(path)
    else:
        adata = ad.read_h5ad(path)
        assert list(adata.obs.columns) == []  # no truth inside the matrix file
    truth = load_truth(path)
    expected, _ = simulate(spec)
    assert adata.shape == expected.shape
    assert np.array_equal(adata.obs_names, truth.index)
    assert (adata.X != expected.X).nnz == 0
    params = json.loads(
        (path if path.is_dir() else path.parent).joinpath("synthetic.json").read_text()
    )
    assert params["spec"]["seed"] == spec.seed


def test_demo_cohort_differs_in_size_damage_and_composition():
    specs = list(DEMO_COHORT.values())
    assert len({s.n_cells for s in specs}) == len({s.damaged_fraction for s in specs}) == len(specs)
    assert len({json.dumps(s.composition, sort_keys=True) for s in specs}) == len(specs)
    assert {s.format for s in specs} == {"mtx", "h5ad", "h5"}
    assert all(1500 <= s.n_cells <= 4000 for s in specs)


def test_mtx_files_are_byte_identical_on_rewrite(tmp_path):
    spec = SampleSpec("tiny", 80, seed=1)
    write_sample(spec, tmp_path / "a")
    write_sample(spec, tmp_path / "b")
    for name in ("matrix.mtx.gz", "barcodes.tsv.gz", "features.tsv.gz", "truth.tsv"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n_cells": 10}, "n_cells=10"),
        ({"damaged_fraction": 0.9}, "damaged_fraction=0.9"),
        ({"composition": {"Neuron": 1.0}}, "unknown cell types ['Neuron']"),
        ({"composition": {"CD4 naive T": 0.5, "NK": 0.5}}, "at least two lineages"),
        ({"format": "loom"}, "format='loom'"),
    ],
)
def test_bad_spec_names_the_field(kwargs, message):
    args = {"name": "bad", "n_cells": 100, "seed": 0} | kwargs
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        SampleSpec(**args)


def test_cli_writes_one_demo_sample(tmp_path, capsys):
    assert cli(["synth", "--outdir", str(tmp_path / "s"), "--sample", "pbmc2"]) == 0
    line = json.loads(capsys.readouterr().out.strip())
    assert line["sample"] == "pbmc2" and Path(line["input"]).name == "counts.h5ad"
    assert Path(line["input"]).is_file() and Path(line["truth"]).is_file()


def test_cli_custom_sample_and_bad_value(tmp_path, capsys):
    args = [
        "synth",
        "--outdir",
        str(tmp_path / "c"),
        "--cells",
        "120",
        "--seed",
        "5",
        "--format",
        "h5",
    ]
    assert cli(args) == 0
    path = Path(json.loads(capsys.readouterr().out)["input"])
    assert sc.read_10x_h5(path).n_obs == 120 + round(0.08 * 120)
    assert (
        cli(["synth", "--outdir", str(tmp_path / "d"), "--cells", "120", "--damaged", "0.9"]) == 2
    )
    assert "damaged_fraction=0.9" in capsys.readouterr().err
