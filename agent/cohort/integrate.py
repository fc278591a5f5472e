"""`python -m agent integrate`: the cohort object, every finished sample's final object in one
AnnData, integrated with an established library, clustered and labelled by the sample tools.

Reads each finished sample's `adata.h5ad` (raw counts in layers['counts'], its QC applied),
keeps the genes every sample kept, adds obs['sample'] and the sample sheet's columns, then:
normalize (the tool) -> highly variable genes per sample (scanpy, batch_key) -> pca (the tool)
-> the integration (`harmony`: harmonypy; `none`: the PCA as it is) -> kNN graph on the
integrated embedding -> umap, leiden, annotate_clusters or annotate_celltypist (the tools).
Writes OUTDIR/adata.h5ad (uns['integration']: method, library and version, parameters, metrics,
every input record with the sha256 of its world state and final object), OUTDIR/integration.json
(the same, for the report and the RO-Crate) and OUTDIR/plots/umap_by_{sample,label}.png.

Fewer than MIN_SAMPLES finished samples is an ordinary cohort (one sample given, or one failed),
not an error: integration.json then says "not integrated", names the samples that finished and
those left out, and no object or plots exist (an earlier integration's are removed); the command
exits 0, by hand as in the workflow, whose report then says so.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import orjson

from agent import say
from agent.layout import RECORD, SampleLayout

METHODS = ("none", "harmony")  # bbknn needs annoy, which PyPI has only as source (a compiler)
LIBRARY = {"none": "scanpy", "harmony": "harmonypy"}
SUMMARY = "integration.json"
OBJECT = "adata.h5ad"
PLOTS = {"sample": "plots/umap_by_sample.png", "label": "plots/umap_by_label.png"}
LABEL = "cell_type"  # the cohort's labels, as the sample tools name them
SAMPLE_LABEL = "sample_cell_type"  # each cell's label in its own sample's analysis
MAX_METRIC_CELLS = 5000  # silhouettes on a fixed-seed subsample: quadratic in the cells
MIN_SAMPLES = 2  # one sample has no batches to integrate


@dataclass(frozen=True)
class InputRecord:
    """One sample's finished analysis, named by content."""

    sample: str
    world_state: str
    world_state_sha256: str
    adata: str
    adata_sha256: str


@dataclass(frozen=True)
class Options:
    method: str = "harmony"
    n_top_genes: int = 2000
    n_comps: int = 30
    n_neighbors: int = 15
    resolution: float = 1.0
    seed: int = 0
    celltypist_model: str | None = None


def finished_inputs(world_states: list[Path]) -> tuple[list[InputRecord], dict[str, str]]:
    """The finished samples among ``world_states`` (their records and final objects, by sha256)
    and, for each one left out, why."""
    from agent.provenance import file_sha256

    found, skipped = [], {}
    for path in world_states:
        layout = SampleLayout(path.parent)
        try:  # `main` refused paths that name no file: an OSError is a read gone wrong
            meta = orjson.loads(path.read_bytes())["meta"]
        except (OSError, orjson.JSONDecodeError, KeyError, TypeError) as e:
            skipped[str(path)] = f"unreadable record ({type(e).__name__})"
            continue
        sample = str(meta.get("sample") or path.parent.name)
        if meta.get("status") != "finished":
            skipped[sample] = f"run status {meta.get('status')}"
        elif not layout.final.is_file():
            skipped[sample] = f"no {layout.final.name}"
        else:
            found.append(  # absolute: the report and crate that name them may run elsewhere
                InputRecord(
                    sample, str(path.resolve()), file_sha256(path), str(layout.final.resolve()),
                    file_sha256(layout.final),
                )
            )  # fmt: skip
    return found, skipped


def sheet_columns(sheet: Path | None) -> dict[str, dict[str, str]]:
    """sample -> its sheet cells (every column but 'sample'), as text."""
    if sheet is None:
        return {}
    import yaml

    from agent.samplesheet import SCHEMA, read_sheet

    spec = yaml.safe_load(SCHEMA.read_text())
    return {
        str(row["sample"]): {k: str(v) for k, v in row.items() if k != "sample"}
        for row in read_sheet(sheet, spec).rows
    }


def gather(records: list[InputRecord], columns: dict[str, dict[str, str]]) -> Any:
    """One AnnData of raw counts (X) over the genes every sample kept; obs: sample, the sheet's
    columns and the label each cell got in its own sample's analysis."""
    import anndata as ad
    import pandas as pd

    parts = []
    for record in records:
        one = ad.read_h5ad(record.adata)
        if "counts" not in one.layers:
            raise ValueError(f"{record.adata}: no layers['counts'] (the final object's raw counts)")
        obs = pd.DataFrame(index=record.sample + ":" + one.obs_names.astype(str))
        obs["sample"] = record.sample
        for key, value in columns.get(record.sample, {}).items():
            obs[key] = value
        if LABEL in one.obs:
            obs[SAMPLE_LABEL] = one.obs[LABEL].astype(str).to_numpy()
        parts.append(
            ad.AnnData(one.layers["counts"], obs=obs, var=pd.DataFrame(index=one.var_names))
        )
    cohort = ad.concat(parts, join="inner", merge=None)
    if not cohort.n_vars:
        raise ValueError(f"the {len(records)} samples' final objects share no gene (var_names)")
    for key in cohort.obs.columns:
        cohort.obs[key] = cohort.obs[key].astype("category")
    return cohort


def run_harmony(adata: Any, seed: int) -> str:
    """Harmony (harmonypy) on the PCA by sample, into obsm['X_pca_harmony']. harmonypy is called
    itself: scanpy.external's wrapper transposes its result, which harmonypy 2 already returns
    cells by components."""
    import harmonypy
    import numpy as np

    out = harmonypy.run_harmony(
        adata.obsm["X_pca"].astype(np.float64), adata.obs, "sample", random_state=seed,
        verbose=False,
    )  # fmt: skip
    corrected = np.asarray(out.Z_corr)
    if corrected.shape != adata.obsm["X_pca"].shape:
        corrected = corrected.T
    adata.obsm["X_pca_harmony"] = corrected
    return "X_pca_harmony"


def mixing_metrics(
    adata: Any, rep: str, labels: str, n_neighbors: int, seed: int
) -> dict[str, Any]:
    """Batch mixing and label conservation of one embedding (scikit-learn).

    silhouette_sample: euclidean silhouette of the samples (near 0 or below: mixed;
    lower is better); silhouette_label: that of the labels (higher: labels kept apart);
    knn_mixing: mean share of a cell's kNN from other samples over the share expected were the
    samples fully mixed (1: mixed; 0: every neighbour from the cell's own sample). All three on
    the same fixed-seed subsample of at most MAX_METRIC_CELLS cells.
    """
    import numpy as np
    from sklearn.metrics import silhouette_score
    from sklearn.neighbors import NearestNeighbors

    x = np.asarray(adata.obsm[rep])
    sample = adata.obs["sample"].astype(str).to_numpy()
    size = min(MAX_METRIC_CELLS, len(x))
    pick = np.random.default_rng(seed).choice(len(x), size, replace=False)
    out: dict[str, Any] = {"cells_measured": size}
    if len(set(sample[pick])) > 1:
        out["silhouette_sample"] = round(float(silhouette_score(x[pick], sample[pick])), 4)
    if labels in adata.obs:
        label = adata.obs[labels].astype(str).to_numpy()[pick]
        if len(set(label)) > 1:
            out["silhouette_label"] = round(float(silhouette_score(x[pick], label)), 4)
    # the subsample's neighbours among all cells (the first is the cell itself)
    k = min(n_neighbors, len(x) - 1)
    index = NearestNeighbors(n_neighbors=k + 1).fit(x)
    idx = index.kneighbors(x[pick], return_distance=False)[:, 1:]
    other = (sample[idx] != sample[pick, None]).mean(axis=1)
    share = {s: n / len(x) for s, n in zip(*np.unique(sample, return_counts=True), strict=True)}
    expected = 1 - np.vectorize(share.get)(sample[pick])
    if expected.mean() > 0:
        out["knn_mixing"] = round(float(other.mean() / expected.mean()), 4)
    return out


def not_integrated_statement(n_finished: int) -> str:
    """Why there is no cohort object, in the words the summary, the report and stderr use."""
    samples = "sample" if n_finished == 1 else "samples"
    return f"not integrated: {n_finished} finished {samples} (needs {MIN_SAMPLES})"


def write_not_integrated(
    records: list[InputRecord], outdir: Path, options: Options, left_out: dict[str, str]
) -> dict[str, Any]:
    """The summary of a cohort with too few finished samples; an earlier integration's object
    and plots go, so that nothing in OUTDIR claims an integration of this cohort."""
    from agent.durable import atomic_write_json

    for stale in (OBJECT, *PLOTS.values()):
        (outdir / stale).unlink(missing_ok=True)
    summary = {
        "integrated": False,
        "statement": not_integrated_statement(len(records)),
        "method": options.method,
        "parameters": {k: v for k, v in asdict(options).items() if v is not None},
        "inputs": [asdict(r) for r in records],
        "left_out": left_out,
    }
    atomic_write_json(outdir / SUMMARY, summary)
    return summary


def integrate(
    records: list[InputRecord], outdir: Path, options: Options,
    columns: dict[str, dict[str, str]] | None = None, left_out: dict[str, str] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Build, integrate, cluster and label the cohort object; write it, its summary and plots.
    ``left_out``: the samples not among ``records`` and why (`finished_inputs`' second part)."""
    names = [r.sample for r in records]
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"sample names appear twice among the world states: {twice}")
    if len(records) < MIN_SAMPLES:
        return write_not_integrated(records, outdir, options, left_out or {})
    import scanpy as sc

    from agent.durable import atomic_write_h5ad, atomic_write_json
    from agent.report import Progress  # a line per stage: hundreds of samples take minutes
    from agent.tools.annotate import annotate_clusters
    from agent.tools.celltypist_annotate import annotate_celltypist
    from agent.tools.cluster import leiden
    from agent.tools.embed import pca, umap
    from agent.tools.preprocess import normalize
    from agent.tools.session import Session

    session = Session(outdir, seed=options.seed, celltypist_model=options.celltypist_model)
    progress = Progress()
    session.adata = gather(records, columns or {})
    progress(f"gathered {len(records)} samples, {session.adata.n_obs} cells")
    normalize(session)
    adata = session.adata
    sc.pp.highly_variable_genes(
        adata, flavor="seurat_v3", n_top_genes=min(options.n_top_genes, adata.n_vars),
        layer="counts", batch_key="sample",
    )  # fmt: skip
    pca(session, n_comps=options.n_comps)
    progress("normalised, highly variable genes, PCA")
    rep = run_harmony(adata, options.seed) if options.method == "harmony" else "X_pca"
    progress(f"integrated ({options.method})")
    # the graph of the integrated embedding, which the neighbors tool (X_pca only) cannot take
    sc.pp.neighbors(adata, n_neighbors=options.n_neighbors, use_rep=rep, random_state=options.seed)
    session.done.add("neighbors")
    umap(session)
    leiden(session, resolution=options.resolution)
    if options.celltypist_model:
        annotate_celltypist(session)
    else:
        annotate_clusters(session)
    progress("neighbours, UMAP, Leiden, labels")
    adata = session.adata
    metrics = {
        "before": mixing_metrics(adata, "X_pca", SAMPLE_LABEL, options.n_neighbors, options.seed),
        "after": mixing_metrics(adata, rep, SAMPLE_LABEL, options.n_neighbors, options.seed),
        "label_measured": SAMPLE_LABEL,
    }
    library = LIBRARY[options.method]
    summary = {
        "integrated": True,
        "method": options.method,
        "library": library,
        "library_version": metadata.version(library),
        "embedding": rep,
        "parameters": {k: v for k, v in asdict(options).items() if v is not None},
        "n_cells": int(adata.n_obs),
        "n_genes": int(adata.n_vars),
        "n_clusters": int(adata.obs["leiden"].nunique()),
        "labels": {str(k): int(v) for k, v in adata.obs[LABEL].value_counts().items()},
        "metrics": metrics,
        "inputs": [asdict(r) for r in records],
        "left_out": left_out or {},
        "object": OBJECT,
        "plots": PLOTS,
    }
    # h5ad keeps no lists of mappings: the inputs by sample there; left_out stays in the summary
    # (an unreadable record is keyed by its path, and h5ad turns a key's slashes into groups)
    adata.uns["integration"] = {
        **{k: v for k, v in summary.items() if k not in ("inputs", "plots", "left_out")},
        "inputs": {
            r.sample: {k: v for k, v in asdict(r).items() if k != "sample"} for r in records
        },
    }
    progress("metrics")
    _plots(adata, outdir)
    atomic_write_h5ad(adata, outdir / OBJECT)
    atomic_write_json(outdir / SUMMARY, summary)
    progress("wrote the object, its summary and plots")
    return summary


def _plots(adata: Any, outdir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import scanpy as sc

    for key, column in (("sample", "sample"), ("label", LABEL)):
        path = outdir / PLOTS[key]
        path.parent.mkdir(parents=True, exist_ok=True)
        fig = sc.pl.umap(adata, color=column, show=False, return_fig=True, title=f"cohort by {key}")
        fig.savefig(path, dpi=100, bbox_inches="tight")
        matplotlib.pyplot.close(fig)


def read_summary(folder: Path) -> dict[str, Any] | None:
    """The integration's summary in ``folder`` (what the report and the crate show), or None."""
    path = folder / SUMMARY
    return orjson.loads(path.read_bytes()) if path.is_file() else None


def is_integrated(summary: dict[str, Any]) -> bool:
    """Whether ``summary`` describes a cohort object (summaries written before the flag did)."""
    return summary.get("integrated", True)


METRIC_NAMES = {
    "silhouette_sample": "silhouette by sample (lower: samples better mixed)",
    "knn_mixing": "kNN mixing (1: fully mixed, 0: none)",
    "silhouette_label": "silhouette by each sample's own labels (higher: labels kept apart)",
}


def report_view(folder: Path) -> dict[str, Any] | None:
    """What the cohort report shows of the integration in ``folder``: the method, the metrics
    before and after, and the UMAPs (base64 PNG); for a cohort not integrated, the statement and
    the samples finished and left out; None when there is no summary."""
    import base64

    summary = read_summary(folder)
    if summary is None:
        return None
    if not is_integrated(summary):
        return {
            "integrated": False,
            "statement": summary["statement"],
            "finished": [r["sample"] for r in summary["inputs"]],
            "left_out": summary["left_out"],
        }
    before, after = summary["metrics"]["before"], summary["metrics"]["after"]
    return {
        "integrated": True,
        "method": f"{summary['method']} ({summary['library']} {summary['library_version']})",
        "n_samples": len(summary["inputs"]),
        "n_cells": summary["n_cells"],
        "n_clusters": summary["n_clusters"],
        "object": str(folder / summary["object"]),
        "labels": summary["labels"],
        "metrics": [(text, before.get(k), after.get(k)) for k, text in METRIC_NAMES.items()],
        "umaps": [
            (f"integrated UMAP by {key}", base64.b64encode((folder / path).read_bytes()).decode())
            for key, path in summary["plots"].items()
            if (folder / path).is_file()
        ],
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--world-states", nargs="+", required=True, type=Path, metavar="FILE",
        help=f"the samples' {RECORD} files; those of unfinished analyses are left out",
    )  # fmt: skip
    p.add_argument("--outdir", type=Path, default=Path("results/cohort"))
    p.add_argument("--samples", type=Path, help="sample sheet whose columns go into obs")
    p.add_argument("--method", choices=METHODS, default=Options.method)
    p.add_argument("--n-top-genes", type=int, default=Options.n_top_genes)
    p.add_argument("--n-comps", type=int, default=Options.n_comps)
    p.add_argument("--n-neighbors", type=int, default=Options.n_neighbors)
    p.add_argument("--resolution", type=float, default=Options.resolution)
    p.add_argument("--seed", type=int, default=Options.seed)
    p.add_argument(
        "--celltypist-model", type=Path,
        help="CellTypist model file for the labels (default: the marker sets)",
    )  # fmt: skip


def main(args: argparse.Namespace) -> int:
    from agent.samplesheet import SampleSheetError

    bounds = (
        ("--n-top-genes", args.n_top_genes, 10), ("--n-comps", args.n_comps, 2),
        ("--n-neighbors", args.n_neighbors, 2),
    )  # fmt: skip
    for flag, value, low in bounds:
        if value < low:
            say.error(f"{flag} {value}: expected at least {low}")
            return 2
    if args.resolution <= 0:
        say.error(f"--resolution {args.resolution}: expected above 0")
        return 2
    if args.celltypist_model is not None and not args.celltypist_model.is_file():
        say.error(f"--celltypist-model {args.celltypist_model} is not a file")
        return 2
    # a path that names no file is a mistake in the command, not a sample that did not finish:
    # refused, where it would otherwise end as a quiet "not integrated"
    missing = [str(p) for p in args.world_states if not p.is_file()]
    if missing:
        say.error(f"--world-states: no such file: {', '.join(missing)}")
        return 2
    try:
        columns = sheet_columns(args.samples)
    except SampleSheetError as e:
        say.error(str(e))
        return 2
    records, skipped = finished_inputs(args.world_states)
    for sample, why in skipped.items():
        say.note(f"{sample} left out: {why}")
    options = Options(
        args.method, args.n_top_genes, args.n_comps, args.n_neighbors, args.resolution, args.seed,
        str(args.celltypist_model) if args.celltypist_model else None,
    )  # fmt: skip
    from agent.registry import ToolError

    try:
        summary = integrate(records, args.outdir, options, columns, skipped)
    except ValueError as e:
        say.error(str(e))
        return 2
    except ToolError as e:  # a sample tool refused the cohort (e.g. cells without counts)
        say.error(f"the cohort object: {e}")
        return 1
    if not summary["integrated"]:
        # exit 0: the data is not at fault and the result is written; one rule by hand and in
        # the workflow, whose report needs this summary to say why there is no cohort object
        say.note(f"{summary['statement']}; wrote {args.outdir / SUMMARY}")
        return 0
    after = summary["metrics"]["after"]
    print(
        f"integrated {len(records)} samples, {summary['n_cells']} cells ({args.method}): "
        f"silhouette by sample {summary['metrics']['before'].get('silhouette_sample')} -> "
        f"{after.get('silhouette_sample')}, kNN mixing {after.get('knn_mixing')}; "
        f"{args.outdir / OBJECT}"
    )
    return 0
