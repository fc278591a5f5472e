"""The checks of decisions (agent/checks.py): stages declared by the tools, staleness, the
record's typed checks and their schema. The careless-model scenarios are in
tests/test_careless_model.py."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from agent import checks
from agent.registry import STAGES, Refusal, ToolRegistry, ToolSpec, tool
from agent.tools import TOOLS
from agent.tools.finish import reaching

SCHEMA = json.loads(
    (Path(__file__).parents[1] / "agent/schemas/world_state.schema.json").read_text()
)


def test_every_stage_is_reached_by_a_declared_tool():
    declared = {fn.spec.stage for fn in TOOLS if fn.spec.stage}
    assert declared == set(STAGES)
    for stage in STAGES:
        assert reaching(stage) and all(
            name in {fn.__name__ for fn in TOOLS} for name in reaching(stage)
        )


def test_the_record_schema_holds_the_check_model_and_its_rules():
    assert SCHEMA["$defs"]["Check"] == checks.schema()
    assert SCHEMA["$defs"]["RunMeta"]["properties"]["checks"]["items"] == {"$ref": "#/$defs/Check"}
    assert "partial" in SCHEMA["$defs"]["RunMeta"]["properties"]["status"]["enum"]
    assert set(checks.RULES) == set(checks.schema()["properties"]["rule"]["enum"])


class Stages:
    """A session with what the tool wrapper and finish use: done, stages and their staleness."""

    def __init__(self):
        from agent.tools.session import Session

        self.done: set[str] = set()
        self.stages: dict = {}
        self.stale: dict = {}
        self.reached = Session.reached.__get__(self)
        self.missing_stages = Session.missing_stages.__get__(self)

    def require(self, *_):
        pass


@tool("cluster", stage="clusters", resets="markers", clustering="key_added")
def cluster(session, key_added: str = "leiden") -> dict:
    """Cluster."""
    return {}


@tool("annotate", stage="labels", clustering="groupby", loosens={"min_score": "lower"})
def label(session, groupby: str = "leiden", min_score: float = 0.1) -> dict:
    """Label."""
    return {}


@tool("cell_filter", resets="hvg")
def trim(session) -> dict:
    """Remove some cells."""
    raise Refusal(checks.check("removed_share", "refused", "too many", share=0.95))


REGISTRY = ToolRegistry([cluster, label, trim])


def test_a_later_clustering_makes_the_labels_stale_and_labels_count_for_the_current_one():
    s = Stages()
    REGISTRY.call("cluster", {}, s)
    REGISTRY.call("label", {}, s)
    assert "labels" not in s.missing_stages()
    REGISTRY.call("cluster", {}, s)  # clustered again: the labels were of the clusters before
    assert s.missing_stages()["labels"] == "stale after cluster"
    REGISTRY.call("label", {}, s)
    REGISTRY.call("cluster", {"key_added": "fine"}, s)  # another clustering is the current one
    REGISTRY.call("label", {"groupby": "leiden"}, s)
    assert "not the current clustering 'fine'" in s.missing_stages()["labels"]


def test_a_refusal_is_an_error_whose_entry_keeps_its_check():
    out = REGISTRY.call("trim", {}, Stages())
    assert out.status == "error" and out.error == "too many"
    assert out.result == {
        "checks": [checks.check("removed_share", "refused", "too many", share=0.95)]
    }
    assert out.for_model() == {"error": "too many"}


@pytest.mark.parametrize(("score", "verdict"), [(0.1, "pass"), (0.5, "pass"), (-5.0, "warn")])
def test_evidence_thresholds_loosened_below_their_defaults_warn(score, verdict):
    out = REGISTRY.call("label", {"min_score": score}, Stages())
    (found,) = out.result["checks"]
    assert found["rule"] == "evidence_settings" and found["verdict"] == verdict
    if verdict == "warn":
        assert found["evidence"]["loosened"] == {"min_score": {"given": -5.0, "default": 0.1}}


def entry(step, tool, status="ok", result=None):
    return SimpleNamespace(step=step, tool=tool, status=status, result=result, params={})


def test_repeated_filters_compose_to_the_strictest_and_are_flagged():
    record = [
        entry(1, "load_data"),
        entry(2, "filter_by_qc", result={"thresholds": {"max_pct_mt": 5.0, "min_genes": 100}}),
        entry(3, "filter_by_qc", result={"thresholds": {"max_pct_mt": 50.0, "min_genes": 300}}),
        entry(4, "filter_cells", result={"thresholds": {"min_genes": 10}}),
    ]
    (repeated,) = checks.collect(record)
    assert repeated.rule == "filter_repeated" and repeated.step == 3
    assert repeated.evidence["effective"] == {"max_pct_mt": 5.0, "min_genes": 300}
    again = [*record, entry(5, "load_data"), entry(6, "filter_by_qc", result={"thresholds": {}})]
    assert len(checks.collect(again)) == 1  # a new load starts again


def test_ambiguous_labels_are_a_check_of_their_own():
    record = [
        entry(1, "annotate_clusters", result={"ambiguous": {"3": "CD4 T|CD8 T"}}),
        entry(2, "annotate_celltypist", result={"weak_clusters": ["4"]}),
        entry(3, "annotate_clusters", result={"ambiguous": {}}),
    ]
    found = checks.collect(record)
    assert [(c.step, c.verdict) for c in found] == [(1, "warn"), (2, "warn"), (3, "pass")]
    assert "cluster 3: CD4 T|CD8 T" in found[0].message


@pytest.mark.parametrize(
    ("removed", "override", "verdict"),
    [(40, None, "pass"), (60, None, "warn"), (95, None, "refused"), (95, "why", "warn")],
)
def test_the_share_a_filter_removes(removed, override, verdict):
    found = checks.removed_share("f", "cells", 100, 100 - removed, 100, override)
    assert found["verdict"] == verdict and found["evidence"]["share"] == removed / 100
    if override:
        assert found["evidence"]["override_reason"] == "why"


def test_a_cut_split_over_calls_counts_whole():
    """75% and then 80% of the rest: each call alone under 90%, 95% since the first filter."""
    first = checks.removed_share("f", "cells", 1000, 250, 1000, None)
    then = checks.removed_share("f", "cells", 250, 50, 1000, None)
    assert first["verdict"] == "warn" and then["verdict"] == "refused"
    assert then["evidence"]["share_since_first"] == 0.95


def test_spec_of_a_tool_without_stage_declares_nothing():
    spec = ToolSpec("plot")
    assert (spec.stage, spec.resets, spec.clustering, dict(spec.loosens)) == (None, None, None, {})


def test_a_checkpoint_from_before_stages_were_kept_gets_them_from_the_record(small_input, tmp_path):
    """Resuming from a checkpoint whose sidecar names no stages: the record's steps up to it give
    the stages the data had reached, as the run itself had them."""
    from agent.resume import catch_up
    from agent.testing.reference_run import run_reference
    from agent.tools import build_registry
    from agent.tools.session import Session

    session, world = run_reference(small_input, tmp_path, stop_after="neighbors")
    for sidecar in session.layout.checkpoints.glob("step_*.json"):
        doc = json.loads(sidecar.read_text())
        doc.pop("stages"), doc.pop("stale")
        sidecar.write_text(json.dumps(doc))
    resumed = Session(tmp_path, seed=0, input_path=small_input)
    catch_up(world, resumed, build_registry())
    assert resumed.stages == session.stages and "neighbours" in resumed.stages
