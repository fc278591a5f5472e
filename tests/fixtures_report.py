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
