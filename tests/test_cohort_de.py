"""Differential expression per label: pseudobulk counts of real cells with planted genes
(tests/fixtures_cohort.py), PyDESeq2 checked against DESeq2 itself, the labels too rare for a
test listed, and the report and RO-Crate that show and record it."""

from __future__ import annotations

from pathlib import Path

import anndata as ad
import numpy as np
import orjson
import pandas as pd
import pytest

from agent.cohort.composition import compose
from agent.cohort.de import deseq2, differential_expression, expressed
from tests.fixtures_cohort import PLANTED_TYPE, UNPLANTED_TYPE, RealCohort, rscript

MIN_CELLS = 10


@pytest.fixture(scope="module")
def tested(real_cohort: RealCohort, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    outdir = tmp_path_factory.mktemp("de")
    summary = differential_expression(
        real_cohort.records, outdir, real_cohort.sheet, min_cells=MIN_CELLS, threads=1
    )
    return summary, outdir


def comparison(summary: dict, label: str) -> dict:
    return next(t for t in summary["tested"] if t["label"] == label)


def significant(outdir: Path, entry: dict) -> pd.DataFrame:
    table = pd.read_csv(outdir / entry["table"], sep="\t", index_col="gene")
    return table[table["padj"] < 0.05]


def test_the_planted_genes_are_found_where_planted_and_nowhere_else(
    tested: tuple, real_cohort: RealCohort
):
    summary, outdir = tested
    planted = set(real_cohort.planted)
    mono = comparison(summary, PLANTED_TYPE)
    hits = significant(outdir, mono)
    assert len(planted & set(hits.index)) >= len(planted) - 1, (planted, hits.index.tolist())
    assert (hits.loc[list(planted & set(hits.index)), "log2FoldChange"] > 1).all()
    assert len(planted & set(hits.index)) / len(hits) >= 0.8  # few calls beyond the planted
    other = significant(outdir, comparison(summary, UNPLANTED_TYPE))
    assert not planted & set(other.index), other
    # the record of the step: design, thresholds and the samples each comparison used
    assert summary["design"] == "~condition" and summary["reference"] == "control"
    assert summary["min_cells"] == MIN_CELLS and summary["min_samples"] == 2
    assert set(mono["samples"]) == set(real_cohort.sheet)
    assert all(v["cells"] >= MIN_CELLS for v in mono["samples"].values())
    assert summary["method"].startswith("pseudobulk") and "PyDESeq2 0.5" in summary["method"]


def test_labels_too_rare_for_a_test_are_listed_with_their_cells(tested: tuple):
    summary, _ = tested
    rare = summary["not_tested"]["CD4+/CD45RA+/CD25- Naive T"]  # 8 cells in the whole set
    assert f"below {MIN_CELLS} cells:" in rare and "c1 " in rare
    tested_labels = {t["label"] for t in summary["tested"]}
    assert tested_labels.isdisjoint(summary["not_tested"])
    bulk = ad.read_h5ad(Path(tested[1]) / "pseudobulk.h5ad")
    assert set(bulk.obs["label"]) == tested_labels and (bulk.obs["cells"] >= MIN_CELLS).all()


DESEQ2 = """
suppressMessages(library(DESeq2))
counts <- as.matrix(read.csv("counts.csv", row.names = 1, check.names = FALSE))
samples <- data.frame(condition = factor(read.csv("conditions.csv")$condition,
                                         levels = c("control", "treated")),
                      row.names = rownames(counts))
dds <- DESeqDataSetFromMatrix(t(counts), samples, ~condition)
dds <- DESeq(dds, quiet = TRUE)
res <- results(dds, contrast = c("condition", "treated", "control"), alpha = 0.05)
write.csv(as.data.frame(res), "deseq2.csv")
"""


def test_pydeseq2_agrees_with_deseq2(tested: tuple, real_cohort: RealCohort, tmp_path: Path):
    """DESeq2 (R, Bioconductor) on the very pseudobulk counts of the planted label, after the
    same pre-filter: the same fold changes, p-values and genes called."""
    bulk = ad.read_h5ad(Path(tested[1]) / "pseudobulk.h5ad")
    bulk = bulk[bulk.obs["label"] == PLANTED_TYPE]
    counts = pd.DataFrame(
        np.asarray(bulk.X.todense(), dtype=np.int64), index=bulk.obs["sample"].astype(str),
        columns=bulk.var_names,
    )  # fmt: skip
    conditions = pd.Series(bulk.obs["condition"].astype(str).to_numpy(), index=counts.index)
    counts = counts.loc[:, expressed(counts, conditions)]
    counts.to_csv(tmp_path / "counts.csv")
    pd.DataFrame({"condition": conditions}).to_csv(tmp_path / "conditions.csv", index=False)
    rscript(DESEQ2, tmp_path, "DESeq2")
    r = pd.read_csv(tmp_path / "deseq2.csv", index_col=0)
    results, _ = deseq2(counts, conditions, "control", 0.05, 1)
    py = results["treated"]
    both = r.index[r["pvalue"].notna() & py["pvalue"].notna().reindex(r.index)]
    assert len(both) >= 0.95 * counts.shape[1]
    lfc_r, lfc_py = r.loc[both, "log2FoldChange"], py.loc[both, "log2FoldChange"]
    # measured 2026-12 on this set: fold changes within 2e-4, p-values' correlation 0.9999998
    assert float((lfc_r - lfc_py).abs().max()) < 0.01
    logp_r, logp_py = -np.log10(r.loc[both, "pvalue"]), -np.log10(py.loc[both, "pvalue"])
    assert np.corrcoef(logp_r, logp_py)[0, 1] > 0.999
    assert set(r.index[r["padj"] < 0.05]) == set(py.index[py["padj"] < 0.05])


def test_the_report_shows_and_the_crate_records_composition_and_de(
    tested: tuple, real_cohort: RealCohort, demo_run, tmp_path: Path
):
    from agent.report.build import build_report

    summary, de_dir = tested
    composition_dir = tmp_path / "composition"
    compose(real_cohort.records, composition_dir, real_cohort.sheet)
    out = tmp_path / "report"
    build_report([demo_run.world_state], [], out, composition_dir=composition_dir, de_dir=de_dir)
    index = (out / "index.html").read_text()
    assert 'id="composition"' in index and 'id="conditions"' in index
    assert 'href="composition.tsv"' in index and (out / "composition.tsv").is_file()
    mono = comparison(summary, PLANTED_TYPE)
    assert f'href="de/{Path(mono["table"]).name}"' in index
    assert (out / "de" / Path(mono["table"]).name).is_file()
    assert "Labels not tested (too rare for a test)" in index
    crate = orjson.loads((out / "ro-crate" / "ro-crate-metadata.json").read_bytes())
    graph = {e["@id"]: e for e in crate["@graph"]}
    action = graph["#cohort-de"]
    assert graph[action["instrument"]["@id"]]["name"] == "pydeseq2"
    settings = {graph[o["@id"]]["name"]: graph[o["@id"]]["value"] for o in action["object"]
                if graph[o["@id"]].get("@type") == "PropertyValue"}  # fmt: skip
    assert settings["design"] == "~condition" and settings["min_cells"] == str(MIN_CELLS)
    used = orjson.loads(settings["samples_used"])[f"{PLANTED_TYPE}: treated"]
    assert set(used) == set(real_cohort.sheet)
    assert "#cohort-composition" in graph
