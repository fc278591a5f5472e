"""A cohort derived from real cells with planted truth, for the composition and condition tests.

scanpy's pbmc68k_reduced (700 PBMCs; raw counts recovered and published labels read by
agent/data/real.py) split into six pseudo-samples, three control and three treated, each cell in
exactly one sample (so the samples differ by the sampling of real cells, as replicates do).
Planted: B cells (published 'CD19+ B') go to a treated sample SHIFT times as often as to a
control one (a composition shift, the other labels' shares shrink by closure alone), and the
monocytes ('CD14+ Monocyte') of treated samples hold PLANTED_FOLD times the counts of
N_PLANTED genes, chosen by a fixed seed among those most monocytes detect (counts plus a Poisson
draw of (fold - 1) x counts: real counts stay integers with their own noise). The labels are the
published ones, so the test judges the statistics, not the annotation.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import anndata as ad
import numpy as np
import pandas as pd
import pytest
from scipy import sparse

from agent.cohort.integrate import InputRecord
from agent.record.provenance import file_sha256
from tests.fixtures_realdata import shipped_or_skip

CONTROL, TREATED = "control", "treated"
SAMPLES = {"c1": CONTROL, "c2": CONTROL, "c3": CONTROL, "t1": TREATED, "t2": TREATED, "t3": TREATED}
SHIFTED, SHIFT = "CD19+ B", 3.0
PLANTED_TYPE, PLANTED_FOLD, N_PLANTED = "CD14+ Monocyte", 3.0, 8
UNPLANTED_TYPE = "Dendritic"  # a label tested too, where no gene was planted


@dataclass(frozen=True)
class RealCohort:
    records: list[InputRecord]  # the pseudo-samples' final objects (no world state: "")
    sheet: dict[str, dict[str, str]]  # sample -> {"condition": ...}, as samplesheet.sample_cells
    planted: list[str]  # the genes raised in treated monocytes


def split_cells(labels: pd.Series, seed: int = 40) -> np.ndarray:
    """Each cell's sample (an index into SAMPLES): treated with probability SHIFT / (1 + SHIFT)
    for a SHIFTED cell and 1/2 for the others, then one of its condition's samples."""
    rng = np.random.default_rng(seed)
    treated = rng.random(len(labels)) < np.where(labels == SHIFTED, SHIFT / (1 + SHIFT), 0.5)
    names = list(SAMPLES)
    controls = [i for i, n in enumerate(names) if SAMPLES[n] == CONTROL]
    treats = [i for i, n in enumerate(names) if SAMPLES[n] == TREATED]
    return np.where(treated, rng.choice(treats, len(labels)), rng.choice(controls, len(labels)))


@pytest.fixture(scope="session")
def real_cohort(tmp_path_factory: pytest.TempPathFactory) -> RealCohort:
    adata, labels = shipped_or_skip("pbmc68k_reduced")
    counts = adata.X.toarray()
    rng = np.random.default_rng(41)
    mono = (labels == PLANTED_TYPE).to_numpy()
    detected = np.flatnonzero((counts[mono] > 0).mean(axis=0) >= 0.5)
    planted = np.sort(rng.choice(detected, N_PLANTED, replace=False))
    sample_of = split_cells(labels)
    root = tmp_path_factory.mktemp("real_cohort")
    records = []
    for k, (name, condition) in enumerate(SAMPLES.items()):
        cells = sample_of == k
        part = counts[cells].copy()
        if condition == TREATED:
            rows = np.flatnonzero(mono[cells])
            block = part[np.ix_(rows, planted)]
            part[np.ix_(rows, planted)] = block + rng.poisson((PLANTED_FOLD - 1) * block)
        obs = pd.DataFrame({"cell_type": labels[cells].to_numpy()}, index=adata.obs_names[cells])
        one = ad.AnnData(sparse.csr_matrix(part.astype(np.float32)), obs=obs,
                         var=pd.DataFrame(index=adata.var_names))  # fmt: skip
        one.layers["counts"] = one.X.copy()
        path = root / f"{name}.h5ad"
        one.write_h5ad(path)
        records.append(InputRecord(name, "", "", str(path), file_sha256(path)))
    sheet = {name: {"condition": condition} for name, condition in SAMPLES.items()}
    return RealCohort(records, sheet, list(adata.var_names[planted]))


def rscript(script: str, folder: Path, package: str) -> None:
    """Run ``script`` with Rscript in ``folder`` (it reads and writes files there); skipped,
    naming the set-up script, where R or ``package`` is not installed."""
    found = shutil.which("Rscript")
    probe = [found, "-e", f"suppressMessages(library({package}))"] if found else None
    if probe is None or subprocess.run(probe, capture_output=True).returncode != 0:
        pytest.skip(f"R with {package} is not installed (bash tests/deseq2/install.sh)")
    (folder / "oracle.R").write_text(script)
    done = subprocess.run([found, "oracle.R"], cwd=folder, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]


def check_demo_conditions(path: Path) -> None:
    """The demo cohort's planted condition (agent/data/synthetic.py: pbmc5 and pbmc6 treated,
    pbmc1 and pbmc4 control, pbmc2 and pbmc3 without a condition) found by the workflow's
    cohort_composition and cohort_de jobs under ``path``: the composition test calls the
    shifted label and no other, the differential expression the planted genes in the labels
    that carry them and in no other label."""
    import orjson

    from agent.data.synthetic import CONDITION_GENES, CONDITION_SHIFT, CONDITION_TYPES

    cohort = path / "results" / "cohort"
    composition = orjson.loads((cohort / "composition" / "composition.json").read_bytes())
    expected = {"pbmc1": "control", "pbmc4": "control", "pbmc5": "treated", "pbmc6": "treated"}
    assert composition["design"]["samples"] == expected, composition["design"]
    assert set(composition["design"]["left_out"]) == {"pbmc2", "pbmc3"}
    called = {t["label"] for t in composition["test"] if t["fdr"] < 0.05}
    assert called == set(CONDITION_SHIFT), composition["test"]
    de = orjson.loads((cohort / "de" / "de.json").read_bytes())
    assert de["samples"] == expected and de["reference"] == "control"
    for entry in de["tested"]:
        table = pd.read_csv(cohort / "de" / entry["table"], sep="\t", index_col="gene")
        hits = table[table["padj"] < 0.05]
        planted = set(CONDITION_GENES) & set(hits.index)
        if entry["label"] in CONDITION_TYPES:
            assert planted == set(CONDITION_GENES), (entry["label"], hits.index.tolist())
            assert (hits.loc[list(planted), "log2FoldChange"] > 1).all()
            assert len(planted) / len(hits) >= 0.8, hits.index.tolist()
        else:
            assert not planted, (entry["label"], hits.index.tolist())
    assert set(CONDITION_TYPES) <= {t["label"] for t in de["tested"]}
