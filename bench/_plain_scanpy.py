"""The baseline of bench/tool_overhead.py: a recorded analysis redone as a plain scanpy script.

Each successful step of a world state is redone with the scanpy calls its tool makes and the
exact parameters it recorded, and nothing else: no argument validation, no result summaries, no
data digests, no checkpoints, no world state. The choices that came from the data are taken from
the record, as a scientist would hard-code them: the thresholds, the number of PCs and the
resolution from the recorded parameters; whether the input needed cells called and EmptyDrops'
bounds, the QC gene patterns, the QC thresholds as applied, the principal components Scrublet
used, the ambient method, the species of the marker sets and the gene-symbol column from the
recorded results.

Where a step's computation is the tools' own logic rather than a scanpy call (EmptyDrops, the
QC gene masks, the doublet batches and threshold, pca's scaled copy of the variable genes, the
sweep's scores, SoupX and DecontX, the marker sets, lineage gates and labels, the figures), it
calls the tools' helpers instead of a copy of them, so that this baseline does the same work as
the tools when they change.

    python -m bench._plain_scanpy WORLD_STATE INPUT OUTDIR

writes OUTDIR/adata.h5ad, OUTDIR/plots/ and OUTDIR/step_seconds.json (seconds per step).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import scanpy as sc
from scipy import sparse

from agent.record.world_state import WorldState
from agent.tools import decontx, soupx
from agent.tools.ambient import LAYER, SOUP_COLUMN, _raw_soup
from agent.tools.annotate import UNKNOWN, _label, evidence_table, gate
from agent.tools.cells import _curve
from agent.tools.cluster import LEIDEN_ARGS, _expression, _pca_used, _score
from agent.tools.common import all_genes, counts_matrix
from agent.tools.doublets import _automatic_threshold, _batches, _bounded, expected_rate, flagged
from agent.tools.embed import _pca_of_scaled_copy
from agent.tools.emptydrops import empty_drops
from agent.tools.filters import QC_COLUMNS
from agent.tools.io import (
    _merge_duplicate_genes,
    _round_counts,
    _select_counts,
    _use_symbols,
    read_matrix,
)
from agent.tools.marker_sets import default_markers, match, parse_markers
from agent.tools.markers import rank_singlets
from agent.tools.plots import _figure
from agent.tools.preprocess import SCALE_KEY, scale_settings
from agent.tools.qc import _species_patterns, gene_masks

TIMINGS_FILE = "step_seconds.json"  # seconds per step, which bench/tool_overhead.py reads


class Plain:
    """What the script keeps between steps: the data, where to read and write, the seed, the
    run's unfiltered matrix (--raw-input, SoupX's soup where call_cells kept none)."""

    def __init__(
        self, input_path: Path, outdir: Path, record_dir: Path, seed: int, raw_input: str | None
    ):
        self.input, self.outdir, self.record_dir, self.seed = input_path, outdir, record_dir, seed
        self.raw_input = raw_input
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
    adata, _ = read_matrix(source)
    adata = _select_counts(adata, source, layer)
    adata.uns.pop("log1p", None)  # X holds counts now: as the tool, no mark or .raw of others
    adata.raw = None
    _round_counts(adata)
    column = result.get("gene_symbols_from", "var_names")
    if column != "var_names":
        _use_symbols(adata, column)
    if adata.var_names.duplicated().any():
        adata = _merge_duplicate_genes(adata)
    adata.X = sparse.csr_matrix(adata.X, dtype=np.float32)
    s.adata = adata


def call_cells(
    s: Plain, result: dict, fdr: float, iterations: int, max_iterations: int, **_: Any
) -> None:
    if result["decision"] != "unfiltered":  # called cells already: nothing removed
        return
    matrix = sparse.csr_matrix(s.adata.X)
    counts = sparse.csr_matrix(
        (np.rint(matrix.data).astype(np.int64), matrix.indices, matrix.indptr), shape=matrix.shape
    )
    counts.eliminate_zeros()
    totals = np.asarray(counts.sum(axis=1)).ravel().astype(np.int64)
    rng = np.random.default_rng(s.seed)
    called = empty_drops(counts, totals, result["lower"], result["retain"], fdr, iterations,
                         max_iterations, rng)  # fmt: skip
    cells = called.called(fdr)
    kept = s.adata[cells].copy()
    kept.obs["empty_drops_fdr"] = called.fdr[cells]
    kept.var[SOUP_COLUMN] = soupx.soup_counts(matrix, totals)
    kept.uns["cell_calling"] = {**result, "curve": _curve(totals, cells)}  # the barcode-rank plot
    s.adata = kept


def _masks(fn: Callable[..., Any], s: Plain, given: dict[str, Any]) -> dict[str, np.ndarray]:
    """scanpy's filter (one threshold per call) on the raw counts: what each keeps."""
    counts = sc.AnnData(counts_matrix(s.adata))
    return {
        name: fn(counts, **{name: value}, inplace=False)[0]
        for name, value in given.items()
        if value is not None
    }


def filter_cells(s: Plain, result: dict, override_reason: str | None = None, **given: Any) -> None:
    keep = np.logical_and.reduce(list(_masks(sc.pp.filter_cells, s, given).values()))
    s.adata = s.adata[keep].copy()


def filter_genes(s: Plain, result: dict, override_reason: str | None = None, **given: Any) -> None:
    masks = _masks(sc.pp.filter_genes, s, given)
    keep = np.logical_and.reduce(list(masks.values()))
    # genes removed as detected too little were measured: annotate_clusters' gates read them
    detected = [mask for name, mask in masks.items() if name != "max_cells"]
    undetected = list(s.adata.var_names[~np.logical_and.reduce(detected)]) if detected else []
    s.adata = s.adata[:, keep].copy()
    stored = s.adata.uns.setdefault("filter_genes", {})
    stored["undetected_genes"] = [*stored.get("undetected_genes", []), *undetected]


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
    # drawn on the QC plots; None: a max_pct_mt that could not act (no MT genes)
    suggested = result.get("suggested_thresholds") or {}
    adata.uns["qc_thresholds"] = {
        "suggested": {k: v for k, v in suggested.items() if v is not None},
        **({"not_applied": result["not_applied"]} if result.get("not_applied") else {}),
    }


def filter_by_qc(s: Plain, result: dict, **_: Any) -> None:
    applied = result["thresholds"]  # as applied: no max_pct_mt where it could not act
    obs = s.adata.obs
    keep = np.ones(s.adata.n_obs, bool)
    for name, value in applied.items():
        column = obs[QC_COLUMNS[name]].to_numpy()
        keep &= column >= value if name.startswith("min_") else column <= value
    s.adata = s.adata[keep].copy()
    s.adata.uns.setdefault("qc_thresholds", {})["applied"] = dict(applied)


def detect_doublets(
    s: Plain,
    result: dict,
    expected_doublet_rate: float | None,
    threshold: float | None,
    n_prin_comps: int,
) -> None:
    if "skipped" in result:  # too few cells, or spatial spots: none called
        return
    adata = s.adata
    rate, rate_from = expected_rate(adata.n_obs, expected_doublet_rate)
    batches = _batches(adata.n_obs, s.seed)
    comps = result["n_prin_comps"]  # as Scrublet could use them
    comps = comps if isinstance(comps, list) else [comps] * len(batches)
    scores, sims = np.full(adata.n_obs, np.nan), []
    for cells, k in zip(batches, comps, strict=True):
        batch = adata[cells].copy()
        sc.pp.scrublet(batch, expected_doublet_rate=rate, threshold=0.0, n_prin_comps=k,
                       random_state=s.seed, use_approx_neighbors=False, verbose=False)  # fmt: skip
        scores[cells] = batch.obs["doublet_score"].to_numpy(dtype=float)
        sims.append(np.asarray(batch.uns["scrublet"]["doublet_scores_sim"]))
    sim = np.concatenate(sims)
    if threshold is None:  # one threshold from all batches' simulated doublets, bounded
        threshold, _ = _bounded(scores, _automatic_threshold(sim), rate, rate_from)
    adata.obs["doublet_score"], adata.obs["predicted_doublet"] = scores, scores > threshold
    adata.uns["scrublet"] = {"doublet_scores_sim": sim, "threshold": threshold}  # for the plot


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
        _score(adjacency, expression, coords, resolution, s.seed)


def leiden(s: Plain, result: dict, resolution: float, key_added: str) -> None:
    sc.tl.leiden(s.adata, resolution=resolution, key_added=key_added, random_state=s.seed,
                 **LEIDEN_ARGS)  # fmt: skip


def remove_ambient(
    s: Plain, result: dict, groupby: str, round_to_int: bool, max_iterations: int, **_: Any
) -> None:
    adata = s.adata
    codes, _ = adata.obs[groupby].astype(str).factorize(sort=True)
    matrix = sparse.csr_matrix(counts_matrix(adata), dtype=np.float64)
    if result["method"] == "soupx":  # the soup: the input's droplets, else the raw matrix's
        if SOUP_COLUMN in adata.var:
            soup = adata.var[SOUP_COLUMN].to_numpy(dtype=float)
        else:
            soup = _raw_soup(s.path(s.raw_input), adata.var_names)
        soup = soup / soup.sum()
        corrected = soupx.subtract(matrix, codes, soup, soupx.estimate_rho(matrix, codes, soup).rho)
    else:
        fit = decontx.decontx(matrix, codes, np.random.default_rng(s.seed), max_iterations)
        corrected = fit.native
        adata.obs["ambient_contamination"] = fit.contamination.astype(np.float32)
    if round_to_int:
        corrected = soupx.round_to_int(corrected, np.random.default_rng(s.seed))
    adata.layers[LAYER] = sparse.csr_matrix(corrected, dtype=np.float32)


def rank_genes_groups(s: Plain, result: dict, groupby: str, method: str, **_: Any) -> None:
    adata = s.adata
    if adata.obs[groupby].dtype.name != "category":
        adata.obs[groupby] = adata.obs[groupby].astype(str).astype("category")
    kwargs = {"random_state": s.seed} if method == "logreg" else {}
    rank_singlets(adata, groupby, method=method, **kwargs)


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
    genes = all_genes(adata)
    names = genes.var_names.astype(str)
    species = result["species"]
    if markers_file is None:
        markers = default_markers(species)
    else:
        path = s.path(markers_file)
        markers = parse_markers(json.loads(path.read_text()), str(path))
    undetected = (adata.uns.get("filter_genes") or {}).get("undetected_genes", [])
    matched = match(markers, names, undetected)
    thresholds = (min_score, min_detection, top_ranked)
    evidence_of = clusters.where(~flagged(adata))  # kept doublets give no evidence
    table, _ = evidence_table(adata, matched, evidence_of, groupby, species, s.seed, thresholds)
    gates, groups = gate(adata, genes, matched, evidence_of, table)
    labels = {
        cluster: _label(
            evidence.set_index("cell_type"),
            None if gates is None else gates[gates["cluster"] == cluster],
            {lineage: by_group[cluster] for lineage, by_group in groups.items()},
            thresholds,
        )
        for cluster, evidence in table.groupby("cluster", sort=False)
    }
    mapping = {c: e["label"] for c, e in labels.items()}
    mapping.update(dict.fromkeys(set(clusters) - set(mapping), UNKNOWN))  # doublets only
    ambiguous = {c: f"{e['label']}|{e['runner_up']}" for c, e in labels.items() if e["ambiguous"]}
    adata.obs[key_added] = clusters.map(mapping).astype("category")
    adata.obs[f"{key_added}_ambiguous"] = clusters.isin(list(ambiguous)).to_numpy()
    adata.uns["annotation"] = {  # what the dotplot and the score plot draw
        "groupby": groupby, "key_added": key_added, "species": species,
        "markers": matched.sets, "cluster_labels": mapping, "ambiguous": ambiguous,
        "table": table.assign(ranked=table["ranked"].str.join(" ")),
    }  # fmt: skip


def plot(
    s: Plain, result: dict, kind: str, color: str | None, groupby: str, filename: str | None
) -> None:
    folder = s.outdir / "plots"
    folder.mkdir(parents=True, exist_ok=True)
    # the tool's figures; they read only the data and the seed, which Plain holds as a session
    fig = _figure(s, kind, color, groupby)
    default = f"{kind}_{color or groupby}.png" if kind == "umap" else f"{kind}.png"
    fig.savefig(folder / (filename or default), dpi=100, bbox_inches="tight")
    plt.close("all")


def finish(s: Plain, result: dict, **_: Any) -> None:
    s.adata.write_h5ad(s.outdir / "adata.h5ad")


STEPS: dict[str, Callable[..., None]] = {f.__name__: f for f in (
    load_data, call_cells, filter_cells, filter_genes, qc_metrics, filter_by_qc, detect_doublets,
    remove_doublets, normalize, highly_variable_genes, scale, pca, neighbors, umap, cluster_sweep,
    leiden, remove_ambient, rank_genes_groups, annotate_clusters, plot, finish,
)}  # fmt: skip


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: python -m bench._plain_scanpy WORLD_STATE INPUT OUTDIR", file=sys.stderr)
        return 2
    record_path, input_path, outdir = Path(argv[0]), Path(argv[1]), Path(argv[2])
    record = WorldState.load(record_path)
    outdir.mkdir(parents=True, exist_ok=True)
    meta = record.meta
    s = Plain(input_path, outdir, record_path.resolve().parent, int(meta.get("seed", 0)),
              meta.get("raw_input"))  # fmt: skip
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
