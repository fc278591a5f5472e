"""The baseline of bench/tool_overhead.py: a recorded analysis redone as a plain scanpy script.

Each successful step of a world state is redone with the scanpy calls its tool makes and the
exact parameters it recorded, and nothing else: no argument validation, no result summaries, no
data digests, no checkpoints, no world state. The choices that came from the data (thresholds,
number of PCs, resolution) are taken from the record, as a scientist would hard-code them.

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
from sklearn.metrics import silhouette_score

from agent.tools.annotate import default_marker_sets
from agent.world_state import WorldState

TIMINGS_FILE = "step_seconds.json"  # seconds per step, which bench/tool_overhead.py reads
SILHOUETTE_SAMPLE = 4000  # as cluster_sweep: a fixed-seed sample bounds the quadratic cost
EXACT_KNN_MAX_CELLS = 20000  # as detect_doublets


class Plain:
    """What the script keeps between steps: the data, where to write, the seed."""

    def __init__(self, input_path: Path, outdir: Path, seed: int):
        self.input, self.outdir, self.seed = input_path, outdir, seed
        self.adata: Any = None


def load_data(s: Plain, **_: Any) -> None:
    if s.input.is_dir():
        adata = sc.read_10x_mtx(s.input, var_names="gene_symbols", make_unique=True, cache=False)
    elif s.input.suffix == ".h5":
        adata = sc.read_10x_h5(s.input)
    else:
        adata = ad.read_h5ad(s.input)
    adata.var_names_make_unique()
    adata.X = sparse.csr_matrix(adata.X, dtype=np.float32)
    s.adata = adata


def _filter(fn: Callable[..., Any], s: Plain, given: dict[str, Any]) -> None:
    for name, value in given.items():  # scanpy's filters take one threshold per call
        if value is not None:
            fn(s.adata, **{name: value})


def filter_cells(s: Plain, **given: Any) -> None:
    _filter(sc.pp.filter_cells, s, given)


def filter_genes(s: Plain, **given: Any) -> None:
    _filter(sc.pp.filter_genes, s, given)


def qc_metrics(
    s: Plain, mt_prefix: str, ribo_prefixes: list[str], hb_pattern: str, **_: Any
) -> None:
    names = s.adata.var_names
    s.adata.var["mt"] = names.str.startswith(mt_prefix)
    s.adata.var["ribo"] = names.str.startswith(tuple(ribo_prefixes))
    s.adata.var["hb"] = names.str.contains(hb_pattern, regex=True)
    sc.pp.calculate_qc_metrics(
        s.adata, qc_vars=["mt", "ribo", "hb"], percent_top=None, log1p=True, inplace=True
    )


def filter_by_qc(s: Plain, **given: Any) -> None:
    obs = s.adata.obs
    genes, counts, mt = obs["n_genes_by_counts"], obs["total_counts"], obs["pct_counts_mt"]
    keep = np.ones(s.adata.n_obs, bool)
    tests = {
        "min_genes": lambda v: genes >= v, "max_genes": lambda v: genes <= v,
        "min_counts": lambda v: counts >= v, "max_counts": lambda v: counts <= v,
        "max_pct_mt": lambda v: mt <= v,
    }  # fmt: skip
    for name, value in given.items():
        if value is not None:
            keep &= tests[name](value).to_numpy()
    s.adata = s.adata[keep].copy()


def detect_doublets(
    s: Plain, expected_doublet_rate: float, threshold: float | None, n_prin_comps: int
) -> None:
    sc.pp.scrublet(
        s.adata,
        expected_doublet_rate=expected_doublet_rate,
        threshold=threshold,
        n_prin_comps=n_prin_comps,
        random_state=s.seed,
        use_approx_neighbors=s.adata.n_obs > EXACT_KNN_MAX_CELLS,
        verbose=False,
    )


def remove_doublets(s: Plain) -> None:
    s.adata = s.adata[~s.adata.obs["predicted_doublet"].astype(bool).to_numpy()].copy()


def normalize(s: Plain, target_sum: float | None) -> None:
    adata = s.adata
    adata.layers["counts"] = adata.X.copy()
    total = float(np.median(np.asarray(adata.X.sum(axis=1)))) if target_sum is None else target_sum
    sc.pp.normalize_total(adata, target_sum=total)
    sc.pp.log1p(adata)
    adata.raw = adata


def highly_variable_genes(
    s: Plain, flavor: str, n_top_genes: int | None, subset: bool, **_: Any
) -> None:
    layer = "counts" if flavor == "seurat_v3" else None
    sc.pp.highly_variable_genes(s.adata, flavor=flavor, n_top_genes=n_top_genes, layer=layer)
    if subset:
        s.adata = s.adata[:, s.adata.var["highly_variable"].to_numpy()].copy()


def scale(s: Plain, max_value: float | None, zero_center: bool) -> None:
    if zero_center and sparse.issparse(s.adata.X):
        s.adata.X = s.adata.X.toarray()
    sc.pp.scale(s.adata, max_value=max_value, zero_center=zero_center)


def pca(s: Plain, n_comps: int, use_highly_variable: bool) -> None:
    mask = "highly_variable" if use_highly_variable and "highly_variable" in s.adata.var else None
    sc.pp.pca(s.adata, n_comps=n_comps, mask_var=mask, svd_solver="arpack", random_state=s.seed)


def neighbors(s: Plain, n_neighbors: int, n_pcs: int | None, metric: str) -> None:
    sc.pp.neighbors(
        s.adata, n_neighbors=n_neighbors, n_pcs=n_pcs, metric=metric, random_state=s.seed
    )


def umap(s: Plain, min_dist: float, spread: float) -> None:
    sc.tl.umap(s.adata, min_dist=min_dist, spread=spread, random_state=s.seed)


def _leiden(s: Plain, resolution: float, key: str) -> None:
    sc.tl.leiden(s.adata, resolution=resolution, key_added=key, flavor="igraph", n_iterations=2,
                 directed=False, random_state=s.seed)  # fmt: skip


def cluster_sweep(s: Plain, resolutions: list[float]) -> None:
    n_pcs = s.adata.uns["neighbors"]["params"].get("n_pcs")
    coords = s.adata.obsm["X_pca"][:, :n_pcs]
    for resolution in sorted(set(resolutions)):
        _leiden(s, resolution, "sweep")
        labels = s.adata.obs["sweep"].to_numpy()
        if len(np.unique(labels)) > 1:
            size = min(len(labels), SILHOUETTE_SAMPLE)
            silhouette_score(coords, labels, sample_size=size, random_state=s.seed)
    del s.adata.obs["sweep"]


def leiden(s: Plain, resolution: float, key_added: str) -> None:
    _leiden(s, resolution, key_added)


def rank_genes_groups(s: Plain, groupby: str, method: str, **_: Any) -> None:
    sc.tl.rank_genes_groups(s.adata, groupby, method=method, use_raw=s.adata.raw is not None)


def annotate_clusters(s: Plain, groupby: str, key_added: str, min_score: float, **_: Any) -> None:
    adata = s.adata
    clusters = adata.obs[groupby].astype(str).to_numpy()
    universe = set(adata.raw.var_names)
    means = {}
    for name, genes in default_marker_sets().items():
        present = [g for g in genes if g in universe]
        if len(present) >= 2:
            sc.tl.score_genes(adata, present, score_name="score", use_raw=True, random_state=s.seed)
            means[name] = adata.obs.pop("score").groupby(clusters).mean()
    table = np.vstack([m.to_numpy() for m in means.values()])  # types x clusters
    names = np.array(list(means))
    best = np.where(table.max(axis=0) > min_score, names[table.argmax(axis=0)], "Unknown")
    mapping = dict(zip(next(iter(means.values())).index, best, strict=True))
    adata.obs[key_added] = adata.obs[groupby].astype(str).map(mapping).astype("category")
    adata.uns["markers"] = {
        n: [g for g in default_marker_sets()[n] if g in universe] for n in means
    }


def plot(s: Plain, kind: str, color: str | None, groupby: str, filename: str | None) -> None:
    adata, folder = s.adata, s.outdir / "plots"
    folder.mkdir(parents=True, exist_ok=True)
    if kind == "qc_violin":
        sc.pl.violin(adata, ["n_genes_by_counts", "total_counts", "pct_counts_mt"], jitter=0.4,
                     multi_panel=True, show=False)  # fmt: skip
        fig = plt.gcf()
    elif kind == "umap":
        fig = sc.pl.umap(adata, color=color or groupby, show=False, return_fig=True, frameon=False)
    elif kind == "dotplot":
        markers = {n: genes[:4] for n, genes in adata.uns["markers"].items()}
        dot = sc.pl.dotplot(adata, markers, groupby=groupby, show=False, return_fig=True)
        dot.make_figure()
        fig = dot.fig
    else:
        sc.pl.pca_variance_ratio(adata, log=True, show=False)
        fig = plt.gcf()
    default = f"{kind}_{color or groupby}.png" if kind == "umap" else f"{kind}.png"
    fig.savefig(folder / (filename or default), dpi=100, bbox_inches="tight")
    plt.close("all")


def finish(s: Plain, **_: Any) -> None:
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
    record, input_path, outdir = WorldState.load(argv[0]), Path(argv[1]), Path(argv[2])
    outdir.mkdir(parents=True, exist_ok=True)
    s = Plain(input_path, outdir, int(record.meta.get("seed", 0)))
    seconds = []
    for e in record.entries:
        if e.status != "ok":
            continue
        if e.tool not in STEPS:
            print(f"{argv[0]}: step {e.step} uses {e.tool}, which this script does not redo",
                  file=sys.stderr)  # fmt: skip
            return 2
        start = time.perf_counter()
        STEPS[e.tool](s, **e.params)
        seconds.append({"step": e.step, "tool": e.tool, "seconds": time.perf_counter() - start})
    (outdir / TIMINGS_FILE).write_text(json.dumps(seconds, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
