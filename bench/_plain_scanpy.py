"""The baseline of bench/tool_overhead.py: a recorded analysis redone as a plain scanpy script.

Each successful step of a world state is redone with the scanpy calls its tool makes and the
exact parameters it recorded, and nothing else: no argument validation, no result summaries, no
data digests, no checkpoints, no world state. The choices that came from the data are taken from
the record, as a scientist would hard-code them: the thresholds, the number of PCs and the
resolution from the recorded parameters; the QC gene patterns, the principal components Scrublet
used, the species of the marker sets and the gene-symbol column from the recorded results.

Where a step's computation is the tools' own logic rather than a scanpy call (the QC gene masks,
the doublet batches, pca's scaled copy of the variable genes, the sweep's separation, stability
and silhouette scores, the annotation's labels), it calls the tools' helpers instead of a copy
of them, so that this baseline does the same work as the tools when they change.

    python bench/_plain_scanpy.py WORLD_STATE INPUT OUTDIR

writes OUTDIR/adata.h5ad, OUTDIR/plots/ and OUTDIR/step_seconds.json (seconds per step).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anndata as ad
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import scanpy as sc
from scipy import sparse

from agent.tools.annotate import (
    _decide,
    _match_genes,
    _parse_marker_sets,
    default_marker_sets,
    evidence_table,
)
from agent.tools.cluster import (
    LEIDEN_ARGS,
    _expression,
    _leiden_labels,
    _pca_used,
    _silhouette,
    _stability,
    separating_genes,
)
from agent.tools.common import counts_matrix
from agent.tools.doublets import _batches
from agent.tools.embed import _pca_of_scaled_copy
from agent.tools.io import _round_counts, _select_counts, _use_symbols
from agent.tools.plots import GENES_PER_SET, qc_violin
from agent.tools.preprocess import SCALE_KEY, scale_settings
from agent.tools.qc import _species_patterns, gene_masks
from agent.tools.species import detect_species
from agent.world_state import WorldState

TIMINGS_FILE = "step_seconds.json"  # seconds per step, which bench/tool_overhead.py reads


class Plain:
    """What the script keeps between steps: the data, where to read and write, the seed."""

    def __init__(self, input_path: Path, outdir: Path, record_dir: Path, seed: int):
        self.input, self.outdir, self.record_dir, self.seed = input_path, outdir, record_dir, seed
        self.adata: Any = None

    def path(self, given: str | None) -> Path:
        """A file a step read: the input, or one named relative to the recorded run's folder."""
        if given is None or Path(given) == Path(self.input.name):
            return self.input
        return Path(given) if Path(given).is_absolute() else self.record_dir / given


# Each step is called as step(plain, result, **params): ``result`` is what the tool returned.


def load_data(
    s: Plain, result: dict, path: str | None = None, layer: str | None = None, **_: Any
) -> None:
    source = s.path(path)
    if source.is_dir():
        adata = sc.read_10x_mtx(source, var_names="gene_symbols", make_unique=False, cache=False)
    elif source.suffix == ".h5":
        adata = sc.read_10x_h5(source)
    else:
        adata = ad.read_h5ad(source)
    adata = _select_counts(adata, source, layer)
    _round_counts(adata)
    column = result.get("gene_symbols_from", "var_names")
    if column != "var_names":
        _use_symbols(adata, column)
    adata.var_names_make_unique()
    adata.X = sparse.csr_matrix(adata.X, dtype=np.float32)
    s.adata = adata


def _keep(fn: Callable[..., Any], s: Plain, axis: int, given: dict[str, Any]) -> np.ndarray:
    """scanpy's filter (one threshold per call) on the raw counts, the masks combined."""
    counts = sc.AnnData(counts_matrix(s.adata))
    keep = np.ones(counts.shape[axis], bool)
    for name, value in given.items():
        if value is not None:
            keep &= fn(counts, **{name: value}, inplace=False)[0]
    return keep


def filter_cells(s: Plain, result: dict, **given: Any) -> None:
    s.adata = s.adata[_keep(sc.pp.filter_cells, s, 0, given)].copy()


def filter_genes(s: Plain, result: dict, **given: Any) -> None:
    s.adata = s.adata[:, _keep(sc.pp.filter_genes, s, 1, given)].copy()


def qc_metrics(
    s: Plain,
    result: dict,
    mt_prefix: str | None = None,
    ribo_pattern: str | None = None,
    hb_pattern: str | None = None,
    **_: Any,
) -> None:
    adata = s.adata
    # the patterns used, which a record leaves as None-defaults where the species chose them
    patterns = (
        result.get("patterns")
        or _species_patterns(adata.var_names, mt_prefix, ribo_pattern, hb_pattern)["patterns"]
    )
    for name, mask in gene_masks(adata.var_names, **patterns).items():
        adata.var[name] = mask
    sc.pp.calculate_qc_metrics(
        adata, qc_vars=["mt", "ribo", "hb"], percent_top=None, log1p=True, inplace=True,
        layer="counts" if "counts" in adata.layers else None,
    )  # fmt: skip
    if "suggested_thresholds" in result:  # drawn on the QC violin
        adata.uns["qc_thresholds"] = {"suggested": dict(result["suggested_thresholds"])}


def filter_by_qc(s: Plain, result: dict, **given: Any) -> None:
    obs = s.adata.obs
    genes, counts, mt = obs["n_genes_by_counts"], obs["total_counts"], obs["pct_counts_mt"]
    keep = np.ones(s.adata.n_obs, bool)
    tests = {
        "min_genes": lambda v: genes >= v, "max_genes": lambda v: genes <= v,
        "min_counts": lambda v: counts >= v, "max_counts": lambda v: counts <= v,
        "max_pct_mt": lambda v: mt <= v,
    }  # fmt: skip
    given = {k: v for k, v in given.items() if v is not None}
    for name, value in given.items():
        keep &= tests[name](value).to_numpy()
    s.adata = s.adata[keep].copy()
    s.adata.uns.setdefault("qc_thresholds", {})["applied"] = given


def detect_doublets(
    s: Plain,
    result: dict,
    expected_doublet_rate: float,
    threshold: float | None,
    n_prin_comps: int,
) -> None:
    adata = s.adata
    batches = _batches(adata.n_obs, s.seed)
    comps = result.get("n_prin_comps", n_prin_comps)  # as Scrublet could use them
    comps = comps if isinstance(comps, list) else [comps] * len(batches)
    scores, called = np.zeros(adata.n_obs), np.zeros(adata.n_obs, bool)
    for cells, k in zip(batches, comps, strict=True):
        batch = adata if len(batches) == 1 else adata[cells].copy()
        sc.pp.scrublet(batch, expected_doublet_rate=expected_doublet_rate, threshold=threshold,
                       n_prin_comps=k, random_state=s.seed, use_approx_neighbors=False,
                       verbose=False)  # fmt: skip
        scores[cells] = batch.obs["doublet_score"].to_numpy()
        called[cells] = batch.obs["predicted_doublet"].astype(bool).to_numpy()
    adata.obs["doublet_score"], adata.obs["predicted_doublet"] = scores, called


def remove_doublets(s: Plain, result: dict) -> None:
    s.adata = s.adata[~s.adata.obs["predicted_doublet"].astype(bool).to_numpy()].copy()


def normalize(s: Plain, result: dict, target_sum: float | None) -> None:
    adata = s.adata
    total = float(np.median(np.asarray(adata.X.sum(axis=1)))) if target_sum is None else target_sum
    adata.layers["counts"] = adata.X.copy()
    sc.pp.normalize_total(adata, target_sum=total)
    sc.pp.log1p(adata)


def highly_variable_genes(
    s: Plain, result: dict, flavor: str, n_top_genes: int | None, subset: bool, **_: Any
) -> None:
    layer = "counts" if flavor == "seurat_v3" else None
    sc.pp.highly_variable_genes(s.adata, flavor=flavor, n_top_genes=n_top_genes, layer=layer)
    if subset:
        s.adata.raw = s.adata
        s.adata = s.adata[:, s.adata.var["highly_variable"].to_numpy()].copy()


def scale(s: Plain, result: dict, max_value: float | None, zero_center: bool) -> None:
    # X stays log-normalised: pca scales a copy of the genes it uses as this says
    s.adata.uns[SCALE_KEY] = {"max_value": max_value, "zero_center": zero_center}


def pca(s: Plain, result: dict, n_comps: int, use_highly_variable: bool) -> None:
    adata = s.adata
    mask = "highly_variable" if use_highly_variable and "highly_variable" in adata.var else None
    if scale_settings(adata) is not None:
        genes = adata.var[mask].to_numpy(bool) if mask else np.ones(adata.n_vars, bool)
        _pca_of_scaled_copy(adata, genes, n_comps, s.seed)
    else:
        sc.pp.pca(adata, n_comps=n_comps, mask_var=mask, svd_solver="arpack", random_state=s.seed)
    adata.uns["pca"]["params"].update(mask_var=mask, use_highly_variable=mask is not None)


def neighbors(s: Plain, result: dict, n_neighbors: int, n_pcs: int | None, metric: str) -> None:
    sc.pp.neighbors(
        s.adata, n_neighbors=n_neighbors, n_pcs=n_pcs, metric=metric, random_state=s.seed
    )


def umap(s: Plain, result: dict, min_dist: float, spread: float) -> None:
    sc.tl.umap(s.adata, min_dist=min_dist, spread=spread, random_state=s.seed)


def cluster_sweep(s: Plain, result: dict, resolutions: list[float]) -> None:
    # the sweep's scores per resolution; the resolution chosen is the leiden step's, recorded
    adata = s.adata
    adjacency, coords = adata.obsp["connectivities"], _pca_used(adata)
    expression = _expression(adata)
    for resolution in sorted(set(resolutions)):
        labels = _leiden_labels(adjacency, resolution, s.seed)
        separating_genes(expression, coords, labels)
        _stability(adjacency, labels, resolution, s.seed)
        _silhouette(coords, labels, s.seed)


def leiden(s: Plain, result: dict, resolution: float, key_added: str) -> None:
    sc.tl.leiden(s.adata, resolution=resolution, key_added=key_added, random_state=s.seed,
                 **LEIDEN_ARGS)  # fmt: skip


def rank_genes_groups(s: Plain, result: dict, groupby: str, method: str, **_: Any) -> None:
    adata = s.adata
    if adata.obs[groupby].dtype.name != "category":
        adata.obs[groupby] = adata.obs[groupby].astype(str).astype("category")
    kwargs = {"random_state": s.seed} if method == "logreg" else {}
    sc.tl.rank_genes_groups(adata, groupby, method=method, use_raw=adata.raw is not None, **kwargs)


def annotate_clusters(
    s: Plain,
    result: dict,
    groupby: str,
    key_added: str,
    min_score: float,
    min_detection: float,
    top_ranked: int,
    markers_file: str | None = None,
    **_: Any,
) -> None:
    adata = s.adata
    clusters = adata.obs[groupby].astype(str)
    names = (adata.raw.var_names if adata.raw is not None else adata.var_names).astype(str)
    species = result.get("species") or detect_species(names)["species"]
    if markers_file is None:
        sets = default_marker_sets(species)
    else:
        path = s.path(markers_file)
        sets = _parse_marker_sets(json.loads(path.read_text()), str(path))
    usable, _ = _match_genes(sets, names)
    thresholds = (min_score, min_detection, top_ranked)
    table, _ = evidence_table(adata, usable, clusters, groupby, species, s.seed, thresholds)
    labels = {
        c: _decide(evidence.set_index("cell_type"), thresholds)
        for c, evidence in table.groupby("cluster", sort=False)
    }
    mapping = {c: e["label"] for c, e in labels.items()}
    ambiguous = {c: f"{e['label']}|{e['runner_up']}" for c, e in labels.items() if e["ambiguous"]}
    adata.obs[key_added] = clusters.map(mapping).astype("category")
    adata.obs[f"{key_added}_ambiguous"] = clusters.isin(list(ambiguous)).to_numpy()
    adata.uns["annotation"] = {
        "groupby": groupby, "key_added": key_added, "species": species, "markers": usable,
        "cluster_labels": mapping, "ambiguous": ambiguous,
    }  # fmt: skip


def _dotplot(adata: Any, groupby: str) -> Any:
    if "annotation" in adata.uns:
        markers = {
            n: list(g)[:GENES_PER_SET] for n, g in adata.uns["annotation"]["markers"].items()
        }
        dot = sc.pl.dotplot(adata, markers, groupby=groupby, show=False, return_fig=True)
    else:
        dot = sc.pl.rank_genes_groups_dotplot(
            adata, n_genes=3, groupby=groupby, show=False, return_fig=True
        )
    dot.make_figure()
    return dot.fig


def plot(
    s: Plain, result: dict, kind: str, color: str | None, groupby: str, filename: str | None
) -> None:
    adata, folder = s.adata, s.outdir / "plots"
    folder.mkdir(parents=True, exist_ok=True)
    if kind == "qc_violin":
        fig = qc_violin(s.adata, s.seed)
    elif kind == "umap":
        fig = sc.pl.umap(adata, color=color or groupby, show=False, return_fig=True, frameon=False)
    elif kind == "dotplot":
        fig = _dotplot(adata, groupby)
    else:
        sc.pl.pca_variance_ratio(
            adata, n_pcs=min(50, adata.obsm["X_pca"].shape[1]), log=True, show=False
        )
        fig = plt.gcf()
    default = f"{kind}_{color or groupby}.png" if kind == "umap" else f"{kind}.png"
    fig.savefig(folder / (filename or default), dpi=100, bbox_inches="tight")
    plt.close("all")


def finish(s: Plain, result: dict, **_: Any) -> None:
    s.adata.write_h5ad(s.outdir / "adata.h5ad")


STEPS: dict[str, Callable[..., None]] = {f.__name__: f for f in (
    load_data, filter_cells, filter_genes, qc_metrics, filter_by_qc, detect_doublets,
    remove_doublets, normalize, highly_variable_genes, scale, pca, neighbors, umap, cluster_sweep,
    leiden, rank_genes_groups, annotate_clusters, plot, finish,
)}  # fmt: skip


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: python bench/_plain_scanpy.py WORLD_STATE INPUT OUTDIR", file=sys.stderr)
        return 2
    record_path, input_path, outdir = Path(argv[0]), Path(argv[1]), Path(argv[2])
    record = WorldState.load(record_path)
    outdir.mkdir(parents=True, exist_ok=True)
    s = Plain(input_path, outdir, record_path.resolve().parent, int(record.meta.get("seed", 0)))
    seconds = []
    for e in record.entries:
        if e.status != "ok":
            continue
        if e.tool not in STEPS:
            print(f"{argv[0]}: step {e.step} uses {e.tool}, which this script does not redo",
                  file=sys.stderr)  # fmt: skip
            return 2
        start = time.perf_counter()
        STEPS[e.tool](s, e.result or {}, **e.params)
        seconds.append({"step": e.step, "tool": e.tool, "seconds": time.perf_counter() - start})
    (outdir / TIMINGS_FILE).write_text(json.dumps(seconds, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
