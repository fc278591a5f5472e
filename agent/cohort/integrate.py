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

Only sound inputs are read: a record that fails the integrity check (agent/record/integrity.py: chain,
seal, and the final object holding the data its finish step wrote), an unreadable one, two
records claiming one sample name, a final object without counts, are left out by name with the
reason, as unfinished samples are; none of them stops the others.

Fewer than MIN_SAMPLES such samples is an ordinary cohort (one sample given, or one failed), not
an error: integration.json then says "not integrated", names the samples that finished and
those left out, and no object or plots exist (an earlier integration's are removed); the command
exits 0, by hand as in the workflow, whose report then says so. So does a correction that left
the embedding as it was (Harmony on samples that share no cell state): its statement gives the
evidence.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import orjson

from agent import say
from agent.record.layout import RECORD, SampleLayout

METHODS = ("none", "harmony")  # bbknn needs annoy, which PyPI has only as source (a compiler)
LIBRARY = {"none": "scanpy", "harmony": "harmonypy"}
SUMMARY = "integration.json"
OBJECT = "adata.h5ad"
PLOTS = {"sample": "plots/umap_by_sample.png", "label": "plots/umap_by_label.png"}
LABEL = "cell_type"  # the cohort's labels, as the sample tools name them
SAMPLE_LABEL = "sample_cell_type"  # each cell's label in its own sample's analysis
MAX_METRIC_CELLS = 5000  # silhouettes on a fixed-seed subsample: quadratic in the cells
# scib-metrics' Benchmarker defaults (0.5): its batch correction and bio conservation metrics and
# the neighbours each kNN metric reads
BATCH_METRICS = ("bras", "ilisi_knn", "kbet_per_label", "graph_connectivity", "pcr_comparison")
BIO_METRICS = ("isolated_labels", "nmi_kmeans", "ari_kmeans", "silhouette_label", "clisi_knn")
NEIGHBORS = {"ilisi_knn": 90, "clisi_knn": 90, "kbet_per_label": 50, "graph_connectivity": 15}
MIN_SAMPLES = 2  # one sample has no batches to integrate
UNCHANGED = 1e-6  # a correction's largest change, relative to the largest coordinate, below
# which the embedding is as it was (float32 rounding of the PCA is ~1e-7)


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
    celltypist_model_sha256: str | None = None  # checked again where the model is used


def command_inputs(
    world_states: list[Path], samples: Path | None
) -> dict[str, dict[str, str]] | None:
    """What a cohort command is given, checked before any work: the sheet's columns per sample
    (empty without a sheet); None, said, where a world-state path names no file (a mistake in
    the command, not a sample that did not finish) or the sheet is refused (exit 2)."""
    from agent.samplesheet import SampleSheetError, sample_cells

    missing = [str(p) for p in world_states if not p.is_file()]
    if missing:
        say.error(f"--world-states: no such file: {', '.join(missing)}")
        return None
    try:
        return sample_cells(samples) if samples else {}
    except SampleSheetError as e:
        say.error(str(e))
        return None


def finished_inputs(world_states: list[Path]) -> tuple[list[InputRecord], dict[str, str]]:
    """The finished samples among ``world_states`` whose records pass the integrity check
    (``check_record``: chain, seal, steps, and the final object holding the finish step's data,
    so a final object copied under another sample's name is caught), their records and final
    objects by sha256; and, for each one left out, why. A sample name that two records claim
    is left out under both: neither can be told to be the sample's."""
    from agent.record.integrity import check_record
    from agent.record.provenance import file_sha256
    from agent.record.world_state import WorldState

    found, skipped, claimed = [], {}, {}
    for path in world_states:
        try:  # `main` refused paths that name no file: an OSError is a read gone wrong
            world = WorldState.load(path)
        except ValueError as e:  # the record's own message names the file and the problem
            skipped[str(path)] = f"unreadable record ({e})"
            continue
        meta = world.meta
        sample = str(meta.get("sample") or path.parent.name)
        if sample in claimed:
            skipped[sample] = f"{claimed[sample]} and {path} both name sample {sample}"
            continue
        claimed[sample] = path
        if meta.get("status") != "finished":
            skipped[sample] = f"run status {meta.get('status')}"
        elif problems := check_record(world, path.parent):
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            skipped[sample] = f"fails the integrity check: {problems[0].what}{more}"
        else:
            final = SampleLayout(path.parent).final
            found.append(  # absolute: the report and crate that name them may run elsewhere
                InputRecord(
                    sample, str(path.resolve()), file_sha256(path), str(final.resolve()),
                    file_sha256(final),
                )
            )  # fmt: skip
    return [r for r in found if r.sample not in skipped], skipped


def gather(
    records: list[InputRecord], columns: dict[str, dict[str, str]]
) -> tuple[Any, list[InputRecord], dict[str, str]]:
    """One AnnData of raw counts (X) over the genes every sample kept; obs: sample, the sheet's
    columns and the label each cell got in its own sample's analysis. Also the records it holds
    and, for each left out (no counts layer), why; None when fewer than two remain."""
    import anndata as ad
    import pandas as pd

    parts, kept, left_out = [], [], {}
    for record in records:
        one = ad.read_h5ad(record.adata)
        if "counts" not in one.layers:
            left_out[record.sample] = f"{record.adata}: no layers['counts'] (its raw counts)"
            continue
        obs = pd.DataFrame(index=record.sample + ":" + one.obs_names.astype(str))
        obs["sample"] = record.sample
        for key, value in columns.get(record.sample, {}).items():
            obs[key] = value
        if LABEL in one.obs:
            obs[SAMPLE_LABEL] = one.obs[LABEL].astype(str).to_numpy()
        parts.append(
            ad.AnnData(one.layers["counts"], obs=obs, var=pd.DataFrame(index=one.var_names))
        )
        kept.append(record)
    if len(parts) < MIN_SAMPLES:
        return None, kept, left_out
    cohort = ad.concat(parts, join="inner", merge=None)
    if not cohort.n_vars:
        raise ValueError(f"the {len(kept)} samples' final objects share no gene (var_names)")
    for key in cohort.obs.columns:
        cohort.obs[key] = cohort.obs[key].astype("category")
    return cohort, kept, left_out


def run_harmony(adata: Any, seed: int) -> dict[str, Any]:
    """Harmony (harmonypy) on the PCA by sample, into obsm['X_pca_harmony']. harmonypy is called
    itself: scanpy.external's wrapper transposes its result, which harmonypy 2 already returns
    cells by components. Returns what it did: the largest change of a coordinate, relative to
    the largest coordinate (0: the embedding is as it was), and how many of its clusters hold
    the cells of one sample only (there Harmony has nothing to align: the sample is the
    cluster)."""
    import harmonypy
    import numpy as np

    before = adata.obsm["X_pca"].astype(np.float64)
    out = harmonypy.run_harmony(before, adata.obs, "sample", random_state=seed, verbose=False)
    corrected = np.asarray(out.Z_corr)
    if corrected.shape != before.shape:
        corrected = corrected.T
    adata.obsm["X_pca_harmony"] = corrected
    samples = adata.obs["sample"].astype(str).to_numpy()
    cluster = np.asarray(out.R).argmax(axis=1 if len(out.R) == len(samples) else 0)
    single = sum(len(set(samples[cluster == c])) == 1 for c in np.unique(cluster))
    return {
        "relative_change": float(np.abs(corrected - before).max() / np.abs(before).max()),
        "clusters": len(np.unique(cluster)),
        "single_sample_clusters": int(single),
    }


def unchanged_statement(method: str, evidence: dict[str, Any]) -> str:
    """Why a correction that left the embedding as it was is no integration."""
    return (
        f"not integrated: {method} left the embedding unchanged (largest change "
        f"{evidence['relative_change']:.1e} of the largest coordinate; "
        f"{evidence['single_sample_clusters']} of its {evidence['clusters']} clusters hold one "
        "sample's cells only: the samples share no cell state it could align); "
        "method none puts them side by side"
    )


def scib_scores(adata: Any, rep: str, unintegrated: str, labels: str, seed: int) -> dict[str, Any]:
    """Batch correction and bio conservation of one embedding by scib-metrics, the metrics and
    defaults of its Benchmarker (Luecken et al. 2022): BATCH_METRICS and BIO_METRICS on
    ``adata.obsm[rep]`` against obs['sample'] and obs[``labels``], pcr_comparison against
    ``obsm[unintegrated]``; each group's mean and the total 0.4 x batch + 0.6 x bio, as the
    benchmarks aggregate them (no min-max scaling across embeddings: one cohort's scores stay
    comparable between runs). On a fixed-seed subsample of at most MAX_METRIC_CELLS cells
    (silhouettes are quadratic in the cells), exact kNN (scikit-learn, the cell itself first)
    of up to 90 neighbours. A metric the data cannot support (fewer than 2 labels, or the
    library refusing a degenerate case) is named in ``not_measured`` with why."""
    import warnings

    import numpy as np
    import scib_metrics
    from scib_metrics.nearest_neighbors import NeighborsResults
    from sklearn.neighbors import NearestNeighbors

    x = np.asarray(adata.obsm[rep], dtype=np.float32)
    size = min(MAX_METRIC_CELLS, len(x))
    pick = np.sort(np.random.default_rng(seed).choice(len(x), size, replace=False))
    x, pre = x[pick], np.asarray(adata.obsm[unintegrated], dtype=np.float32)[pick]
    batch = adata.obs["sample"].astype(str).to_numpy()[pick]
    label = adata.obs[labels].astype(str).to_numpy()[pick] if labels in adata.obs else None
    k = min(max(NEIGHBORS.values()), size)
    distances, indices = NearestNeighbors(n_neighbors=k).fit(x).kneighbors(x)
    knn = NeighborsResults(indices=indices, distances=distances)

    def near(n: int) -> NeighborsResults:
        return knn.subset_neighbors(n=min(n, k))

    calls = {
        "bras": lambda: scib_metrics.bras(x, label, batch),
        "ilisi_knn": lambda: scib_metrics.ilisi_knn(near(NEIGHBORS["ilisi_knn"]), batch),
        "kbet_per_label": lambda: scib_metrics.kbet_per_label(
            near(NEIGHBORS["kbet_per_label"]), batch, label
        ),
        "graph_connectivity": lambda: scib_metrics.graph_connectivity(
            near(NEIGHBORS["graph_connectivity"]), label
        ),
        "pcr_comparison": lambda: scib_metrics.pcr_comparison(pre, x, batch, categorical=True),
        "isolated_labels": lambda: scib_metrics.isolated_labels(x, label, batch),
        "kmeans": lambda: scib_metrics.nmi_ari_cluster_labels_kmeans(x, label),
        "silhouette_label": lambda: scib_metrics.silhouette_label(x, label),
        "clisi_knn": lambda: scib_metrics.clisi_knn(near(NEIGHBORS["clisi_knn"]), label),
    }
    needs_labels = {"bras", "kbet_per_label", "graph_connectivity", "isolated_labels", "kmeans",
                    "silhouette_label", "clisi_knn"}  # fmt: skip
    out: dict[str, Any] = {"cells_measured": size}
    missing: dict[str, str] = {}
    for name, call in calls.items():
        if name in needs_labels and (label is None or len(set(label)) < 2):
            missing[name] = f"fewer than 2 labels in obs['{labels}']"
        else:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # the library's notes on skipped labels
                    value = call()
            except (ValueError, ZeroDivisionError, np.linalg.LinAlgError) as e:
                missing[name] = f"{type(e).__name__}: {e}"
                continue
            values = value if isinstance(value, dict) else {name: value}
            for key, v in values.items():
                key = f"{key}_kmeans" if name == "kmeans" else key
                if np.isfinite(v):
                    out[key] = round(float(v), 4)
                else:
                    missing[key] = "not a number (too few cells per label and sample)"
    for group, names in (("batch_correction", BATCH_METRICS), ("bio_conservation", BIO_METRICS)):
        present = [out[n] for n in names if n in out]
        if present:
            out[group] = round(float(np.mean(present)), 4)
    if "batch_correction" in out and "bio_conservation" in out:
        out["total"] = round(0.4 * out["batch_correction"] + 0.6 * out["bio_conservation"], 4)
    if missing:
        out["not_measured"] = missing
    return out


def not_integrated_statement(n_finished: int) -> str:
    """Why there is no cohort object, in the words the summary, the report and stderr use."""
    samples = "sample" if n_finished == 1 else "samples"
    return f"not integrated: {n_finished} finished {samples} (needs {MIN_SAMPLES})"


def write_not_integrated(
    records: list[InputRecord], outdir: Path, options: Options, left_out: dict[str, str],
    statement: str | None = None,
) -> dict[str, Any]:  # fmt: skip
    """The summary of a cohort not integrated (by default: too few finished samples); an
    earlier integration's object and plots go, so that nothing in OUTDIR claims an integration
    of this cohort."""
    from agent.record.durable import atomic_write_json

    for stale in (OBJECT, *PLOTS.values()):
        (outdir / stale).unlink(missing_ok=True)
    summary = {
        "integrated": False,
        "statement": statement or not_integrated_statement(len(records)),
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
    left_out = dict(left_out or {})
    if len(records) < MIN_SAMPLES:
        return write_not_integrated(records, outdir, options, left_out)
    import scanpy as sc

    from agent.record.durable import atomic_write_h5ad, atomic_write_json
    from agent.say import Progress  # a line per stage: hundreds of samples take minutes
    from agent.tools.annotate import annotate_clusters
    from agent.tools.celltypist_annotate import annotate_celltypist
    from agent.tools.cluster import leiden
    from agent.tools.embed import pca, umap
    from agent.tools.preprocess import normalize
    from agent.tools.session import Session

    progress = Progress()
    cohort, records, unreadable = gather(records, columns or {})
    left_out.update(unreadable)
    if cohort is None:
        return write_not_integrated(records, outdir, options, left_out)
    session = Session(
        outdir, seed=options.seed, celltypist_model=options.celltypist_model,
        celltypist_model_sha256=options.celltypist_model_sha256,
    )  # fmt: skip
    session.adata = cohort
    progress(f"gathered {len(records)} samples, {session.adata.n_obs} cells")
    normalize(session)
    adata = session.adata
    sc.pp.highly_variable_genes(
        adata, flavor="seurat_v3", n_top_genes=min(options.n_top_genes, adata.n_vars),
        layer="counts", batch_key="sample",
    )  # fmt: skip
    pca(session, n_comps=options.n_comps)
    progress("normalised, highly variable genes, PCA")
    rep, correction = "X_pca", None
    if options.method == "harmony":
        rep, correction = "X_pca_harmony", run_harmony(adata, options.seed)
        if correction["relative_change"] < UNCHANGED:
            statement = unchanged_statement(options.method, correction)
            return write_not_integrated(records, outdir, options, left_out, statement)
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
        "before": scib_scores(adata, "X_pca", "X_pca", SAMPLE_LABEL, options.seed),
        "after": scib_scores(adata, rep, "X_pca", SAMPLE_LABEL, options.seed),
        "label_measured": SAMPLE_LABEL,
        "library": f"scib-metrics {metadata.version('scib-metrics')}",
    }
    library = LIBRARY[options.method]
    summary = {
        "integrated": True,
        "method": options.method,
        "library": library,
        "library_version": metadata.version(library),
        "embedding": rep,
        "correction": correction,  # what the method changed (None: method none changes nothing)
        "parameters": {k: v for k, v in asdict(options).items() if v is not None},
        "n_cells": int(adata.n_obs),
        "n_genes": int(adata.n_vars),
        "n_clusters": int(adata.obs["leiden"].nunique()),
        "labels": {str(k): int(v) for k, v in adata.obs[LABEL].value_counts().items()},
        "metrics": metrics,
        "inputs": [asdict(r) for r in records],
        "left_out": left_out,
        "object": OBJECT,
        "plots": PLOTS,
    }
    # h5ad keeps no lists of mappings: the inputs by sample there; left_out stays in the summary
    # (an unreadable record is keyed by its path, and h5ad turns a key's slashes into groups)
    adata.uns["integration"] = {
        **{
            k: v
            for k, v in summary.items()
            if k not in ("inputs", "plots", "left_out") and v is not None
        },
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


METRIC_NAMES = {  # scib-metrics' names; each higher is better, 0 to 1 (pcr_comparison may be < 0)
    "batch_correction": "batch correction (mean of the five below)",
    "bras": "BRAS: batch removal adapted silhouette",
    "ilisi_knn": "iLISI: samples mixed among each cell's neighbours",
    "kbet_per_label": "kBET per label: neighbourhoods with the samples' proportions",
    "graph_connectivity": "graph connectivity: each label's cells one connected graph",
    "pcr_comparison": "PCR comparison: sample variance removed from the principal components",
    "bio_conservation": "bio conservation (mean of the five below)",
    "isolated_labels": "isolated labels: labels of few samples kept apart",
    "nmi_kmeans": "NMI of k-means clusters and the labels",
    "ari_kmeans": "ARI of k-means clusters and the labels",
    "silhouette_label": "silhouette of the labels",
    "clisi_knn": "cLISI: one label among each cell's neighbours",
    "total": "total: 0.4 x batch correction + 0.6 x bio conservation",
}


def _metrics_note(metrics: dict[str, Any]) -> str | None:
    """Where the metrics come from, on how many cells, and those not measured with why."""
    if "library" not in metrics:  # a summary written before scib-metrics
        return None
    after = metrics["after"]
    missing = "; ".join(f"{k}: {v}" for k, v in after.get("not_measured", {}).items())
    return (
        f"{metrics['library']} (the integration benchmarks' metrics; higher is better), on "
        f"{after['cells_measured']} cells, labels: obs['{metrics['label_measured']}']"
        + (f"; not measured: {missing}" if missing else "")
    )


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
        "metrics_note": _metrics_note(summary["metrics"]),
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
        help="CellTypist model file for the labels (default: the marker sets); a pickle, which "
        "can run code when loaded: give only a model you trust (read through an allow-list of a "
        "model's classes, its sha256 checked at use)",
    )  # fmt: skip


def main(args: argparse.Namespace) -> int:
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
    model_sha256 = None
    if args.celltypist_model is not None:
        from agent.celltypist_model import ModelRefused, read_model

        if not args.celltypist_model.is_file():
            say.error(f"--celltypist-model {args.celltypist_model} is not a file")
            return 2
        try:
            model_sha256 = read_model(args.celltypist_model)[1]
        except ModelRefused as e:
            say.error(f"--celltypist-model {e}")
            return 2
        except OSError as e:
            say.error(f"--celltypist-model {args.celltypist_model}: {e}")
            return 1
    # a missing world state would otherwise end as a quiet "not integrated"
    columns = command_inputs(args.world_states, args.samples)
    if columns is None:
        return 2
    options = Options(
        args.method, args.n_top_genes, args.n_comps, args.n_neighbors, args.resolution, args.seed,
        str(args.celltypist_model) if args.celltypist_model else None, model_sha256,
    )  # fmt: skip
    from agent.registry import ToolError

    try:
        records, skipped = finished_inputs(args.world_states)
        for sample, why in skipped.items():
            say.note(f"{sample} left out: {why}")
        summary = integrate(records, args.outdir, options, columns, skipped)
    except ValueError as e:
        say.error(str(e))
        return 2
    except ToolError as e:  # a sample tool refused the cohort (e.g. cells without counts)
        say.error(f"the cohort object: {e}")
        return 1
    except OSError as e:  # a fault of the machine (I/O error, full disk): a rerun may pass
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
        f"scib-metrics batch correction {summary['metrics']['before'].get('batch_correction')}"
        f" -> {after.get('batch_correction')}, bio conservation "
        f"{summary['metrics']['before'].get('bio_conservation')} -> "
        f"{after.get('bio_conservation')}; "
        f"{args.outdir / OBJECT}"
    )
    return 0
