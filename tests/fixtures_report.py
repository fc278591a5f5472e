"""One real reference analysis of a demo sample, and its replay, shared by the replay and report
tests (session scope: the analysis takes ~20 s, so it runs once)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pytest

from agent.data.synthetic import DEMO_COHORT, truth_path, write_sample

DEMO_SAMPLE = "pbmc2"  # the smallest demo sample (1,500 cells, .h5ad)


@dataclass(frozen=True)
class DemoRun:
    input: Path
    outdir: Path
    world_state: Path
    truth: Path


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> DemoRun:
    """`agent run --policy reference` on a demo sample, in process (read-only for tests)."""
    from agent.config import RunConfig
    from agent.runner import run_sample

    root = tmp_path_factory.mktemp("report_demo")
    input_path = write_sample(DEMO_COHORT[DEMO_SAMPLE], root / "data" / DEMO_SAMPLE)
    outdir = root / "samples" / DEMO_SAMPLE
    assert run_sample(RunConfig(input=input_path, outdir=outdir, sample=DEMO_SAMPLE)) == "finished"
    return DemoRun(input_path, outdir, outdir / "world_state.json", truth_path(input_path))


@pytest.fixture(scope="session")
def demo_replay(demo_run: DemoRun) -> dict[str, Any]:
    """The replay of the demo run, written as replay.json beside its world state."""
    from agent.replay import replay

    doc = replay(demo_run.world_state)
    (demo_run.outdir / "replay.json").write_bytes(orjson.dumps(doc))
    return doc


# A careless model's choices on the demo sample, each of which a check answers: a cell filter
# that would remove 95% of the cells (refused), a gene filter given twice in one reply (the
# stricter in force), no cell filter and no doublets (so labels come out doubtful), a conclusion
# the object contradicts, and a finish told why it is partial.
CARELESS_CONCLUSION = "30 clusters, all T cells"
CARELESS_REASON = "doublets were not looked for"


def _reply(tool: str, **arguments: Any) -> dict[str, Any]:
    return {"tool": tool, "arguments": orjson.dumps(arguments).decode()}


@pytest.fixture(scope="session")
def careless_run(demo_run: DemoRun, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`agent run --policy llm` on the demo sample against the scripted model (about 15 s);
    its sample folder."""
    import anndata as ad
    import numpy as np

    from agent.cli import main
    from agent.testing.scripted_server import ScriptedServer

    counts = ad.read_h5ad(demo_run.input).X
    genes_per_cell = np.asarray((counts > 0).sum(axis=1)).ravel()
    script = [
        _reply("load_data"), _reply("call_cells"), _reply("qc_metrics"),
        _reply("filter_by_qc", min_genes=int(np.percentile(genes_per_cell, 95))),
        {"calls": [_reply("filter_genes", min_cells=10), _reply("filter_genes", min_cells=1)]},
        _reply("normalize"), _reply("highly_variable_genes"), _reply("pca", n_comps=20),
        _reply("neighbors"), _reply("leiden", resolution=0.3), _reply("rank_genes_groups"),
        _reply("annotate_clusters"),
        _reply("finish", conclusion=CARELESS_CONCLUSION, partial=CARELESS_REASON),
    ]  # fmt: skip
    outdir = tmp_path_factory.mktemp("careless") / "careless"
    server = ScriptedServer(max_model_len=200_000)  # the tool schemas exceed its default 8K
    server.script = script
    try:
        argv = ["run", "--input", str(demo_run.input), "--outdir", str(outdir),
                "--sample", "careless", "--policy", "llm", "--base-url", server.base_url,
                "--model", "scripted", "--max-steps", "30"]  # fmt: skip
        assert main(argv) == 0
    finally:
        server.close()
    return outdir
