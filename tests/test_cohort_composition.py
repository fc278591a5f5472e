"""The cohort's composition and its test of conditions: real cells with a planted shift
(tests/fixtures_cohort.py), limma itself as the oracle of the moderated statistics, and the
samples a comparison cannot use named with why."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import orjson
import pandas as pd
import pytest

from agent.cohort.composition import compose, logit_proportions
from agent.cohort.conditions import design
from agent.cohort.labels import read_cells
from agent.cohort.moderated import moderated_test
from tests.fixtures_cohort import SAMPLES, SHIFT, SHIFTED, RealCohort, rscript


@pytest.fixture(scope="module")
def composed(real_cohort: RealCohort, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    outdir = tmp_path_factory.mktemp("composition")
    return compose(real_cohort.records, outdir, real_cohort.sheet), outdir


def test_propeller_finds_the_planted_shift_in_real_cells(composed: tuple):
    summary, outdir = composed
    assert summary["method"].startswith("propeller (Phipson et al. 2022)")
    assert "moderated t" in summary["method"] and summary["design"]["reference"] == "control"
    top, *others = summary["test"]
    # the planted label, most significant, its share raised about SHIFT-fold (closure lowers it)
    assert top["label"] == SHIFTED and top["fdr"] < 0.01 and top["t"] > 0
    assert SHIFT / 2 < top["ratio_treated"] < SHIFT * 1.5
    assert all(o["p_value"] > top["p_value"] for o in others)
    table = pd.read_csv(outdir / "composition.tsv", sep="\t")
    assert set(table["sample"]) == set(SAMPLES) and set(table["condition"]) == set(SAMPLES.values())
    assert np.allclose(table.groupby("sample")["share"].sum(), 1, atol=1e-3)
    assert table["cells"].sum() == 700  # every cell of the set, each in one pseudo-sample
    assert (outdir / "composition.png").stat().st_size > 5000


LIMMA = """
suppressMessages(library(limma))
y <- t(as.matrix(read.csv("logit.csv", row.names = 1, check.names = FALSE)))
for (name in c("two", "three")) {
  group <- factor(read.csv(paste0(name, ".csv"))$condition)
  fit <- lmFit(y, model.matrix(~group))
  if (name == "two") {
    fit <- eBayes(fit, robust = FALSE)
    out <- data.frame(stat = fit$t[, 2], p = fit$p.value[, 2])
  } else {  # propeller.anova: the F of the condition's coefficients, without the intercept
    fit <- eBayes(fit[, -1], robust = FALSE)
    out <- data.frame(stat = fit$F, p = fit$F.p.value)
  }
  rownames(out) <- rownames(y)
  out$df_prior <- fit$df.prior
  out$var_prior <- fit$s2.prior
  write.csv(out, paste0(name, "_limma.csv"))
}
"""


def test_moderated_statistics_are_limmas(real_cohort: RealCohort, tmp_path: Path):
    """limma's lmFit + eBayes(robust = FALSE) on the same logit proportions: the moderated t of
    two conditions and the moderated F of three, their p-values and the fitted prior."""
    counts = read_cells(real_cohort.records).counts()
    logit = logit_proportions(counts)
    logit.to_csv(tmp_path / "logit.csv")
    groups = {"two": list(SAMPLES.values()), "three": ["a", "a", "b", "b", "c", "c"]}
    for name, conditions in groups.items():
        pd.DataFrame({"condition": conditions}).to_csv(tmp_path / f"{name}.csv", index=False)
    rscript(LIMMA, tmp_path, "limma")
    for name, conditions in groups.items():
        levels = sorted(set(conditions))  # R's factor levels: the first is the reference
        x = np.column_stack(
            [np.ones(len(conditions))] + [[c == level for c in conditions] for level in levels[1:]]
        ).astype(float)
        ours = moderated_test(logit.to_numpy(), x, list(range(1, len(levels))))
        limma = pd.read_csv(tmp_path / f"{name}_limma.csv", index_col=0).loc[logit.columns]
        assert np.allclose(ours.statistic, limma["stat"], rtol=1e-6), name
        assert np.allclose(ours.p_value, limma["p"], rtol=1e-6), name
        assert np.isclose(ours.df_prior, limma["df_prior"].iloc[0], rtol=1e-6), name
        assert np.isclose(ours.var_prior, limma["var_prior"].iloc[0], rtol=1e-6), name


def test_samples_a_comparison_cannot_use_are_named_with_why():
    sheet = {
        "a1": {"condition": "ctrl"}, "a2": {"condition": "ctrl"}, "b1": {"condition": "drug"},
        "b2": {"condition": "drug"}, "c1": {"condition": "other"}, "d1": {},
    }  # fmt: skip
    plan = design(list(sheet), sheet, "condition", min_samples=2)
    assert plan.testable and plan.levels == ["ctrl", "drug"] and plan.reference == "ctrl"
    assert plan.left_out == {
        "c1": "condition 'other' has 1 sample(s), fewer than 2",
        "d1": "no value in the sheet's column 'condition'",
    }
    drug_first = design(list(sheet), sheet, "condition", reference="drug")
    assert drug_first.levels == ["drug", "ctrl"]
    assert "'placebo' is not in column" in design(list(sheet), sheet, "condition",
                                                   reference="placebo").statement  # fmt: skip
    few = design(["a1", "b1", "b2"], sheet, "condition")
    assert not few.testable and "fewer than 2 conditions" in few.statement
    none = design(list(sheet), sheet, "treatment")
    assert none.statement == "no sample has a value in the sheet's column 'treatment'"


def test_without_conditions_the_composition_is_shown_and_says_why_untested(
    real_cohort: RealCohort, tmp_path: Path
):
    summary = compose(real_cohort.records, tmp_path, real_cohort.sheet, column=None)
    assert summary["method"] is None and summary["test"] is None
    assert summary["statement"] == "no condition column configured"
    assert (tmp_path / "composition.tsv").is_file() and (tmp_path / "composition.png").is_file()


def test_command_reads_finished_records_and_names_those_left_out(demo_run, tmp_path: Path):
    """`agent composition` on world states: the finished one is read, an unfinished one is
    named with its status, one sample cannot be tested and the summary says why."""
    unfinished = tmp_path / "late" / "world_state.json"
    unfinished.parent.mkdir()
    doc = orjson.loads(demo_run.world_state.read_bytes())
    doc["meta"].update(sample="late", status="step_limit")
    unfinished.write_bytes(orjson.dumps(doc))
    sheet = tmp_path / "samples.tsv"
    sheet.write_text(f"sample\tpath\tcondition\npbmc2\t{demo_run.input}\tcontrol\n")
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "agent", "composition", "--world-states",
         str(demo_run.world_state), str(unfinished), "--samples", str(sheet), "--outdir", str(out)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    summary = orjson.loads((out / "composition.json").read_bytes())
    assert summary["samples"] == ["pbmc2"] and summary["left_out"] == {
        "late": "run status step_limit"
    }
    assert "fewer than 2 conditions" in summary["statement"] and summary["method"] is None
    assert "late left out: run status step_limit" in done.stderr
    assert summary["inputs"][0]["adata_sha256"] and summary["labels_from"]["labels"] == (
        "each sample's final object"
    )


def test_labels_come_from_the_cohort_object_only_when_it_integrated_these_analyses(
    real_cohort: RealCohort, tmp_path: Path
):
    """A cohort object (integration.json naming the inputs by sha256, adata.h5ad with
    obs['sample'] and its own labels): its labels and counts are read when it integrated exactly
    the analyses given; when one of them differs, each sample's own, with why."""
    import anndata as ad

    from agent.cohort.integrate import OBJECT, SUMMARY, InputRecord

    parts = []
    for r in real_cohort.records:
        one = ad.read_h5ad(r.adata)
        one.obs["sample"] = r.sample
        one.obs["cell_type"] = "cohort " + one.obs["cell_type"].astype(str)  # its own names
        one.obs_names = r.sample + ":" + one.obs_names
        parts.append(one)
    ad.concat(parts).write_h5ad(tmp_path / OBJECT)
    inputs = [vars(r) for r in real_cohort.records]
    summary = {"integrated": True, "inputs": inputs, "object": OBJECT}
    (tmp_path / SUMMARY).write_bytes(orjson.dumps(summary))
    cells = read_cells(real_cohort.records, tmp_path)
    assert cells.from_cohort_object and all(cells.counts().columns.str.startswith("cohort "))
    mono = [(r.sample, "cohort CD14+ Monocyte") for r in real_cohort.records]
    own = read_cells(real_cohort.records)
    assert not own.from_cohort_object and own.source["why"] == "no cohort object given"
    own_mono = [(s, label.removeprefix("cohort ")) for s, label in mono]
    assert (cells.pseudobulk(mono).to_numpy() == own.pseudobulk(own_mono).to_numpy()).all()
    other = [InputRecord(**{**inputs[0], "adata_sha256": "0" * 64})]
    fallback = read_cells(other + real_cohort.records[1:], tmp_path)
    assert not fallback.from_cohort_object
    assert (
        "integrated other analyses than those given (first differing: c1)"
        in (fallback.source["why"])
    )
