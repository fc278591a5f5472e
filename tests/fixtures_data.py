"""Synthetic samples and sessions at any stage of the reference recipe.

The loop-free runner and the single tool call that the tests use are those of
agent/testing/reference_run.py, which the benchmarks share (``run_reference`` drives the registry
with the ReferencePolicy in a plain for-loop: what the agent loop does, minus prompts and budgets,
so tool and policy tests do not depend on it).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from agent.data.synthetic import DEMO_COHORT, SampleSpec, truth_path, write_sample
from agent.policies.reference import ReferencePolicy
from agent.record.truth import read_truth, score
from agent.record.world_state import Entry, WorldState
from agent.testing.reference_run import REGISTRY
from agent.tools.session import Session

# Small enough for seconds per tool, big enough for every step (scrublet needs 100+ cells).
SMALL = SampleSpec("small", 800, seed=7, format="h5ad", damaged_fraction=0.1, doublet_fraction=0.05)


def recovery(session: Session, input_path: str | Path, key: str = "leiden") -> dict[str, Any]:
    """The report's recovery scores (ARI, doublet recall, ...) plus cell-type label accuracy."""
    truth = read_truth(truth_path(input_path))
    adata = session.adata
    out = score(adata.obs, truth, cluster_key=key)
    here = truth.loc[adata.obs_names]
    singlets = (~here["is_doublet"] & ~here["is_empty"]).to_numpy()
    if "cell_type" in adata.obs:
        labels = adata.obs["cell_type"].astype(str).to_numpy()[singlets]
        out["label_accuracy"] = float((labels == here["cell_type"].to_numpy()[singlets]).mean())
    return out


@pytest.fixture(scope="session")
def demo_inputs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The demo cohort, written once per test session: sample name -> input path."""
    root = tmp_path_factory.mktemp("demo")
    return {name: write_sample(spec, root / name) for name, spec in DEMO_COHORT.items()}


@pytest.fixture(scope="session")
def small_input(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An 800-cell synthetic .h5ad (with truth.tsv beside it)."""
    return write_sample(SMALL, tmp_path_factory.mktemp("small"))


@pytest.fixture(scope="session")
def reference_stages(small_input: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The small sample after each step of the reference recipe: tool -> (AnnData, done set,
    result, stages reached)."""
    outdir = tmp_path_factory.mktemp("stages")
    registry = REGISTRY
    session = Session(outdir, seed=0, input_path=small_input)
    world = WorldState()
    policy = ReferencePolicy(registry)
    stages: dict[str, Any] = {}
    for _ in range(60):
        decision = policy.decide([], registry.schemas(), world)
        if not decision.calls:
            break
        call = decision.calls[0]
        outcome = registry.call(call.name, call.arguments, session)
        assert outcome.ok, f"reference step {call.name} failed on the small sample: {outcome.error}"
        world.add(
            Entry(
                **vars(outcome), step=world.next_step, digest_before=None, digest_after=None,
                call_id=call.id,
            )
        )  # fmt: skip
        if outcome.tool == "finish":
            break
        stages[outcome.tool] = (
            session.adata.copy(), set(session.done), outcome.result, dict(session.stages),
        )  # fmt: skip
    return stages


@pytest.fixture
def session_at(
    reference_stages: dict[str, Any], small_input: Path, tmp_path: Path
) -> Callable[[str], Session]:
    """A fresh session (own output folder) holding the small sample as it was after ``tool``."""

    def make(tool: str) -> Session:
        session = Session(tmp_path / f"after_{tool}", seed=0, input_path=small_input)
        adata, done, _, stages = reference_stages[tool]
        session.adata = adata.copy()
        session.done, session.stages = set(done), dict(stages)
        return session

    return make


@pytest.fixture
def fresh_session(small_input: Path, tmp_path: Path) -> Session:
    """An empty session whose run input is the small sample."""
    return Session(tmp_path / "out", seed=0, input_path=small_input)
