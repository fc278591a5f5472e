"""ReferencePolicy: the standard scanpy recipe, with each value chosen from earlier results.

It reads no messages. The next call is a pure function of the world state's entries: the first
recipe step that has not succeeded yet, with arguments computed from the results of earlier
steps (QC thresholds from qc_metrics' MAD suggestions, n_pcs from pca's elbow, the resolution
from cluster_sweep...). A step that failed is retried with each fallback whose arguments were
not tried yet; an optional step then gets skipped, a required one ends the analysis with finish
(or, before any data were loaded, with no call at all). So it never makes the same failing call
twice, and it always ends.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from agent.config import LOAD_OPTIONS
from agent.policies.base import Decision, ToolCall

Args = dict[str, Any]
# Tools whose failure means the input cannot be analysed: no finish with what there is (for
# call_cells that would be an analysis of empty droplets).
REFUSES_INPUT = ("call_cells",)
Facts = Callable[[str], dict[str, Any]]  # tool name -> result of its latest successful call
ArgsFn = Callable[[Facts], Args | None]  # None: the step does not apply to these data


@dataclass(frozen=True)
class Step:
    tool: str
    args: ArgsFn
    fallbacks: tuple[ArgsFn, ...] = ()
    required: bool = False
    # tools that must have succeeded, else the step is skipped, besides the tool's own needs
    after: tuple[str, ...] = ()
    kind: str | None = None  # plots: one step per kind (and colour) of figure
    color: str | None = None
    # (key of the record's meta, wanted): the step applies only when the run set that option
    # (True), only when it did not (False), or only when it has this value (a string)
    option: tuple[str, bool | str] | None = None

    def matches(self, tool: str, params: Args) -> bool:
        if tool != self.tool:
            return False
        if self.kind is None:
            return True
        return params.get("kind") == self.kind and params.get("color") == self.color


def _const(args: Args) -> ArgsFn:
    return lambda facts: dict(args)


def _min_genes(facts: Facts) -> Args:
    # 200 genes is the usual empty-droplet cut; shallow data get a quarter of their median, not a
    # fixed floor (50 removed a third of a shallow sample: its platelets and B cells). Under 10
    # genes a barcode holds no usable profile at any depth. After cell calling, the cells' median
    # (that of all barcodes read is an empty droplet's).
    median = facts("call_cells").get("median_genes_per_cell") or facts("load_data").get(
        "median_genes_per_cell", 1000
    )
    return {"min_genes": int(min(200, max(10, median // 4)))}


def _qc_thresholds(facts: Facts) -> Args | None:
    suggested = facts("qc_metrics").get("suggested_thresholds")
    if not suggested:
        return None
    # None: a threshold that cannot act (max_pct_mt without mitochondrial genes)
    keys = ("min_genes", "max_genes", "max_pct_mt")
    return {k: suggested[k] for k in keys if suggested.get(k) is not None}


def _doublet_rate(facts: Facts) -> Args:
    # 10x: ~0.8% doublets per 1,000 cells recovered; below 7,500 cells Scrublet's customary 6%,
    # as its automatic threshold lands too high with a low expected rate. Where doublets cannot
    # be called (too few cells, spatial spots) the tool says so and calls none.
    cells = facts("filter_by_qc").get("cells_after") or facts("qc_metrics").get("n_cells", 5000)
    return {"expected_doublet_rate": round(min(0.15, max(0.06, 0.008 * cells / 1000)), 3)}


def _doublet_threshold(facts: Facts) -> Args:
    # The one failure a threshold fixes is Scrublet finding none automatically
    return {**_doublet_rate(facts), "threshold": 0.25}


def _if_doublets_called(args: Args) -> ArgsFn:
    """``args`` where detect_doublets called doublets; None where it said it could not."""
    return lambda facts: None if facts("detect_doublets").get("skipped") else dict(args)


def _hvg(flavor: str) -> ArgsFn:
    def args(facts: Facts) -> Args:
        genes = facts("filter_genes").get("genes_after") or facts("load_data").get("n_genes", 4000)
        return {
            "flavor": flavor,
            "n_top_genes": int(min(2000, max(50, genes // 2))),
            "subset": False,  # the saved object keeps all genes; pca uses the flagged ones
        }

    return args


def _pca(facts: Facts) -> Args:
    cells = facts("remove_doublets").get("cells_after") or facts("filter_by_qc").get(
        "cells_after", 1000
    )
    genes = facts("highly_variable_genes").get("n_highly_variable", 2000)
    return {"n_comps": int(min(50, cells - 1, genes - 1))}


def _neighbors(facts: Facts) -> Args:
    pca = facts("pca")
    # the elbow marks where signal ends; keeping a few components past it costs little and
    # protects small populations whose axes come late
    n_pcs = min(pca.get("n_comps", 50), max(10, pca.get("suggested_n_pcs", 20) + 5))
    return {"n_neighbors": 15, "n_pcs": int(n_pcs)}


def _leiden(facts: Facts) -> Args:
    best = facts("cluster_sweep").get("best_resolution")
    return {"resolution": best if best is not None else 1.0}


def _barcode_rank(facts: Facts) -> Args | None:
    unfiltered = facts("call_cells").get("decision") == "unfiltered"
    return {"kind": "barcode_rank"} if unfiltered else None


def _conclusion(facts: Facts) -> Args:
    parts = []
    if facts("call_cells").get("decision") == "unfiltered":
        parts.append(facts("call_cells")["reason"])
        parts += facts("call_cells").get("warnings") or []  # cells left uncalled, said here
    doublets = facts("detect_doublets")
    if doublets.get("skipped"):
        parts.append(doublets["skipped"])
    parts += doublets.get("warnings") or []  # a call bounded to the expected rate, with why
    if "removed" in facts("filter_by_qc"):
        parts.append(f"QC removed {facts('filter_by_qc')['removed']} low-quality cells")
    if "max_pct_mt" in (facts("qc_metrics").get("not_applied") or {}):
        parts.append("no mitochondrial genes: no MT filter")
    if "removed" in facts("remove_doublets"):
        parts.append(f"{facts('remove_doublets')['removed']} predicted doublets")
    elif facts("detect_doublets").get("n_predicted_doublets"):
        parts.append(
            f"{facts('detect_doublets')['n_predicted_doublets']} predicted doublets flagged and "
            "kept, left out of markers and labels' evidence"
        )
    ambient = facts("remove_ambient")
    if ambient:
        parts.append(
            f"ambient RNA ({ambient['method']}): contamination {ambient['contamination']:g}, "
            f"{ambient['removed_fraction']:.1%} of the counts removed into "
            f"layers['{ambient['layer']}']"
        )
    leiden = facts("leiden")
    if "n_clusters" in leiden:
        parts.append(
            f"{leiden['n_clusters']} Leiden clusters at resolution {leiden.get('resolution')}"
        )
    reference = facts("annotate_celltypist")
    if reference:
        model = reference["model"]
        parts.append(
            f"labels from CellTypist model {model['name']} version {model['version']} "
            f"(sha256 {model['sha256'][:12]}...)"
        )
    labels = reference.get("label_sizes") or facts("annotate_clusters").get("label_sizes")
    if labels:
        parts.append("labels: " + ", ".join(f"{k} ({v})" for k, v in labels.items()))
    # the final labels' own doubts: the model's weak clusters, else the markers' ambiguous ones
    ambiguous = facts("annotate_clusters").get("ambiguous")
    if reference:
        if reference.get("weak_clusters"):
            parts.append("weak evidence: clusters " + ", ".join(reference["weak_clusters"]))
    elif ambiguous:
        parts.append("ambiguous: " + ", ".join(f"cluster {k} {v}" for k, v in ambiguous.items()))
    unknown = facts("annotate_clusters").get("unknown")
    if unknown and not reference:  # clusters the marker sets gave no evidence for, and why
        parts.append("Unknown: " + ", ".join(f"cluster {k} ({v})" for k, v in unknown.items()))
    parts += facts("cluster_sweep").get("warnings") or []  # weak structure, said where it is
    return {"conclusion": "Reference scanpy recipe. " + "; ".join(parts) + "."}


def _partial(conclusion: ArgsFn, refused: Any) -> ArgsFn:
    """finish's arguments once it refused the analysis as incomplete: the conclusion, and as the
    partial reason the stages its refusal names, which the recipe could not reach."""

    def args(facts: Facts) -> Args:
        found = ((refused.result or {}).get("checks") or [{}])[0]
        missing = (found.get("evidence") or {}).get("missing") or {}
        stages = ", ".join(f"{k} ({v})" for k, v in missing.items()) or refused.error
        why = f"the reference recipe could not reach: {stages}"
        return {**(conclusion(facts) or {}), "partial": why}

    return args


# set when the run has a CellTypist model (agent run --celltypist-model)
MODEL = "celltypist_model_sha256"
# the run's doublets setting (agent run --doublets); records made before it removed them
DOUBLETS = "doublets"
OPTION_DEFAULTS = {DOUBLETS: "remove"}


def _option_holds(option: tuple[str, bool | str], meta: dict[str, Any]) -> bool:
    key, wanted = option
    if isinstance(wanted, bool):
        return bool(meta.get(key)) == wanted
    return meta.get(key, OPTION_DEFAULTS.get(key)) == wanted


RECIPE: tuple[Step, ...] = (
    Step("load_data", _const({}), required=True),
    # an unfiltered droplet matrix: its cells called before anything counts them; a refusal
    # refuses the input (REFUSES_INPUT)
    Step("call_cells", _const({}), required=True),
    Step("plot", _barcode_rank, kind="barcode_rank"),
    Step("filter_cells", _min_genes),
    Step("filter_genes", _const({"min_cells": 3})),
    Step("qc_metrics", _const({})),
    # the violin before filtering, with the suggested thresholds: it shows the cells they remove
    Step("plot", _const({"kind": "qc_violin"}), kind="qc_violin"),
    Step("plot", _const({"kind": "qc_scatter"}), kind="qc_scatter"),
    Step("filter_by_qc", _qc_thresholds, fallbacks=(_const({"max_pct_mt": 20.0}),)),
    Step("detect_doublets", _doublet_rate, fallbacks=(_doublet_threshold,)),
    # the scores with the threshold, before the cells above it are removed
    Step("plot", _if_doublets_called({"kind": "doublet_scores"}), kind="doublet_scores"),
    Step("remove_doublets", _if_doublets_called({}), option=(DOUBLETS, "remove")),
    Step("normalize", _const({}), required=True),
    Step("highly_variable_genes", _hvg("seurat_v3"), fallbacks=(_hvg("seurat"),)),
    Step("scale", _const({"max_value": 10.0})),
    Step("pca", _pca, fallbacks=(_const({"n_comps": 20}),), required=True),
    Step("neighbors", _neighbors, fallbacks=(_const({}),), required=True),
    Step("umap", _const({})),
    Step("cluster_sweep", _const({})),
    Step("leiden", _leiden, fallbacks=(_const({"resolution": 1.0}),), required=True),
    # ambient RNA, per sample, on the clusters (SoupX needs them): SoupX where the empty droplets
    # were read, else DecontX, and DecontX where SoupX has no estimate; the corrected counts are
    # a layer beside the raw ones (nf-core/scdownstream's default), markers stay on the raw
    Step("remove_ambient", _const({}), fallbacks=(_const({"method": "decontx"}),)),
    Step("rank_genes_groups", _const({"groupby": "leiden", "method": "wilcoxon"}),
         fallbacks=(_const({"groupby": "leiden", "method": "t-test"}),)),
    Step("annotate_clusters", _const({"groupby": "leiden"}), option=(MODEL, False)),
    # with a reference model its labels are the cell types; the marker labels are kept beside
    # them for comparison (the dotplot shows their genes)
    Step("annotate_clusters", _const({"groupby": "leiden", "key_added": "cell_type_markers"}),
         option=(MODEL, True)),
    Step("annotate_celltypist", _const({"groupby": "leiden"}), option=(MODEL, True)),
    Step("plot", _const({"kind": "umap", "color": "leiden"}), kind="umap", color="leiden"),
    Step("plot", _const({"kind": "umap", "color": "cell_type"}), after=("annotate_clusters",),
         kind="umap", color="cell_type"),
    Step("plot", _const({"kind": "dotplot", "groupby": "leiden"}), after=("annotate_clusters",), kind="dotplot"),
    # the evidence behind the labels: cluster x type scores, the label chosen, the types qualified
    Step("plot", _const({"kind": "annotation_scores"}), after=("annotate_clusters",),
         kind="annotation_scores"),
    Step("finish", _conclusion, fallbacks=(_const({}),), required=True),
)  # fmt: skip


def _params(entry: Any) -> Args:
    """An entry's parameters; for a call that failed validation, the arguments as sent."""
    raw = entry.rejected_arguments
    if raw is None:
        return entry.params or {}
    if isinstance(raw, str | bytes):
        try:
            raw = orjson.loads(raw or "{}")
        except orjson.JSONDecodeError:
            return {}
    return raw if isinstance(raw, dict) else {}


def _same(args: Args, params: Args, defaults: Args) -> bool:
    """Whether a call with ``args`` was already made; recorded params may have defaults filled in."""
    return {**defaults, **args} == {**defaults, **params}


# load_data names the one change of arguments that fixes a refusal as load_data(NAME='VALUE')
LOAD_FIX = re.compile(r"load_data\((\w+)=('[^']*'|\"[^\"]*\")\)")


def _load_args(
    base: Args, meta: dict[str, Any], attempts: list[Any], defaults: Args
) -> Args | None:
    """load_data's next arguments: ``base`` with the run's options; after a failure, the last
    arguments with the change its error names, unless tried already or overriding a run option.
    None: nothing can fix the input."""
    options = {k: meta[k] for k in LOAD_OPTIONS if meta.get(k)}  # as the run set them
    if not attempts:
        return {**base, **options}
    fix = LOAD_FIX.search(attempts[-1].error or "")
    if fix is None or fix[1] in options:
        return None
    last = {k: v for k, v in _params(attempts[-1]).items() if v is not None}
    args = {**last, fix[1]: ast.literal_eval(fix[2])}
    return None if any(_same(args, _params(e), defaults) for e in attempts) else args


class ReferencePolicy:
    """Follows RECIPE; see the module docstring."""

    def __init__(self, registry: Any = None, recipe: tuple[Step, ...] = RECIPE):
        """``registry``: the run's ToolRegistry (default: the agent's tools). Its defaults make a
        recorded call with defaults filled in count as the call that was asked for; its tool
        metadata says which steps must have succeeded before a recipe step applies."""
        if registry is None:
            from agent.tools import build_registry

            registry = build_registry()
        self.registry, self.defaults, self.recipe = registry, registry.defaults(), recipe

    def decide(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], world: Any
    ) -> Decision:
        entries = list(world.entries)
        step_no = entries[-1].step + 1 if entries else 1
        ok_tools = {e.tool for e in entries if e.status == "ok"}
        defaults = self.defaults

        def facts(tool: str) -> dict[str, Any]:
            for e in reversed(entries):
                if e.tool == tool and e.status == "ok":
                    return e.result or {}
            return {}

        def call(step: Step, args: Args, note: str | None = None) -> Decision:
            text = note or f"reference recipe: {step.tool}"
            arguments = orjson.dumps(args).decode()
            return Decision(
                [ToolCall(f"ref-{step_no}", step.tool, arguments)],
                text=text,
                finish_reason="tool_calls",
            )

        for step in self.recipe:
            if step.option and not _option_holds(step.option, world.meta):
                continue
            attempts = [e for e in entries if step.matches(e.tool, _params(e))]
            if any(e.status == "ok" for e in attempts):
                continue
            needs = self.registry.spec(step.tool).needs_for(step.args(facts) or {})
            if not {*needs, *step.after} <= ok_tools:
                continue
            if step.tool == "load_data":  # the run's options, then the fix an error names
                args = _load_args(
                    step.args(facts), world.meta, attempts, defaults.get(step.tool, {})
                )
                if args is None:  # the input is refused: no call ends the run at once
                    return Decision(
                        text=f"input refused: {attempts[-1].error}", finish_reason="stop"
                    )
                retry = f"retrying load_data after: {attempts[-1].error}" if attempts else None
                return call(step, args, retry)
            if step.tool in REFUSES_INPUT and attempts:
                return Decision(text=f"input refused: {attempts[-1].error}", finish_reason="stop")
            tried = [_params(e) for e in attempts]
            fallbacks = step.fallbacks
            if step.tool == "finish" and attempts:  # refused as incomplete: say so, and why
                fallbacks = (*fallbacks, _partial(step.args, attempts[-1]))
            for variant in (step.args, *fallbacks):  # the first not tried yet
                args = variant(facts)
                if args is None or any(
                    _same(args, done, defaults.get(step.tool, {})) for done in tried
                ):
                    continue
                retry = (
                    f"retrying {step.tool} with a fallback after: {attempts[-1].error}"
                    if attempts
                    else None
                )
                return call(step, args, retry)
            if not step.required:
                continue
            # a required step cannot be done: save what there is, unless there is nothing
            finish = self.recipe[-1]
            finished_tries = sum(1 for e in entries if e.tool == finish.tool)
            if "load_data" in ok_tools and step.tool != finish.tool and finished_tries == 0:
                why = f"{step.tool} failed ({attempts[-1].error if attempts else 'no arguments'})"
                return call(finish, {"conclusion": f"stopped early: {why}", "partial": why})
            reason = attempts[-1].error if attempts else "no arguments"
            return Decision(
                text=f"reference recipe cannot go on: {step.tool} failed ({reason})",
                finish_reason="stop",
            )
        return Decision(text="reference recipe complete", finish_reason="stop")
