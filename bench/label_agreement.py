"""Per-type label agreement of the lineage-gated marker labels on held-out real sets (issue 37).

The lineage gate's detection and level thresholds were chosen on CellTypist's sample alone (its
'uniform' detection was checked on pbmc68k's T sorts, and the subtype thresholds on all three
shipped sets: see agent/tools/lineage.py and annotate.py); the sets here are those of
tests/test_tools_lineage.py (agent/testing/held_out.py): scanpy's
pbmc68k_reduced as T cells only, as NK with CD8 and memory CD4 T cells, thinned to half its
depth (each with its published Zheng 2017 bulk-profile labels), Seurat's pbmc_small and the
CellTypist sample on a 765-gene panel (no published labels: its clusters are listed). Each is
analysed by the reference recipe up to annotate_clusters.

Printed per published type: its cells, the share labelled in its lineage (a type of it, its
group such as 'CD8 T', or the lineage's own name), and the labels they got; per unlabelled set,
each cluster's label, lineage, the share of its cells detecting CD3, and the flags.

    python -m bench.label_agreement
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from bench import _report


def main() -> None:
    from agent.testing import held_out as held

    _report.header("Lineage-gated marker labels on held-out real sets")
    inputs = held.held_out_inputs()
    if not inputs:
        print("no real set installed: pip install -e '.[test]' and bash tests/realdata/install.sh")
        return
    with tempfile.TemporaryDirectory() as tmp:
        for name in sorted(set(inputs) - {held.TUNING}):
            adata, published = inputs[name]
            start = time.perf_counter()
            session = held.analyse(adata, Path(tmp) / name.replace(" ", "_"))
            seconds = time.perf_counter() - start
            result = session.adata
            print(f"\n{name}: {adata.n_obs} cells x {adata.n_vars} genes, {result.n_obs} kept "
                  f"({seconds:.0f} s to annotate_clusters)")  # fmt: skip
            labels = result.obs["cell_type"].astype(str)
            if published is not None:
                _per_type(held, labels, published.loc[labels.index])
            else:
                _per_cluster(held, session)
    print(_report.load_line("at end"))


def _per_type(held, labels, published) -> None:
    agreement = held.agreement(labels, published)
    rows = [
        [kind, int((published == kind).sum()), f"{share:.2f}",
         ", ".join(f"{k} {v}" for k, v in labels[published == kind].value_counts()[:3].items())]
        for kind, share in agreement.items()
    ]  # fmt: skip
    print(_report.table(["published type", "cells", "lineage agrees", "labels (top 3)"], rows))


def _per_cluster(held, session) -> None:
    annotation = session.adata.uns["annotation"]
    cd3 = held.detected(session, held.CD3)
    sizes = session.adata.obs["leiden"].astype(str).value_counts()
    rows = [
        [cluster, int(sizes[cluster]), label, annotation["cluster_lineages"][cluster],
         f"{cd3[cluster]:.2f}", annotation["ambiguous"].get(cluster, "")]
        for cluster, label in annotation["cluster_labels"].items()
    ]  # fmt: skip
    print(_report.table(["cluster", "cells", "label", "lineage", "CD3 detected", "flag"], rows))


if __name__ == "__main__":
    main()
