"""The cohort object: real finished samples, a planted batch effect, harmonypy, real files."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import anndata as ad
import numpy as np
import orjson
import pytest
from scipy import sparse

from agent.cohort.integrate import SAMPLE_LABEL, Options, finished_inputs, integrate
from agent.record.layout import SampleLayout
from agent.testing.cohort_copies import finished_copy
from tests.fixtures_report import DemoRun
from tests.fixtures_workflow import WorkflowDir

SHIFTED_GENES = 300  # genes whose counts the second batch multiplies: a strong batch effect
CELLS = 500  # of the demo sample's, the same ones in each batch: enough for every step, and quick


def _batch(
    source: SampleLayout, folder: Path, name: str, factor: float, shuffle: bool = False
) -> Path:
    """A finished sample folder (cohort_copies.finished_copy): CELLS of the demo run's cells,
    their counts scaled gene by gene (the same fixed genes, by ``factor``), X left for the
    integration to rebuild; ``shuffle``: each gene's counts under another gene's name (cells no
    other sample has)."""
    adata = ad.read_h5ad(source.final)
    adata = adata[np.random.default_rng(3).permutation(adata.n_obs)[:CELLS]].copy()
    if factor != 1:
        genes = np.random.default_rng(7).choice(adata.n_vars, SHIFTED_GENES, replace=False)
        counts = adata.layers["counts"].toarray().astype(np.float32)
        counts[:, genes] = np.round(counts[:, genes] * factor)
        adata.layers["counts"] = sparse.csr_matrix(counts)
    if shuffle:
        adata.layers["counts"] = adata.layers["counts"][
            :, np.random.default_rng(5).permutation(adata.n_vars)
        ]
    return finished_copy(source.root, folder, name, adata)


@pytest.fixture(scope="module")
def batches(demo_run: DemoRun, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Two samples of the same cells, one with a planted batch effect, and one unfinished."""
    root = tmp_path_factory.mktemp("cohort")
    source = SampleLayout(demo_run.outdir)
    records = [_batch(source, root, "a", 1), _batch(source, root, "b", 6)]
    unfinished = SampleLayout(root / "c")
    unfinished.root.mkdir()
    doc = orjson.loads(source.record.read_bytes())
    doc["meta"].update(sample="c", status="step_limit")
    unfinished.record.write_bytes(orjson.dumps(doc))
    return [*records, unfinished.record]


@pytest.fixture(scope="module")
def integrated(batches: list[Path], tmp_path_factory: pytest.TempPathFactory) -> dict:
    broken = tmp_path_factory.mktemp("broken") / "world_state.json"
    broken.write_text("{")  # left out under its path: a key h5ad would split into groups
    records, skipped = finished_inputs([*batches, broken])
    assert [r.sample for r in records] == ["a", "b"] and {"c", str(broken)} <= set(skipped)
    out = {}
    for method in ("none", "harmony"):
        outdir = tmp_path_factory.mktemp(method)
        out[method] = (integrate(records, outdir, Options(method=method), None, skipped), outdir)
    return out


def test_harmony_mixes_the_samples_and_keeps_the_labels(integrated: dict):
    none, harmony = integrated["none"][0]["metrics"], integrated["harmony"][0]["metrics"]
    # without correction the planted effect keeps the samples apart; harmony mixes them
    assert none["after"]["ilisi_knn"] < 0.1
    assert harmony["after"]["ilisi_knn"] > none["after"]["ilisi_knn"] + 0.5
    assert harmony["after"]["batch_correction"] > none["after"]["batch_correction"] + 0.3
    # the labels each sample found stay apart after the correction (scib's silhouette is
    # rescaled to 0..1: 0.5 is none)
    assert harmony["after"]["silhouette_label"] > 0.55
    assert harmony["after"]["bio_conservation"] >= none["after"]["bio_conservation"] - 0.05
    assert harmony["label_measured"] == SAMPLE_LABEL
    assert harmony["library"].startswith("scib-metrics ")


def test_the_object_names_its_samples_method_and_inputs(integrated: dict, batches: list[Path]):
    summary, outdir = integrated["harmony"]
    adata = ad.read_h5ad(outdir / "adata.h5ad")
    assert set(adata.obs["sample"]) == {"a", "b"}
    assert "cell_type" in adata.obs and "X_umap" in adata.obsm and "counts" in adata.layers
    record = adata.uns["integration"]
    assert record["method"] == "harmony" and record["library"] == "harmonypy"
    assert record["library_version"] == summary["library_version"] != ""
    assert set(record["inputs"]) == {"a", "b"}
    from agent.record.provenance import file_sha256

    assert record["inputs"]["a"]["world_state_sha256"] == file_sha256(batches[0])
    saved = orjson.loads((outdir / "integration.json").read_bytes())
    assert [i["sample"] for i in saved["inputs"]] == ["a", "b"]
    # the samples left out are named in the summary only, the unreadable one by its path
    assert "left_out" not in record and saved["left_out"]["c"] == "run status step_limit"
    [path] = [k for k in saved["left_out"] if k.endswith("world_state.json")]
    assert saved["left_out"][path].startswith("unreadable record")
    for plot in saved["plots"].values():
        assert (outdir / plot).stat().st_size > 1000


def test_unknown_method_is_refused_naming_the_allowed_ones(batches: list[Path], tmp_path: Path):
    out = subprocess.run(
        [sys.executable, "-m", "agent", "integrate", "--world-states", *map(str, batches),
         "--outdir", str(tmp_path), "--method", "scvi"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2
    assert "--method" in out.stderr and "'none', 'harmony'" in out.stderr
    assert not any(tmp_path.iterdir())


def test_a_world_state_path_that_names_no_file_is_refused(batches: list[Path], tmp_path: Path):
    out = subprocess.run(
        [sys.executable, "-m", "agent", "integrate", "--world-states", str(batches[0]),
         str(tmp_path / "typo.json"), "--outdir", str(tmp_path / "cohort")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2 and f"no such file: {tmp_path / 'typo.json'}" in out.stderr
    assert not (tmp_path / "cohort").exists()


def test_one_finished_sample_is_not_integrated_and_the_report_says_so(
    batches: list[Path], demo_run: DemoRun, tmp_path: Path
):
    """One finished sample and one unfinished: exit 0 and a summary that says "not integrated"
    and names both; no object (an earlier one removed); the report and the crate claim none."""
    outdir = tmp_path / "cohort"
    outdir.mkdir()
    (outdir / "adata.h5ad").write_bytes(b"an earlier integration's object")
    out = subprocess.run(
        [sys.executable, "-m", "agent", "integrate", "--world-states", str(batches[0]),
         str(batches[2]), "--outdir", str(outdir), "--method", "none"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "not integrated: 1 finished sample (needs 2)" in out.stderr
    summary = orjson.loads((outdir / "integration.json").read_bytes())
    assert summary["integrated"] is False and [i["sample"] for i in summary["inputs"]] == ["a"]
    assert summary["left_out"] == {"c": "run status step_limit"}
    assert [p.name for p in outdir.rglob("*")] == ["integration.json"]
    from agent.report.build import build_report

    build_report([demo_run.world_state], [], tmp_path / "report", cohort_dir=outdir)
    index = (tmp_path / "report" / "index.html").read_text()
    assert "The cohort was not integrated: 1 finished sample (needs 2)" in index
    assert "Finished: a." in index and "Left out: c (run status step_limit)." in index
    assert "integrated UMAP" not in index
    crate = orjson.loads((tmp_path / "report" / "ro-crate" / "ro-crate-metadata.json").read_bytes())
    action = next(e for e in crate["@graph"] if e["@id"] == "#integrate-cohort")
    assert action["result"] == [{"@id": "cohort/integration.json"}]
    assert action["actionStatus"] == {"@id": "http://schema.org/FailedActionStatus"}
    assert len(action["object"]) == 2  # the finished sample's record and final object


def test_the_report_and_crate_show_the_integration(
    integrated: dict, demo_run: DemoRun, tmp_path: Path
):
    from agent.report.build import build_report

    outdir = integrated["harmony"][1]
    build_report([demo_run.world_state], [], tmp_path, cohort_dir=outdir)
    index = (tmp_path / "index.html").read_text()
    assert 'id="cohort-object"' in index and "harmonypy" in index
    assert 'alt="integrated UMAP by sample"' in index and 'alt="integrated UMAP by label"' in index
    crate = orjson.loads((tmp_path / "ro-crate" / "ro-crate-metadata.json").read_bytes())
    action = next(e for e in crate["@graph"] if e["@id"] == "#integrate-cohort")
    assert len(action["object"]) == 4  # two samples: record and final object each
    assert {"@id": "cohort/integration.json"} in action["result"]
    # without a cohort object, no section
    build_report([demo_run.world_state], [], tmp_path / "plain")
    assert "cohort-object" not in (tmp_path / "plain" / "index.html").read_text()


def _workflow_with_finished_samples(workflow_dir: WorkflowDir, batches: list[Path]) -> None:
    """The workflow's folder with the two finished samples in place and a sheet naming them."""
    data = workflow_dir.path / "inputs.h5ad"
    data.touch()
    for record in batches[:2]:
        shutil.copytree(
            record.parent, workflow_dir.path / "results" / "samples" / record.parent.name
        )
    workflow_dir.write_sheet([{"sample": r.parent.name, "path": data.name} for r in batches[:2]])


def test_workflow_builds_the_cohort_object_only_when_on(
    workflow_dir: WorkflowDir, batches: list[Path]
):
    _workflow_with_finished_samples(workflow_dir, batches)
    off = workflow_dir.snakemake("-n", "-p")
    assert off.returncode == 0, off.stdout
    assert "integrate_cohort" not in off.stdout and "--cohort" not in off.stdout
    on = ("--config", "cohort_integration={method: none}")
    plan = workflow_dir.snakemake("-n", "-p", *on)  # the report then shows the cohort object
    assert "integrate_cohort" in plan.stdout and "--cohort results/cohort" in plan.stdout
    target = "results/cohort/integration.json"
    # the samples are finished: only the cohort job runs (options of many words before --cores)
    out = workflow_dir.snakemake("--allowed-rules", "integrate_cohort", *on, "--cores", "2", target)
    log = workflow_dir.path / "logs" / "cohort" / "integrate.log"
    assert out.returncode == 0, out.stdout[-3000:] + (log.read_text() if log.is_file() else "")
    summary = orjson.loads((workflow_dir.path / target).read_bytes())
    assert summary["method"] == "none" and len(summary["inputs"]) == 2
    adata = ad.read_h5ad(workflow_dir.path / "results" / "cohort" / "adata.h5ad", backed="r")
    assert set(adata.obs["path"]) == {"inputs.h5ad"}  # the sheet's columns
    adata.file.close()
    # a cohort of one sample: the job succeeds, says so, and leaves no object behind
    workflow_dir.write_sheet([{"sample": batches[0].parent.name, "path": "inputs.h5ad"}])
    again = ("--allowed-rules", "integrate_cohort", "--forcerun", "integrate_cohort")
    out = workflow_dir.snakemake(*again, *on, "--cores", "2", target)
    assert out.returncode == 0, out.stdout[-3000:] + (log.read_text() if log.is_file() else "")
    summary = orjson.loads((workflow_dir.path / target).read_bytes())
    assert not summary["integrated"] and "1 finished sample (needs 2)" in summary["statement"]
    assert not (workflow_dir.path / "results" / "cohort" / "adata.h5ad").exists()


def test_workflow_refuses_an_unknown_method_naming_the_key(workflow_dir: WorkflowDir):
    out = workflow_dir.snakemake("-n", "--config", "cohort_integration={method: scvi}")
    assert out.returncode != 0
    assert "'scvi' is not one of ['disabled', 'none', 'harmony']" in out.stdout, out.stdout[-2000:]
    assert "['cohort_integration']['properties']['method']" in out.stdout


def test_unsound_inputs_are_left_out_by_name_and_the_cohort_goes_on(
    demo_run: DemoRun, batches: list[Path], tmp_path: Path
):
    """What replay rejects, integration does not read: an edited record, a final object copied
    under another sample's record, a cut one, a record and a copy of it claiming one sample. Each
    is left out with its reason and the rest go on: exit 0, one line each, no traceback."""
    source = SampleLayout(demo_run.outdir)
    edited, copied, cut = (_batch(source, tmp_path, name, 1) for name in ("e", "f", "g"))
    doc = orjson.loads(edited.read_bytes())
    next(e for e in doc["entries"] if e["tool"] == "leiden")["params"]["resolution"] = 0.1
    edited.write_bytes(orjson.dumps(doc))
    shutil.copy(batches[1].parent / "adata.h5ad", copied.parent / "adata.h5ad")
    final = cut.parent / "adata.h5ad"
    final.write_bytes(final.read_bytes()[: final.stat().st_size // 2])
    twin = tmp_path / "twin" / "world_state.json"
    twin.parent.mkdir()
    shutil.copy(batches[0], twin)
    out = subprocess.run(
        [sys.executable, "-m", "agent", "integrate", "--world-states", *map(str, batches[:2]),
         str(edited), str(copied), str(cut), str(twin), "--outdir", str(tmp_path / "cohort"),
         "--method", "none"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    summary = orjson.loads((tmp_path / "cohort" / "integration.json").read_bytes())
    left = summary["left_out"]
    assert [i["sample"] for i in summary["inputs"]] == ["b"], summary
    assert left["a"] == f"{batches[0]} and {twin} both name sample a"
    assert left["e"].startswith("fails the integrity check: entry of step ")
    assert "was altered" in left["e"]
    assert f"{copied.parent / 'adata.h5ad'} is not the data step " in left["f"]
    assert f"{final} cannot be read" in left["g"]
    for sample in ("a", "e", "f", "g"):
        assert f"{sample} left out: " in out.stderr


def test_a_correction_that_changes_nothing_is_no_integration(
    demo_run: DemoRun, batches: list[Path], tmp_path: Path
):
    """Samples that share no cell state (one's counts under shuffled gene names): every Harmony
    cluster holds one sample, and harmonypy returns the embedding as it was. That is said, with
    the evidence, not called integrated; no object is left."""
    shuffled = _batch(SampleLayout(demo_run.outdir), tmp_path, "s", 1, shuffle=True)
    records, skipped = finished_inputs([batches[0], shuffled])
    summary = integrate(records, tmp_path / "cohort", Options(method="harmony"), None, skipped)
    assert summary["integrated"] is False, summary
    assert summary["statement"].startswith("not integrated: harmony left the embedding unchanged")
    assert "clusters hold one sample's cells only" in summary["statement"]
    assert not (tmp_path / "cohort" / "adata.h5ad").exists()
